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
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>

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
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const auto& t : registered_topologies()) {
      std::cout << t << "\n";
    }
    return 0;
  }
  try {
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
      const SlotTraffic traffic = slot_traffic(*topo, s, model_bytes);
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
