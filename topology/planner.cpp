#include "decent_dp/topology/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

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
  if (!(ring_efficiency >= 0 && ring_efficiency <= 1))
    bad("ring_efficiency", ring_efficiency, "in (0, 1] (0: shared_efficiency)");
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

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// The network of Note [planner model]: exchanges in flight share their ring edges, and the
// edges across nodes share the NICs they leave and enter, counted from what is in flight
// at each instant. A fluid simulation: rates change only when an exchange starts or ends,
// so between those events every exchange moves at a constant rate. Ranks are driven by a
// program (the wrapper's timeline) through schedule() and wait_for().
class Simulation {
 public:
  Simulation(int world_size, int local_world_size, const PlanInputs& in)
      : in_(in),
        n_(world_size),
        lws_(local_world_size),
        out_flows_(static_cast<size_t>(nodes()), 0),
        in_flows_(static_cast<size_t>(nodes()), 0),
        out_paired_(static_cast<size_t>(nodes()), 0),
        in_paired_(static_cast<size_t>(nodes()), 0),
        pairs_out_(static_cast<size_t>(nodes())),
        pairs_in_(static_cast<size_t>(nodes())) {}

  double now() const { return now_; }

  // An all-reduce of `bytes` per member over `ranks` (in group order): the ring, or the
  // node-aware all-reduce where PlanInputs::node_aware and the group's shape allow it
  // (allreduce_stages), its stages one after another. It starts when every member has
  // called launch().
  int add_exchange(const std::vector<int>& ranks, double bytes) {
    Exchange e;
    e.missing = static_cast<int>(ranks.size());
    for (const AllreduceStage& stage : allreduce_stages(
             ranks, lws_, bytes,
             in_.node_aware ? AllreduceAlgorithm::kNodeAware : AllreduceAlgorithm::kRing)) {
      Stage st;
      st.work = stage.bytes_per_edge;
      for (const auto& [from, to] : stage.edges) {
        st.pairs.push_back(pair_id(from, to));
      }
      // An edge of a ring of two members: the stage also sends the other way between the two
      // ranks (pair_id of the reverse edge is among the stage's).
      const std::unordered_set<int> ids(st.pairs.begin(), st.pairs.end());
      for (const auto& [from, to] : stage.edges) {
        const auto back = pair_index_.find(static_cast<int64_t>(to) * n_ + from);
        st.paired.push_back(back != pair_index_.end() && ids.count(back->second) != 0 ? 1 : 0);
      }
      e.latency_ms += stage.steps * in_.latency_us * 1e-3;
      e.stages.push_back(std::move(st));
    }
    exchanges_.push_back(std::move(e));
    seen_.push_back(0);
    return static_cast<int>(exchanges_.size()) - 1;
  }

  // One member launches exchange `id` now; the last one starts it.
  void launch(int id) {
    Exchange& e = exchanges_[static_cast<size_t>(id)];
    if (--e.missing > 0) {
      return;
    }
    e.start = now_;
    next_stage(id);
  }

  bool done(int id) const { return exchanges_[static_cast<size_t>(id)].done >= 0; }
  double done_at(int id) const { return exchanges_[static_cast<size_t>(id)].done; }
  double start_at(int id) const { return exchanges_[static_cast<size_t>(id)].start; }

  // The program is called for `rank` again when exchange `id` is done.
  void wait_for(int id, int rank) { exchanges_[static_cast<size_t>(id)].waiters.push_back(rank); }
  // The program is called for `rank` at `time` (>= now).
  void schedule(int rank, double time) { ranks_.push({time, sequence_++, rank}); }

  // Runs until no rank is scheduled and no exchange is in flight.
  template <class Program>
  void run(Program&& program) {
    for (;;) {
      const double t_net = next_completion();
      const double t_rank = ranks_.empty() ? kNever : ranks_.top().time;
      if (t_net == kNever && t_rank == kNever) {
        return;
      }
      if (t_net <= t_rank) {
        const int id = completions_.top().id;
        completions_.pop();
        now_ = t_net;
        finish(id);
      } else {
        const int r = ranks_.top().rank;
        ranks_.pop();
        now_ = t_rank;
        program(r);
      }
    }
  }

