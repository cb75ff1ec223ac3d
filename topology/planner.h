// The topology planner: predicts the time per training step of gossip with a topology, and of
// the all-reduce baseline, on a cluster described by a few measured numbers, before any run
// (`decent_dp_topology --plan`). No dependency on LibTorch or MPI.
//
// Note [planner model]
// A max-plus model of the wrappers' real timeline, simulated rank by rank over whole periods
// of the topology (both the same model of the machine):
//   - Compute: a forward of (1 - backward_fraction) * compute_ms, then the backward, in which
//     the buckets' gradients become ready in turn (bucket b after its share of the backward,
//     proportional to its bytes), plus a uniform extra of up to jitter_ms per rank and step
//     at the start of the forward (from a (rank, step) seed).
//   - Communication: an exchange of a group starts when every member has launched it and
//     has finished its previous one's share of the link; the exchanges one rank launches in
//     a step are all in flight together (the MPI backend progresses every operation at
//     once), so they share the links and each finishes about when the last one does
//     (shared_exchanges; false: one after another). A group of k runs a ring all-reduce
//     (topology/traffic.h): 2 (k - 1) steps, each moving block / k over every ring edge at the
//     edge's rate plus latency_us; an edge inside a node runs at intra_bw, an edge across
//     nodes at min(flow_bw, inter_bw) when it is its node's only flow across in that slot, and
//     at min(flow_bw, shared_efficiency * inter_bw / flows) when `flows` ranks of the node
//     send across at once (they share the NIC; two TCP flows sharing a shaped link got 61-100%
//     of one flow's rate together, varying from run to run: benchmarks/emulate/calibrate).
//   - Gossip (DecentralizedDataParallel): when bucket b is ready at step t, the rank waits for
//     bucket b's exchange of step t - 1, spends optimizer_ms * share_b on the update and
//     launches the exchange of step t on slot t mod P (one step of look-ahead).
//   - All-reduce (DistributedDataParallel): bucket b's gradient all-reduce over all ranks is
//     launched when b is ready; the step ends when the backward and every all-reduce are
//     done, then the optimizer runs (optimizer_ms) and the next forward starts.
// The step time is the mean over the simulated steps after one warm-up period (at least 8).
#pragma once

#include <string>
#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {
namespace topology {

struct PlanInputs {
  std::vector<double> bucket_bytes;  // in the order their gradients become ready
  double compute_ms = 0;             // forward + backward per step and rank
  double backward_fraction = 2.0 / 3.0;
  double jitter_ms = 0;
  double optimizer_ms = 0;       // per step, all buckets
  double intra_bw = 0;           // bytes/s of an edge inside a node
  double inter_bw = 0;           // bytes/s out of one node's NIC
  double flow_bw = 0;            // bytes/s cap of one flow across nodes (0: no cap)
  double shared_efficiency = 1;  // (0, 1]: the NIC's share that several flows get together
  double latency_us = 0;         // per ring step
  int steps = 0;                 // simulated steps after the warm-up (0: 4 periods, >= 32)
  // Gossip: the exchanges of one step are in flight together and share the links, so each
  // finishes when the last one does (the MPI backend progresses every operation at once);
  // false: one after another, each done as soon as its own work is.
  bool shared_exchanges = true;

  // Throws InvalidArgument naming the first field out of range.
  void validate() const;
};

struct Prediction {
  std::string name;       // topology name, or "all-reduce"
  double step_ms = 0;     // mean time per step
  double comm_ms = 0;     // mean time per step a rank's exchanges occupy the network
  double wait_ms = 0;     // mean time per step a rank waits for an exchange
  double compute_ms = 0;  // the same step without communication
};

// Gossip with `topology` (its world size and ranks per node are the cluster's).
Prediction predict_gossip(const Topology& topology, const PlanInputs& in);
// The all-reduce baseline on world_size ranks, local_world_size per node.
Prediction predict_allreduce(int world_size, int local_world_size, const PlanInputs& in);

// Buckets of a model of `params` parameters of `dtype_bytes` each under a bucket cap of
// `cap_mb` MiB (the wrappers' bucket_cap_mb): full buckets, the last one the rest. More than
// kMaxPlanBuckets is an InvalidArgument naming the three inputs.
constexpr double kMaxPlanBuckets = 100000;
std::vector<double> buckets_of(double params, int dtype_bytes, double cap_mb);

}  // namespace topology
}  // namespace decent_dp
