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
//   - Communication: an exchange of a group starts when every member has launched it. A
//     group of k runs a ring all-reduce (topology/traffic.h): every ring edge moves 2 (k - 1)
//     / k of the block, plus latency_us for each of the 2 (k - 1) steps. With node_aware (the
//     MPI backend's default), a group of g >= 2 nodes of l >= 2 members each runs the
//     node-aware all-reduce instead, as three stages one after another: a reduce-scatter on
//     the ring inside each node ((l - 1) / l of the block per edge), a ring all-reduce of
//     each member's chunk across the nodes (2 (g - 1) / g of 1/l of the block per edge), and
//     an all-gather inside each node; latency_us for each of their steps. The network is
//     simulated as a fluid: every exchange in flight moves at the rate of its slowest edge,
//     and rates change only when an exchange starts or ends. An edge inside a node runs at
//     intra_bw. An edge across nodes is a flow out of one node's NIC and into another's: a
//     NIC with one flow in flight gives it inter_bw, one with f > 1 flows in flight gives each
//     e * inter_bw / f (the slower of the two ends, capped at flow_bw), where e is the mean
//     over those flows of shared_efficiency for a flow of a pairwise exchange (its ring has
//     two members, so data goes both ways between the same two ranks) and ring_efficiency for
//     an edge of a longer ring: the two patterns share a NIC differently over TCP, and the
//     calibration measures both on a stream of exchanges (Note [pairs and rings share a NIC
//     differently], Note [shares from a stream]). Flows are counted from what is in flight
//     at that instant, not per slot: exchanges of two steps overlap when one outlasts a step,
//     and ranks that start late share less. Several exchanges on one edge (a step's
//     buckets, all in flight together: the MPI backend progresses every operation at once)
//     share it equally (shared_exchanges; false: the first one started gets the whole edge,
//     one after another).
//   - Gossip (DecentralizedDataParallel): when bucket b is ready at step t, the rank waits for
//     bucket b's exchange of step t - 1, spends optimizer_ms * share_b on the update and
//     launches the exchange of step t on slot t mod P (one step of look-ahead).
//   - All-reduce (DistributedDataParallel): bucket b's gradient all-reduce over all ranks is
//     launched when b is ready; the step ends when the backward and every all-reduce are
//     done, then the optimizer runs (optimizer_ms) and the next forward starts.
// The step time is the mean over the simulated steps after one warm-up period (at least 8).
//
// Note [pairs and rings share a NIC differently]
// Two flows out of one NIC do not get the same share of it in every pattern. Measured on the
// emulated cluster (4 nodes of 2 ranks, 400 Mbit/s links, 16 MiB per rank as 4 all-reduces
// in flight, each alone): pairwise exchanges across nodes (ring's and one-peer-exp's slots
// across, 2 flows per NIC, data both ways between the same two ranks) moved 35-38 MB/s out
// of each NIC, the node-aware all-reduce of all 8 ranks (two rings of 4 across the nodes, 2
// flows per NIC, each flow one way) 44.7 MB/s, and the flat ring of 8 (1 flow per NIC)
// 46.6 MB/s. So the planner takes two efficiencies: shared_efficiency for flows of pairwise
// exchanges, ring_efficiency for the edges of longer rings; `calibrate` measures the first
// with one-peer-exp's last slot and, on 3 nodes or more, the second with the node-aware
// all-reduce of every rank. Those figures are from one ring per operation; since large
// all-reduces run in lanes (Note [ring lanes] in decent_dp/detail/ring_allreduce.h) the
// same calibration gives pairs 0.93 of a slow NIC and rings 0.97: the gap narrowed, and
// the two inputs stay, measured, not assumed.
//
// Note [shares from a stream]
// Isolated blocks overstate what pairwise exchanges get in training. On 4 emulated nodes of
// 2 ranks at 400 Mbit/s, step_bench's sleep model (5.5 M parameters, buckets of 4 MiB) with
// 39 ms of compute per step took 562 ms with ring and 739 ms with one-peer-exp, where the
// shares of isolated 16 MiB blocks (pairs 0.927 of the NIC, rings 0.970) predict 521 and
// 687: a stream of pairwise exchanges, one step's after the last's, moves 0.86 of the NIC,
// not 0.93. Rings lose nothing (complete: 721 ms measured, 730 predicted). So `calibrate`
// measures both shares on such a stream (step_bench without compute, ring for the pairs
// and complete for the rings) and takes the values at which this model gives the measured
// step times; the isolated blocks' shares stay in its JSON for comparison.
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
  double optimizer_ms = 0;  // per step, all buckets
  double intra_bw = 0;      // bytes/s of an edge inside a node
  double inter_bw = 0;      // bytes/s out of one node's NIC
  double flow_bw = 0;       // bytes/s cap of one flow across nodes (0: no cap)
  // (0, 1]: the NIC's share that several flows get together when they are pairwise exchanges
  // (rings of two members), and when they are edges of longer rings (0: shared_efficiency).
  double shared_efficiency = 1;
  double ring_efficiency = 0;
  double latency_us = 0;  // per ring step
  int steps = 0;          // simulated steps after the warm-up (0: 4 periods, >= 32)
  // Exchanges in flight on one edge share it equally (the MPI backend progresses every
  // operation at once); false: the first one started gets the whole edge, one after another.
  bool shared_exchanges = true;
  // Groups spread evenly over several nodes take the node-aware all-reduce (the MPI
  // backend's default, MpiOptions::node_aware); false: every group takes the flat ring.
  bool node_aware = true;

  // Throws InvalidArgument naming the first field out of range.
  void validate() const;
};

struct Prediction {
  std::string name;       // topology name, or "all-reduce"
  double step_ms = 0;     // mean time per step
  double comm_ms = 0;     // mean time per step a rank has an exchange in flight
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