 private:
  struct Pair {
    bool cross = false;
    int src_node = 0, dst_node = 0;
    std::vector<int> active;  // exchanges on this edge, in the order they started
    int paired_active = 0;    // those of them that use it in a ring of two members
  };
  struct Stage {
    std::vector<int> pairs;    // its edges
    std::vector<char> paired;  // per edge: in a ring of two members
    double work = 0;           // bytes each edge moves
  };
  struct Exchange {
    std::vector<Stage> stages;
    size_t stage = 0;          // the next stage to start
    std::vector<int> pairs;    // the edges of the stage in flight
    std::vector<char> paired;  // and whether each is in a ring of two members
    int missing = 0;           // members yet to launch it
    double work = 0;           // bytes each edge of the stage in flight still has to move
    double latency_ms = 0;     // of all its steps, added at the end
    double start = -1, done = -1;
    double rate = 0;  // bytes per ms on every edge
    double updated = 0;
    uint64_t version = 0;
    bool active = false;
    std::vector<int> waiters;
  };
  struct RankEvent {
    double time;
    uint64_t sequence;
    int rank;
    bool operator>(const RankEvent& o) const {
      return time != o.time ? time > o.time : sequence > o.sequence;
    }
  };
  struct Completion {
    double time;
    int id;
    uint64_t version;
    bool operator>(const Completion& o) const { return time > o.time; }
  };

  int nodes() const { return (n_ + lws_ - 1) / lws_; }

  int pair_id(int from, int to) {
    const int64_t key = static_cast<int64_t>(from) * n_ + to;
    auto it = pair_index_.find(key);
    if (it != pair_index_.end()) {
      return it->second;
    }
    Pair p;
    p.src_node = node_of(from, lws_);
    p.dst_node = node_of(to, lws_);
    p.cross = p.src_node != p.dst_node;
    pairs_.push_back(p);
    const int id = static_cast<int>(pairs_.size()) - 1;
    if (p.cross) {
      pairs_out_[static_cast<size_t>(p.src_node)].push_back(id);
      pairs_in_[static_cast<size_t>(p.dst_node)].push_back(id);
    }
    pair_index_.emplace(key, id);
    return id;
  }

  // The edges whose rate changes when `e` starts or ends: its own, and every edge through a
  // NIC whose count of flows in flight (or of paired ones) changes with it.
  std::vector<int> touched_pairs(const Exchange& e, bool starting) const {
    std::vector<int> out = e.pairs;
    for (size_t k = 0; k < e.pairs.size(); ++k) {
      const Pair& pair = pairs_[static_cast<size_t>(e.pairs[k])];
      const size_t in_flight = pair.active.size();
      const bool flow_changes = starting ? in_flight == 0 : in_flight == 1;
      const bool paired_changes =
          e.paired[k] != 0 && (starting ? pair.paired_active == 0 : pair.paired_active == 1);
      if (pair.cross && (flow_changes || paired_changes)) {
        const auto& o = pairs_out_[static_cast<size_t>(pair.src_node)];
        const auto& i = pairs_in_[static_cast<size_t>(pair.dst_node)];
        out.insert(out.end(), o.begin(), o.end());
        out.insert(out.end(), i.begin(), i.end());
      }
    }
    return out;
  }

  // Exchanges in flight on `pairs`, each once.
  std::vector<int> exchanges_on(const std::vector<int>& pairs) {
    ++stamp_;
    std::vector<int> out;
    for (int p : pairs) {
      for (int id : pairs_[static_cast<size_t>(p)].active) {
        if (seen_[static_cast<size_t>(id)] != stamp_) {
          seen_[static_cast<size_t>(id)] = stamp_;
          out.push_back(id);
        }
      }
    }
    return out;
  }

  // Brings the remaining work of the exchanges on `pairs` up to now at their current rates.
  void settle(const std::vector<int>& pairs) {
    for (int id : exchanges_on(pairs)) {
      Exchange& e = exchanges_[static_cast<size_t>(id)];
      e.work = std::max(0.0, e.work - e.rate * (now_ - e.updated));
      e.updated = now_;
    }
  }

  // One flow's share of a NIC with `flows` in flight, `paired` of them pairwise exchanges.
  double nic_share(int flows, int paired) const {
    const double bw = in_.inter_bw * 1e-3;  // bytes per ms
    if (flows <= 1) {
      return bw;
    }
    const double ring = in_.ring_efficiency > 0 ? in_.ring_efficiency : in_.shared_efficiency;
    const double efficiency = (paired * in_.shared_efficiency + (flows - paired) * ring) / flows;
    return efficiency * bw / flows;
  }

  double edge_rate(const Pair& p) const {
    if (!p.cross) {
      return in_.intra_bw * 1e-3;
    }
    const auto src = static_cast<size_t>(p.src_node), dst = static_cast<size_t>(p.dst_node);
    double bw = std::min(nic_share(out_flows_[src], out_paired_[src]),
                         nic_share(in_flows_[dst], in_paired_[dst]));
    if (in_.flow_bw > 0) {
      bw = std::min(bw, in_.flow_bw * 1e-3);
    }
    return bw;
  }

