// decent_dp_topology: inspect a topology before launching a run.
//
//   decent_dp_topology --name ring -n 8
//   decent_dp_topology --name aer -n 16 --lws 4 --params 11.2e6 --dtype-bytes 4 --json
//
// Prints every slot's groups and weights, the spectral gap of one period and the bytes a
// rank sends per step when the model has --params parameters. Bytes use the bandwidth-
// optimal all-reduce of a group of k ranks: 2 (k - 1) / k * model bytes (0 for k = 1).
// With --lws > 1 (ranks per node, placed in order) each slot also reports what crosses node
// boundaries (decent_dp/topology/traffic.h): the most bytes one rank sends to another node,
// the most bytes leaving one node through its NIC, and the most ranks of one node sending
// across at once.
//
//   decent_dp_topology --plan -n 8 --lws 2 --params 3e6 --compute-ms 300
//                      --intra-bw 2000 --inter-bw 30 [--flow-bw 0] [--shared-efficiency 1]
//                      [--ring-efficiency 0] [--latency-us 0]
//
// --plan predicts the time per step of all-reduce and of every built-in topology that fits
// (or of --name, when given) on that cluster (Note [planner model] in
// decent_dp/topology/planner.h), fastest first; bandwidths are in MB/s (10^6 bytes/s), as
// measured (benchmarks/emulate/calibrate measures them with the library's all-reduce).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <numeric>

#include "decent_dp/topology/planner.h"
#include "decent_dp/topology/topology.h"
#include "decent_dp/topology/traffic.h"

namespace {

double allreduce_bytes(int k, double model_bytes) {
  return k <= 1 ? 0.0 : 2.0 * (k - 1) / k * model_bytes;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", b, units[u]);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace decent_dp::topology;
  CLI::App app{"Inspect a decent_dp topology: slots, groups, weights, spectral gap, traffic"};
  std::string name = "complete";
  int n = 8;
  int lws = 1;
  double params = 11173962;  // ResNet-18 on CIFAR-10
  int dtype_bytes = 4;
  bool json = false;
  app.add_option("--name", name, "topology name (see --list)");
  app.add_option("-n,--world-size", n, "number of ranks")->check(CLI::PositiveNumber);
  app.add_option("--lws,--local-world-size", lws, "ranks per node")->check(CLI::PositiveNumber);
  app.add_option("--params", params, "model parameters, for the traffic estimate")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dtype-bytes", dtype_bytes, "bytes per parameter")->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "print JSON instead of text");
  int gap_max_n = 512;
  app.add_option("--spectral-gap-max-n", gap_max_n,
                 "compute the spectral gap only up to this world size (dense O(n^3); 0: never)")
      ->check(CLI::NonNegativeNumber);
  bool list = false;
  app.add_flag("--list", list, "list the registered topologies and exit");
  bool plan = false;
  PlanInputs in;
  double bucket_mb = 25, intra_mbs = 0, inter_mbs = 0, flow_mbs = 0;
  std::vector<double> buckets_mb;
  app.add_flag("--plan", plan, "predict the step time of all-reduce and the topologies");
  app.add_option("--compute-ms", in.compute_ms, "plan: forward + backward ms per step and rank")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--backward-fraction", in.backward_fraction, "plan: backward's share of compute")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--jitter-ms", in.jitter_ms, "plan: uniform extra compute per rank and step, max")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer-ms", in.optimizer_ms, "plan: optimizer ms per step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-mb", bucket_mb, "plan: the wrappers' bucket_cap_mb")
      ->check(CLI::PositiveNumber);
  app.add_option("--buckets", buckets_mb,
                 "plan: bucket sizes in MiB, in gradient-ready order "
                 "(instead of --params / --bucket-mb)");
  app.add_option("--intra-bw", intra_mbs, "plan: MB/s of a link inside a node")
      ->check(CLI::PositiveNumber);
  app.add_option("--inter-bw", inter_mbs, "plan: MB/s out of one node's NIC")
      ->check(CLI::PositiveNumber);
  app.add_option("--flow-bw", flow_mbs, "plan: MB/s cap of one flow across nodes (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--shared-efficiency", in.shared_efficiency,
                 "plan: share of a NIC that several flows in flight across get together, as "
                 "pairwise exchanges")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--ring-efficiency", in.ring_efficiency,
                 "plan: the same for edges of rings of 3 or more members (0: "
                 "--shared-efficiency)")
      ->check(CLI::Range(0.0, 1.0));
  bool fifo = false;
  app.add_flag("--fifo-exchanges", fifo,
               "plan: exchanges on one link run one after another instead of sharing it");
  app.add_option("--latency-us", in.latency_us, "plan: microseconds per ring step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", in.steps, "plan: simulated steps (0: four periods, at least 32)")
      ->check(CLI::NonNegativeNumber);
  bool flat_ring = false;
  app.add_flag("--flat-ring", flat_ring,
               "every group all-reduces on one flat ring (the MPI backend with "
               "DECENT_DP_NODE_AWARE=0) instead of the node-aware all-reduce where it applies");
  CLI11_PARSE(app, argc, argv);
  const bool name_given = app.count("--name") > 0;

