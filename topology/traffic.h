// What one exchange of a topology slot puts on the network, per rank and per node: the
// input of the planner (decent_dp/topology/planner.h) and of `decent_dp_topology`'s traffic
// report. No dependency on LibTorch or MPI.
//
// Model (Note [ring all-reduce over point-to-point] in the MPI backend): a group of k members
// in ascending rank order runs a ring all-reduce, member i sending 2 (k - 1) / k of the block
// to member i + 1 (mod k); a group of one sends nothing. Ranks are placed on nodes in order,
// local_world_size per node (rank r on node r / lws), as `mpirun --map-by slot` and
// `srun --distribution=block` do; a message between two ranks of one node stays inside it.
#pragma once

#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {
namespace topology {

struct SlotTraffic {
  int slot = 0;
  int nodes = 0;
  // Per rank: bytes sent in this slot's exchange, and the part of it sent to another node.
  std::vector<double> sent;
  std::vector<double> sent_inter;
  // Per node: bytes leaving and entering it (through its NIC), and how many of its ranks
  // send to another node (flows sharing the NIC's outgoing bandwidth).
  std::vector<double> nic_out;
  std::vector<double> nic_in;
  std::vector<int> nic_flows_out;
  // The largest group of the slot and the largest number of ring steps of any group
  // (2 (k - 1) for a group of k).
  int max_group = 1;

  double max_sent() const;
  double max_sent_inter() const;
  double max_nic_out() const;
  double max_nic_in() const;
  int max_nic_flows_out() const;
};

// The node of `rank` under the placement above.
inline int node_of(int rank, int local_world_size) {
  return rank / local_world_size;
}

// The traffic of slot `s` for a block of `block_bytes` per rank (each bucket's exchange
// moves its own block; the sum over buckets is the model's).
SlotTraffic slot_traffic(const Topology& topology, int s, double block_bytes);

// Every slot of one period, in order.
std::vector<SlotTraffic> period_traffic(const Topology& topology, double block_bytes);

}  // namespace topology
}  // namespace decent_dp