  // New rates for the exchanges on `pairs` (already settled), and their completion times.
  void rerate(const std::vector<int>& pairs) {
    for (int id : exchanges_on(pairs)) {
      Exchange& e = exchanges_[static_cast<size_t>(id)];
      double rate = kNever;
      for (int p : e.pairs) {
        const Pair& pair = pairs_[static_cast<size_t>(p)];
        const double bw = edge_rate(pair);
        // Sharing: every exchange on the edge gets an equal part; one after another: the
        // first one started gets all of it.
        const double share = in_.shared_exchanges ? bw / static_cast<double>(pair.active.size())
                                                  : (pair.active.front() == id ? bw : 0.0);
        rate = std::min(rate, share);
      }
      e.rate = rate;
      ++e.version;
      if (rate > 0) {
        completions_.push({now_ + e.work / rate, id, e.version});
      }
    }
  }

  double next_completion() {
    while (!completions_.empty()) {
      const Completion& c = completions_.top();
      const Exchange& e = exchanges_[static_cast<size_t>(c.id)];
      if (e.active && e.version == c.version) {
        return c.time;
      }
      completions_.pop();
    }
    return kNever;
  }

  // Starts the next stage of exchange `id` with work to do, or ends the exchange when none
  // is left (done after its latency) and wakes its waiters.
  void next_stage(int id) {
    Exchange& e = exchanges_[static_cast<size_t>(id)];
    while (e.stage < e.stages.size()) {
      Stage& stage = e.stages[e.stage++];
      if (stage.pairs.empty() || stage.work <= 0) {
        continue;
      }
      e.pairs = std::move(stage.pairs);
      e.paired = std::move(stage.paired);
      e.work = stage.work;
      const std::vector<int> touched = touched_pairs(e, /*starting=*/true);
      settle(touched);
      for (size_t k = 0; k < e.pairs.size(); ++k) {
        Pair& pair = pairs_[static_cast<size_t>(e.pairs[k])];
        const auto src = static_cast<size_t>(pair.src_node);
        const auto dst = static_cast<size_t>(pair.dst_node);
        if (pair.cross && pair.active.empty()) {
          ++out_flows_[src];
          ++in_flows_[dst];
        }
        if (pair.cross && e.paired[k] != 0 && pair.paired_active == 0) {
          ++out_paired_[src];
          ++in_paired_[dst];
        }
        pair.active.push_back(id);
        pair.paired_active += e.paired[k];
      }
      e.active = true;
      e.updated = now_;
      rerate(touched);
      return;
    }
    e.done = now_ + e.latency_ms;
    for (int r : e.waiters) {
      schedule(r, now_);
    }
    e.waiters.clear();
  }

  // The stage in flight of exchange `id` has moved its data: frees its edges, then the next
  // stage.
  void finish(int id) {
    Exchange& e = exchanges_[static_cast<size_t>(id)];
    const std::vector<int> touched = touched_pairs(e, /*starting=*/false);
    settle(touched);
    for (size_t k = 0; k < e.pairs.size(); ++k) {
      Pair& pair = pairs_[static_cast<size_t>(e.pairs[k])];
      const auto src = static_cast<size_t>(pair.src_node);
      const auto dst = static_cast<size_t>(pair.dst_node);
      pair.active.erase(std::find(pair.active.begin(), pair.active.end(), id));
      pair.paired_active -= e.paired[k];
      if (pair.cross && e.paired[k] != 0 && pair.paired_active == 0) {
        --out_paired_[src];
        --in_paired_[dst];
      }
      if (pair.cross && pair.active.empty()) {
        --out_flows_[src];
        --in_flows_[dst];
      }
    }
    e.active = false;
    e.work = 0;
    e.pairs.clear();
    e.paired.clear();
    rerate(touched);
    next_stage(id);
  }

  const PlanInputs& in_;
  const int n_, lws_;
  double now_ = 0;
  std::vector<Exchange> exchanges_;
  std::vector<Pair> pairs_;
  std::unordered_map<int64_t, int> pair_index_;
  std::vector<int> out_flows_, in_flows_;    // per node: edges across with exchanges in flight
  std::vector<int> out_paired_, in_paired_;  // those of them in a ring of two members
  std::vector<std::vector<int>> pairs_out_, pairs_in_;  // per node: its edges across
  std::vector<uint64_t> seen_;
  uint64_t stamp_ = 0;
  uint64_t sequence_ = 0;
  std::priority_queue<RankEvent, std::vector<RankEvent>, std::greater<RankEvent>> ranks_;
  std::priority_queue<Completion, std::vector<Completion>, std::greater<Completion>> completions_;
};