  if (list) {
    for (const auto& t : registered_topologies()) {
      std::cout << t << "\n";
    }
    return 0;
  }
  try {
    if (plan) {
      if (intra_mbs <= 0 || inter_mbs <= 0) {
        std::cerr << "error: --plan needs --intra-bw and --inter-bw (MB/s, > 0)\n";
        return 2;
      }
      in.intra_bw = intra_mbs * 1e6;
      in.inter_bw = inter_mbs * 1e6;
      in.flow_bw = flow_mbs * 1e6;
      in.shared_exchanges = !fifo;
      in.node_aware = !flat_ring;
      if (buckets_mb.empty()) {
        in.bucket_bytes = buckets_of(params, dtype_bytes, bucket_mb);
      } else {
        for (double b : buckets_mb) {
          in.bucket_bytes.push_back(b * 1048576.0);
        }
      }
      std::vector<Prediction> rows{predict_allreduce(n, lws, in)};
      const std::vector<std::string> names =
          name_given ? std::vector<std::string>{name}
                     : std::vector<std::string>{"complete", "ring", "one-peer-exp",
                                                "alternating-exp-ring"};
      nlohmann::json skipped = nlohmann::json::object();
      for (const std::string& t : names) {
        try {
          rows.push_back(predict_gossip(*make_topology(t, n, lws), in));
        } catch (const decent_dp::TopologyError& e) {
          if (name_given) {
            throw;
          }
          skipped[t] = e.what();
        }
      }
      std::stable_sort(rows.begin(), rows.end(), [](const Prediction& a, const Prediction& b) {
        return a.step_ms < b.step_ms;
      });
      const double allreduce_ms = std::find_if(rows.begin(), rows.end(), [](const Prediction& p) {
                                    return p.name == "all-reduce";
                                  })->step_ms;
      nlohmann::json out;
      out["world_size"] = n;
      out["local_world_size"] = lws;
      out["bucket_bytes"] = in.bucket_bytes;
      out["compute_ms"] = in.compute_ms;
      out["intra_bw_bytes_per_s"] = in.intra_bw;
      out["inter_bw_bytes_per_s"] = in.inter_bw;
      out["flow_bw_bytes_per_s"] = in.flow_bw;
      out["shared_efficiency"] = in.shared_efficiency;
      out["ring_efficiency"] = in.ring_efficiency > 0 ? in.ring_efficiency : in.shared_efficiency;
      out["latency_us"] = in.latency_us;
      out["allreduce"] = flat_ring ? "ring" : "node-aware";
      out["skipped"] = skipped;
      for (const Prediction& p : rows) {
        out["predictions"].push_back({{"name", p.name},
                                      {"step_ms", p.step_ms},
                                      {"comm_ms", p.comm_ms},
                                      {"wait_ms", p.wait_ms},
                                      {"speedup_over_allreduce", allreduce_ms / p.step_ms}});
      }
      if (json) {
        std::cout << out.dump(2) << "\n";
        return 0;
      }
      fmt::print(
          "plan: {} ranks, {} per node, {} bucket(s) of {} in all, compute {} ms per step; "
          "links {} MB/s inside a node, {} MB/s per NIC{}; {} all-reduce\n",
          n, lws, in.bucket_bytes.size(),
          human_bytes(std::accumulate(in.bucket_bytes.begin(), in.bucket_bytes.end(), 0.0)),
          in.compute_ms, intra_mbs, inter_mbs,
          flow_mbs > 0 ? fmt::format(", {} MB/s per flow", flow_mbs) : std::string(),
          flat_ring ? "flat ring" : "node-aware");
      fmt::print("{:<22} {:>10} {:>10} {:>10} {:>14}\n", "", "ms/step", "comm ms", "wait ms",
                 "vs all-reduce");
      for (const Prediction& p : rows) {
        fmt::print("{:<22} {:>10.1f} {:>10.1f} {:>10.1f} {:>13.2f}x\n", p.name, p.step_ms,
                   p.comm_ms, p.wait_ms, allreduce_ms / p.step_ms);
      }
      for (const auto& [t, why] : skipped.items()) {
        fmt::print("skipped {}: {}\n", t, why.get<std::string>());
      }
      return 0;
    }
    auto topo = make_topology(name, n, lws);
    const double model_bytes = params * dtype_bytes;
    nlohmann::json out;
    out["name"] = topo->name();
    out["world_size"] = n;
    out["local_world_size"] = lws;
    out["period"] = topo->period();
    const bool gap = n <= gap_max_n;
    if (gap) {
      out["spectral_gap"] = topo->spectral_gap();
    } else {
      out["spectral_gap"] = nullptr;
    }
    out["model_bytes"] = model_bytes;
    out["nodes"] = (n + lws - 1) / lws;
    const AllreduceAlgorithm algorithm =
        flat_ring ? AllreduceAlgorithm::kRing : AllreduceAlgorithm::kNodeAware;
    out["allreduce"] = flat_ring ? "ring" : "node-aware";
    double total_max_bytes = 0.0;
    double total_inter_rank = 0.0;
    double total_inter_nic = 0.0;
    std::vector<double> nic_total(static_cast<size_t>((n + lws - 1) / lws), 0.0);
    for (int s = 0; s < topo->period(); ++s) {
      nlohmann::json slot;
      slot["slot"] = s;
      double max_bytes = 0.0;
      for (const auto& g : topo->slot(s)) {
        slot["groups"].push_back({{"ranks", g.ranks}, {"self_weight", g.self_weight}});
        max_bytes = std::max(max_bytes, allreduce_bytes(g.size(), model_bytes));
      }
      slot["max_bytes_sent_per_rank"] = max_bytes;
      total_max_bytes += max_bytes;
      const SlotTraffic traffic = slot_traffic(*topo, s, model_bytes, algorithm);
      slot["inter_node"] = {{"bytes_sent_per_rank", traffic.sent_inter},
                            {"bytes_out_per_nic", traffic.nic_out},
                            {"bytes_in_per_nic", traffic.nic_in},
                            {"flows_out_per_nic", traffic.nic_flows_out},
                            {"max_bytes_sent_per_rank", traffic.max_sent_inter()},
                            {"max_bytes_out_per_nic", traffic.max_nic_out()},
                            {"max_flows_out_per_nic", traffic.max_nic_flows_out()}};
      total_inter_rank += traffic.max_sent_inter();
      total_inter_nic += traffic.max_nic_out();
      for (size_t node = 0; node < nic_total.size(); ++node) {
        nic_total[node] += traffic.nic_out[node];
      }
      out["slots"].push_back(slot);
    }
    out["mean_bytes_sent_per_rank_per_step"] = total_max_bytes / topo->period();
    out["mean_max_inter_node_bytes_per_rank_per_step"] = total_inter_rank / topo->period();
    out["mean_max_inter_node_bytes_per_nic_per_step"] = total_inter_nic / topo->period();
    out["max_mean_inter_node_bytes_per_nic_per_step"] =
        *std::max_element(nic_total.begin(), nic_total.end()) / topo->period();
    if (json) {
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    fmt::print("topology {} (n = {}, lws = {}): period {}, spectral gap {}\n", topo->name(), n, lws,
               topo->period(),
               gap ? fmt::format("{:.6f}", out["spectral_gap"].get<double>())
                   : fmt::format("not computed (n > --spectral-gap-max-n = {})", gap_max_n));
    for (int s = 0; s < topo->period(); ++s) {
      const Slot& sl = topo->slot(s);
      std::vector<std::string> weights;
      for (const auto& g : sl) {
        weights.push_back(fmt::format("{:.4g}", g.self_weight));
      }
      fmt::print("slot {}: {}   self weights {}   max sent per rank {}\n", s, to_string(sl),
                 fmt::join(weights, " "),
                 human_bytes(out["slots"][s]["max_bytes_sent_per_rank"].get<double>()));
      if (n > lws) {
        const auto& inter = out["slots"][s]["inter_node"];
        fmt::print("        across nodes: max {} per rank, max {} out of one NIC, flows {}\n",
                   human_bytes(inter["max_bytes_sent_per_rank"].get<double>()),
                   human_bytes(inter["max_bytes_out_per_nic"].get<double>()),
                   inter["max_flows_out_per_nic"].get<int>());
      }
    }
    fmt::print("model {} ({} parameters x {} B): {} sent per rank per step on average\n",
               human_bytes(model_bytes), params, dtype_bytes,
               human_bytes(out["mean_bytes_sent_per_rank_per_step"].get<double>()));
    if (n > lws) {
      fmt::print(
          "{} nodes of {} ranks, per step on average: {} out of the busiest NIC of each slot, "
          "{} out of the busiest NIC over a period\n",
          out["nodes"].get<int>(), lws,
          human_bytes(out["mean_max_inter_node_bytes_per_nic_per_step"].get<double>()),
          human_bytes(out["max_mean_inter_node_bytes_per_nic_per_step"].get<double>()));
    }
  } catch (const decent_dp::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
