// What one exchange of a topology slot puts on the network, per rank and per node: the
// input of the planner (decent_dp/topology/planner.h) and of `decent_dp_topology`'s traffic
// report. No dependency on LibTorch or MPI.
//
// Model (Note [ring all-reduce over point-to-point] in the MPI backend): a group of k members
// in ascending rank order runs a ring all-reduce, member i sending 2 (k - 1) / k of the block
// to member i + 1 (mod k); a group of one sends nothing. A group spread over g >= 2 nodes
// with the same number l >= 2 of its members on each takes the node-aware all-reduce instead
// (Note [node-aware all-reduce]; the MPI backend's default from 64 KiB on): a reduce-scatter
// inside each node, a ring all-reduce of each member's chunk (1/l of the block) across the
// nodes, an all-gather inside each node. Ranks are placed on nodes in order,
// local_world_size per node (rank r on node r / lws), as `mpirun --map-by slot` and
// `srun --distribution=block` do; a message between two ranks of one node stays inside it.
#pragma once

#include <utility>
#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {
namespace topology {

// The shape of a group for the node-aware all-reduce, from the node of each member
// (nodes[m]: any id, equal for members of one node): `nodes` >= 2 nodes holding `per_node`
// >= 2 members each; {0, 0} where the group has another shape (the flat ring serves it).
struct NodeShape {
  int nodes = 0;
  int per_node = 0;
};
NodeShape node_aware_shape(const std::vector<int>& nodes);

// Member `index`'s partners in the node-aware all-reduce of a group of that shape, as
// positions in the group: the members of its node in group order (`local`, itself at
// `local_index`), and the member at the same place of every node, nodes in the order of
// their first member (`across`, itself at `across_index`).
struct NodeLayout {
  std::vector<int> local;
  int local_index = 0;
  std::vector<int> across;
  int across_index = 0;
};
NodeLayout node_layout(const std::vector<int>& nodes, int index);

enum class AllreduceAlgorithm {
  kRing,       // always the flat ring
  kNodeAware,  // the node-aware all-reduce where a group's shape allows it, the ring elsewhere
};

// One stage of a group all-reduce: every edge (from, to), ranks in the world, moves
// `bytes_per_edge` in `steps` messages; the stages run one after another.
struct AllreduceStage {
  std::vector<std::pair<int, int>> edges;
  double bytes_per_edge = 0;
  int steps = 0;
};
// The stages of the all-reduce of `block_bytes` per member over `ranks` (in group order),
// local_world_size per node: one stage for the ring (none for a group of one), three for the
// node-aware all-reduce.
std::vector<AllreduceStage> allreduce_stages(const std::vector<int>& ranks, int local_world_size,
                                             double block_bytes, AllreduceAlgorithm algorithm);

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
  // The largest group of the slot.
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
SlotTraffic slot_traffic(const Topology& topology, int s, double block_bytes,
                         AllreduceAlgorithm algorithm = AllreduceAlgorithm::kNodeAware);

// Every slot of one period, in order.
std::vector<SlotTraffic> period_traffic(
    const Topology& topology, double block_bytes,
    AllreduceAlgorithm algorithm = AllreduceAlgorithm::kNodeAware);

}  // namespace topology
}  // namespace decent_dp