// Mean over ranks and steps of the time each rank has at least one exchange in flight.
double busy_ms(std::vector<std::vector<std::pair<double, double>>>& spans, int steps) {
  double total = 0;
  for (auto& v : spans) {
    std::sort(v.begin(), v.end());
    double end = -kNever;
    for (const auto& [a, b] : v) {
      if (b > end) {
        total += b - std::max(a, end);
        end = b;
      }
    }
  }
  return total / static_cast<double>(spans.size()) / steps;
}

}  // namespace

Prediction predict_gossip(const Topology& topology, const PlanInputs& in) {
  in.validate();
  const int n = topology.world_size();
  const int period = topology.period();
  const Compute c = split(in);
  const int nb = static_cast<int>(in.bucket_bytes.size());
  const int warm = std::max(period, 8);
  const int steps = simulated_steps(in, period);
  const int total = warm + steps;
  // group_index[s][r]: the group of rank r in slot s.
  std::vector<std::vector<int>> group_index(static_cast<size_t>(period),
                                            std::vector<int>(static_cast<size_t>(n), 0));
  for (int s = 0; s < period; ++s) {
    const Slot& slot = topology.slot(s);
    for (size_t g = 0; g < slot.size(); ++g) {
      for (int r : slot[g].ranks) {
        group_index[static_cast<size_t>(s)][static_cast<size_t>(r)] = static_cast<int>(g);
      }
    }
  }
  Simulation sim(n, topology.local_world_size(), in);
  // The exchanges some members have launched and others not yet, by (step, bucket, group's
  // first rank); the last exchange of each (rank, bucket); each rank's exchanges after the
  // warm-up.
  std::unordered_map<int64_t, int> open;
  std::vector<int> last(static_cast<size_t>(n) * static_cast<size_t>(nb), -1);
  std::vector<std::vector<int>> mine(static_cast<size_t>(n));
  struct State {
    int t = 0, b = 0;
    bool launching = false;
    double ready = 0;  // when bucket b's gradient is ready
  };
  std::vector<State> state(static_cast<size_t>(n));
  std::vector<double> step_end(static_cast<size_t>(total), 0.0);
  double wait = 0;
  auto program = [&](int r) {
    State& st = state[static_cast<size_t>(r)];
    const size_t b = static_cast<size_t>(st.b);
    if (!st.launching) {
      // Bucket b is ready: wait for its exchange of the previous step, then update.
      double resume = st.ready;
      if (st.t > 0) {
        const int prev = last[static_cast<size_t>(r) * static_cast<size_t>(nb) + b];
        if (!sim.done(prev)) {
          sim.wait_for(prev, r);
          return;
        }
        resume = std::max(resume, sim.done_at(prev));
      }
      if (st.t >= warm) {
        wait += resume - st.ready;
      }
      st.launching = true;
      sim.schedule(r, resume + c.optimizer_ms[b]);
      return;
    }
    // The update is done: launch the exchange of this step on slot t mod P.
    const double now = sim.now();
    const int s = topology.slot_index(st.t);
    const Group& g = topology.slot(
        s)[static_cast<size_t>(group_index[static_cast<size_t>(s)][static_cast<size_t>(r)])];
    const int64_t key = (static_cast<int64_t>(st.t) * nb + st.b) * n + g.ranks.front();
    auto it = open.find(key);
    int id;
    if (it == open.end()) {
      id = sim.add_exchange(g.ranks, in.bucket_bytes[b]);
      if (g.size() > 1) {
        open.emplace(key, id);
      }
    } else {
      id = it->second;
    }
    last[static_cast<size_t>(r) * static_cast<size_t>(nb) + b] = id;
    if (st.t >= warm) {
      mine[static_cast<size_t>(r)].push_back(id);
    }
    sim.launch(id);
    if (sim.start_at(id) >= 0 && it != open.end()) {
      open.erase(it);  // every member has launched it
    }
    st.launching = false;
    if (st.b + 1 < nb) {
      ++st.b;
      st.ready = now + c.backward_ms[static_cast<size_t>(st.b)];
    } else {
      step_end[static_cast<size_t>(st.t)] = std::max(step_end[static_cast<size_t>(st.t)], now);
      if (++st.t == total) {
        return;
      }
      st.b = 0;
      st.ready = now + c.forward_ms + in.jitter_ms * unit_hash(r, st.t) + c.backward_ms[0];
    }
    sim.schedule(r, st.ready);
  };
  for (int r = 0; r < n; ++r) {
    state[static_cast<size_t>(r)].ready =
        c.forward_ms + in.jitter_ms * unit_hash(r, 0) + c.backward_ms[0];
    sim.schedule(r, state[static_cast<size_t>(r)].ready);
  }
  sim.run(program);
  std::vector<std::vector<std::pair<double, double>>> spans(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (int id : mine[static_cast<size_t>(r)]) {
      spans[static_cast<size_t>(r)].push_back({sim.start_at(id), sim.done_at(id)});
    }
  }
  Prediction p;
  p.name = topology.name();
  p.step_ms =
      (step_end[static_cast<size_t>(total - 1)] - step_end[static_cast<size_t>(warm - 1)]) / steps;
  p.wait_ms = wait / n / steps;
  p.comm_ms = busy_ms(spans, steps);
  p.compute_ms = in.compute_ms + in.optimizer_ms + in.jitter_ms / 2;
  return p;
}

