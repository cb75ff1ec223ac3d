#include "decent_dp/topology/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "decent_dp/topology/traffic.h"

namespace decent_dp {
namespace topology {

namespace {

// Uniform in [0, 1) from (rank, step): the same jitter for every topology of one plan.
double unit_hash(int rank, int64_t step) {
  uint64_t h = (static_cast<uint64_t>(rank) << 32) ^ static_cast<uint64_t>(step);
  h += 0x9e3779b97f4a7c15ULL;
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return static_cast<double>(h >> 11) / 9007199254740992.0;
}

// Seconds of one ring all-reduce of `bytes` per member over `g`, in a slot whose nodes have
// `flows` ranks sending across.
double ring_seconds(const Group& g, double bytes, int lws, const std::vector<int>& flows,
                    const PlanInputs& in) {
  const int k = g.size();
  if (k <= 1) {
    return 0.0;
  }
  double slowest = std::numeric_limits<double>::infinity();
  for (int i = 0; i < k; ++i) {
    const int from = g.ranks[static_cast<size_t>(i)];
    const int to = g.ranks[static_cast<size_t>((i + 1) % k)];
    double bw = in.intra_bw;
    if (node_of(from, lws) != node_of(to, lws)) {
      const int f = std::max(1, flows[static_cast<size_t>(node_of(from, lws))]);
      bw = f == 1 ? in.inter_bw : in.shared_efficiency * in.inter_bw / f;
      if (in.flow_bw > 0) {
        bw = std::min(bw, in.flow_bw);
      }
    }
    slowest = std::min(slowest, bw);
  }
  return 2.0 * (k - 1) * (bytes / k / slowest + in.latency_us * 1e-6);
}

struct Compute {
  double forward_ms;
  std::vector<double> backward_ms;   // per bucket
  std::vector<double> optimizer_ms;  // per bucket
};

Compute split(const PlanInputs& in) {
  Compute c;
  c.forward_ms = in.compute_ms * (1.0 - in.backward_fraction);
  const double total = std::accumulate(in.bucket_bytes.begin(), in.bucket_bytes.end(), 0.0);
  for (double b : in.bucket_bytes) {
    const double share = total > 0 ? b / total : 1.0 / static_cast<double>(in.bucket_bytes.size());
    c.backward_ms.push_back(in.compute_ms * in.backward_fraction * share);
    c.optimizer_ms.push_back(in.optimizer_ms * share);
  }
  return c;
}

int simulated_steps(const PlanInputs& in, int period) {
  if (in.steps > 0) {
    return in.steps;
  }
  int steps = 4 * period;
  while (steps < 32) {
    steps += period;
  }
  return steps;
}

}  // namespace

void PlanInputs::validate() const {
  auto bad = [](const char* what, double v, const char* expected) {
    throw InvalidArgument(fmt::format("plan: {} must be {}, got {}", what, expected, v));
  };
  if (bucket_bytes.empty()) {
    throw InvalidArgument("plan: bucket_bytes must list at least one bucket, got none");
  }
  for (double b : bucket_bytes) {
    if (!(b >= 0) || !std::isfinite(b)) {
      bad("every bucket's bytes", b, "finite and >= 0");
    }
  }
  if (!(compute_ms >= 0) || !std::isfinite(compute_ms))
    bad("compute_ms", compute_ms, ">= 0");
  if (!(backward_fraction >= 0 && backward_fraction <= 1)) {
    bad("backward_fraction", backward_fraction, "in [0, 1]");
  }
  if (!(jitter_ms >= 0) || !std::isfinite(jitter_ms))
    bad("jitter_ms", jitter_ms, ">= 0");
  if (!(optimizer_ms >= 0) || !std::isfinite(optimizer_ms))
    bad("optimizer_ms", optimizer_ms, ">= 0");
  if (!(intra_bw > 0) || !std::isfinite(intra_bw))
    bad("intra_bw (bytes/s)", intra_bw, "> 0");
  if (!(inter_bw > 0) || !std::isfinite(inter_bw))
    bad("inter_bw (bytes/s)", inter_bw, "> 0");
  if (!(flow_bw >= 0) || !std::isfinite(flow_bw))
    bad("flow_bw (bytes/s)", flow_bw, ">= 0 (0: no cap)");
  if (!(latency_us >= 0) || !std::isfinite(latency_us))
    bad("latency_us", latency_us, ">= 0");
  if (!(shared_efficiency > 0 && shared_efficiency <= 1))
    bad("shared_efficiency", shared_efficiency, "in (0, 1]");
  if (steps < 0)
    bad("steps", steps, ">= 0 (0: four periods)");
}

std::vector<double> buckets_of(double params, int dtype_bytes, double cap_mb) {
  if (!(params >= 1) || !std::isfinite(params)) {
    throw InvalidArgument(fmt::format("plan: params must be >= 1, got {}", params));
  }
  if (dtype_bytes <= 0) {
    throw InvalidArgument(fmt::format("plan: dtype_bytes must be > 0, got {}", dtype_bytes));
  }
  if (!(cap_mb > 0)) {
    throw InvalidArgument(fmt::format("plan: bucket cap (MiB) must be > 0, got {}", cap_mb));
  }
  const double total = params * dtype_bytes;
  const double cap = cap_mb * 1048576.0;
  const double full = std::ceil(total / cap) - 1;  // buckets before the last
  if (full >= kMaxPlanBuckets) {
    throw InvalidArgument(fmt::format(
        "plan: {} parameters of {} bytes in buckets of {} MiB make more than {} buckets; "
        "use a larger bucket cap",
        params, dtype_bytes, cap_mb, kMaxPlanBuckets));
  }
  std::vector<double> out(static_cast<size_t>(full), cap);
  out.push_back(total - full * cap);
  return out;
}

Prediction predict_gossip(const Topology& topology, const PlanInputs& in) {
  in.validate();
  const int n = topology.world_size();
  const int lws = topology.local_world_size();
  const int period = topology.period();
  const Compute c = split(in);
  const size_t nb = in.bucket_bytes.size();
  // Per slot and bucket: each group's exchange, in ms.
  std::vector<std::vector<double>> group_ms(static_cast<size_t>(period) * nb);
  for (int s = 0; s < period; ++s) {
    const SlotTraffic traffic = slot_traffic(topology, s, 1.0);
    for (size_t b = 0; b < nb; ++b) {
      auto& v = group_ms[static_cast<size_t>(s) * nb + b];
      for (const Group& g : topology.slot(s)) {
        v.push_back(1e3 * ring_seconds(g, in.bucket_bytes[b], lws, traffic.nic_flows_out, in));
      }
    }
  }
  const int warm = std::max(period, 8);
  const int steps = simulated_steps(in, period);
  std::vector<double> cursor(static_cast<size_t>(n), 0.0);     // each rank's compute clock
  std::vector<double> net_free(static_cast<size_t>(n), 0.0);   // each rank's exchanges
  std::vector<double> done(static_cast<size_t>(n) * nb, 0.0);  // last exchange of (rank, b)
  std::vector<double> launch(static_cast<size_t>(n) * nb, 0.0);
  double t_start = 0, wait = 0, comm = 0;
  for (int t = 0; t < warm + steps; ++t) {
    if (t == warm) {
      t_start = *std::max_element(cursor.begin(), cursor.end());
      wait = comm = 0;
    }
    const int s = topology.slot_index(t);
    for (int r = 0; r < n; ++r) {
      double& cur = cursor[static_cast<size_t>(r)];
      cur += c.forward_ms + in.jitter_ms * unit_hash(r, t);
      for (size_t b = 0; b < nb; ++b) {
        cur += c.backward_ms[b];
        const double d = t > 0 ? done[static_cast<size_t>(r) * nb + b] : 0.0;
        if (d > cur) {
          wait += d - cur;
          cur = d;
        }
        cur += c.optimizer_ms[b];
        launch[static_cast<size_t>(r) * nb + b] = cur;
      }
    }
    // The exchanges of step t, bucket by bucket (launch order), group by group.
    const Slot& slot = topology.slot(s);
    for (size_t b = 0; b < nb; ++b) {
      for (size_t gi = 0; gi < slot.size(); ++gi) {
        const Group& g = slot[gi];
        double start = 0;
        for (int r : g.ranks) {
          start = std::max(
              {start, launch[static_cast<size_t>(r) * nb + b], net_free[static_cast<size_t>(r)]});
        }
        const double ms = group_ms[static_cast<size_t>(s) * nb + b][gi];
        for (int r : g.ranks) {
          done[static_cast<size_t>(r) * nb + b] = start + ms;
          net_free[static_cast<size_t>(r)] = start + ms;
        }
        comm += ms * g.size();
      }
    }
    if (in.shared_exchanges) {
      // The step's exchanges are in flight together and share the links: each finishes
      // about when the last one does (the same total work as one after another).
      for (int r = 0; r < n; ++r) {
        const double last = done[static_cast<size_t>(r) * nb + nb - 1];
        for (size_t b = 0; b < nb; ++b) {
          done[static_cast<size_t>(r) * nb + b] = last;
        }
      }
    }
  }
  Prediction p;
  p.name = topology.name();
  p.step_ms = (*std::max_element(cursor.begin(), cursor.end()) - t_start) / steps;
  p.wait_ms = wait / n / steps;
  p.comm_ms = comm / n / steps;
  p.compute_ms = in.compute_ms + in.optimizer_ms + in.jitter_ms / 2;
  return p;
}

Prediction predict_allreduce(int world_size, int local_world_size, const PlanInputs& in) {
  in.validate();
  CompleteTopology complete(world_size, local_world_size);
  const int n = world_size;
  const Compute c = split(in);
  const size_t nb = in.bucket_bytes.size();
  const SlotTraffic traffic = slot_traffic(complete, 0, 1.0);
  const Group& all = complete.slot(0).front();
  const int warm = 8;
  const int steps = simulated_steps(in, 1);
  std::vector<double> cursor(static_cast<size_t>(n), 0.0);
  double net_free = 0, t_start = 0, wait = 0, comm = 0;
  for (int t = 0; t < warm + steps; ++t) {
    if (t == warm) {
      t_start = *std::max_element(cursor.begin(), cursor.end());
      wait = comm = 0;
    }
    std::vector<double> ready(nb, 0.0);  // the last rank's readiness of each bucket
    for (int r = 0; r < n; ++r) {
      double cur = cursor[static_cast<size_t>(r)] + c.forward_ms + in.jitter_ms * unit_hash(r, t);
      for (size_t b = 0; b < nb; ++b) {
        cur += c.backward_ms[b];
        ready[b] = std::max(ready[b], cur);
      }
      cursor[static_cast<size_t>(r)] = cur;
    }
    for (size_t b = 0; b < nb; ++b) {
      const double ms =
          1e3 * ring_seconds(all, in.bucket_bytes[b], local_world_size, traffic.nic_flows_out, in);
      net_free = std::max(net_free, ready[b]) + ms;
      comm += ms;
    }
    for (int r = 0; r < n; ++r) {
      double& cur = cursor[static_cast<size_t>(r)];
      if (net_free > cur) {
        wait += net_free - cur;
        cur = net_free;
      }
      cur += in.optimizer_ms;
    }
  }
  Prediction p;
  p.name = "all-reduce";
  p.step_ms = (*std::max_element(cursor.begin(), cursor.end()) - t_start) / steps;
  p.wait_ms = wait / n / steps;
  p.comm_ms = comm / steps;
  p.compute_ms = in.compute_ms + in.optimizer_ms + in.jitter_ms / 2;
  return p;
}

}  // namespace topology
}  // namespace decent_dp