Prediction predict_allreduce(int world_size, int local_world_size, const PlanInputs& in) {
  in.validate();
  if (world_size < 1 || local_world_size < 1 || local_world_size > world_size) {
    throw InvalidArgument(fmt::format(
        "plan: world_size must be >= 1 and local_world_size in [1, world_size], got {} and {}",
        world_size, local_world_size));
  }
  const int n = world_size;
  const Compute c = split(in);
  const int nb = static_cast<int>(in.bucket_bytes.size());
  const int warm = 8;
  const int steps = simulated_steps(in, 1);
  const int total = warm + steps;
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  Simulation sim(n, local_world_size, in);
  std::vector<int> made(static_cast<size_t>(total) * static_cast<size_t>(nb),
                        -1);  // (step, bucket)
  struct State {
    int t = 0, b = 0;
    bool waiting = false;  // for the step's all-reduces, after the backward
    double ready = 0;
  };
  std::vector<State> state(static_cast<size_t>(n));
  std::vector<double> step_end(static_cast<size_t>(total), 0.0);
  double wait = 0;
  auto program = [&](int r) {
    State& st = state[static_cast<size_t>(r)];
    if (!st.waiting) {
      // Bucket b's gradient is ready: launch its all-reduce.
      int& id =
          made[static_cast<size_t>(st.t) * static_cast<size_t>(nb) + static_cast<size_t>(st.b)];
      if (id < 0) {
        id = sim.add_exchange(all, in.bucket_bytes[static_cast<size_t>(st.b)]);
      }
      sim.launch(id);
      if (st.b + 1 < nb) {
        ++st.b;
        sim.schedule(r, sim.now() + c.backward_ms[static_cast<size_t>(st.b)]);
        return;
      }
      st.waiting = true;
      st.ready = sim.now();
    }
    // The backward is done: wait for every all-reduce of the step, then the optimizer.
    double resume = st.ready;
    for (int b = 0; b < nb; ++b) {
      const int id =
          made[static_cast<size_t>(st.t) * static_cast<size_t>(nb) + static_cast<size_t>(b)];
      if (!sim.done(id)) {
        sim.wait_for(id, r);
        return;
      }
      resume = std::max(resume, sim.done_at(id));
    }
    if (st.t >= warm) {
      wait += resume - st.ready;
    }
    const double end = resume + in.optimizer_ms;
    step_end[static_cast<size_t>(st.t)] = std::max(step_end[static_cast<size_t>(st.t)], end);
    st.waiting = false;
    st.b = 0;
    if (++st.t == total) {
      return;
    }
    sim.schedule(r, end + c.forward_ms + in.jitter_ms * unit_hash(r, st.t) + c.backward_ms[0]);
  };
  for (int r = 0; r < n; ++r) {
    sim.schedule(r, c.forward_ms + in.jitter_ms * unit_hash(r, 0) + c.backward_ms[0]);
  }
  sim.run(program);
  std::vector<std::vector<std::pair<double, double>>> spans(1);
  for (int t = warm; t < total; ++t) {
    for (int b = 0; b < nb; ++b) {
      const int id =
          made[static_cast<size_t>(t) * static_cast<size_t>(nb) + static_cast<size_t>(b)];
      spans[0].push_back({sim.start_at(id), sim.done_at(id)});
    }
  }
  Prediction p;
  p.name = "all-reduce";
  p.step_ms =
      (step_end[static_cast<size_t>(total - 1)] - step_end[static_cast<size_t>(warm - 1)]) / steps;
  p.wait_ms = wait / n / steps;
  p.comm_ms = busy_ms(spans, steps);
  p.compute_ms = in.compute_ms + in.optimizer_ms + in.jitter_ms / 2;
  return p;
}

}  // namespace topology
}  // namespace decent_dp
