// Note [ring all-reduce over point-to-point]
// Open MPI's non-blocking MPI_Iallreduce (libnbc) moves large buffers at well under half
// the bandwidth of its blocking MPI_Allreduce (measured: benchmarks/README.md), and a
// blocking call on the progress thread would serialise every group and could deadlock
// when groups overlap. So the MPI backend runs its own bandwidth-optimal ring all-reduce on
// non-blocking point-to-point messages, advanced by the progress thread:
//
//   the buffer is cut into k chunks; k-1 reduce-scatter steps (send chunk (i - s) to the
//   right neighbour, receive chunk (i - s - 1) from the left one and add it), then k-1
//   all-gather steps that pass the reduced chunks around.
//
// Each rank sends 2 (k-1)/k of the buffer and adds (k-1)/k of it. (For k = 2, swapping
// whole buffers in one step was measured slower: it adds twice as much.) Every chunk is summed
// exactly once, along the ring, and then copied, so all members end with bit-identical results;
// 16-bit floats are summed in their own dtype (each partial sum rounded). Messages of one operation
// carry a tag of their own (a per-communicator sequence number), so any number of operations may be
// in flight on one communicator. The ring runs after the header stage of Note [operation header]
// (ShmAllreduce falls back to it), so every member's chunks have the sizes it expects.
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace decent_dp {
namespace detail {

// Reusable scratch buffers (the progress thread's only allocations after warm-up).
class ScratchPool {
 public:
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  Buffer acquire(size_t bytes);
  void release(Buffer buffer);

 private:
  std::vector<Buffer> free_;
};

// out[i] = a[i] + b[i] for n elements of dtype (float32, float64, bfloat16, float16, int32,
// int64), or with `divisor` > 1 (floating dtypes) out[i] = (a[i] + b[i]) / divisor, the sum
// rounded to the dtype first; `out` may be `a`.
void add_out(void* out, const void* a, const void* b, int64_t n, c10::ScalarType dtype,
             int64_t divisor = 1);

// What a RingAllreduce runs: the whole all-reduce, only its k - 1 reduce-scatter steps (this
// rank's chunk, (position + 1) mod k, is then reduced in the output; the other chunks hold
// partial sums), or only its k - 1 all-gather steps (each rank's chunk (position + 1) mod k
// of the output is passed around; the input is not read).
enum class RingPart { kAll, kReduceScatter, kAllGather };

class RingAllreduce {
 public:
  // Reduces `input` over the group into `output` (they may be the same buffer); with
  // `average`, divides by the group size.
  RingAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype, bool average,
                MPI_Comm comm, int index, int size, int tag, ScratchPool& pool);
  // The same over a ring of some ranks of `comm`: `ring` lists their ranks in `comm` in ring
  // order, this rank is ring[position]; the reduced chunks are divided by `divisor` (1: a sum);
  // `part` says which steps run.
  RingAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype,
                int64_t divisor, MPI_Comm comm, std::vector<int> ring, int position, int tag,
                ScratchPool& pool, RingPart part = RingPart::kAll);
  ~RingAllreduce();

  // Posts the next step's messages and returns their requests; returns none when the
  // operation is complete. Call again once every returned request has completed.
  std::vector<MPI_Request> next();
  // Payload bytes this rank has posted to send and to receive so far.
  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t bytes_received() const { return bytes_received_; }

 private:
  int64_t chunk_begin(int c) const { return offsets_[c]; }
  int64_t chunk_size(int c) const { return offsets_[c + 1] - offsets_[c]; }

  const char* input_;
  char* data_;  // the output
  int64_t divisor_;
  int64_t element_size_;
  c10::ScalarType dtype_;
  MPI_Comm comm_;
  std::vector<int> ring_;  // ranks in comm_, in ring order
  int index_;              // this rank's position in ring_
  int size_;
  int tag_;
  ScratchPool& pool_;
  ScratchPool::Buffer scratch_;
  std::vector<int64_t> offsets_;
  int step_ = 0;
  int end_step_ = 0;        // next() posts steps [step_, end_step_)
  int pending_chunk_ = -1;  // chunk received into scratch_ in the last reduce-scatter step
  int64_t bytes_sent_ = 0;
  int64_t bytes_received_ = 0;
};

// Note [ring lanes]
// A ring step waits for its whole chunk before the next step sends, so one operation keeps a
// link busy only while every member's chunk of the step is moving: on a shared link the
// slowest of them sets the pace and the link idles between steps. Several operations in
// flight fill those gaps: 12 MiB per rank exchanged in pairs across 4 emulated nodes of 2
// ranks at 400 Mbit/s took a median 891 ms as one operation and 678 ms as four, in five
// interleaved runs (`gossip_bench -t ring --inflight 1|4`). So an all-reduce that takes
// messages (the ring, or the node-aware path) over a group that spans several nodes (inside
// one node the copies are bound by the cores: between two ranks through Open MPI's shared
// memory, lanes made 8 MiB 20-35% faster but 2 and 32 MiB 5-15% slower) cuts its buffer into
// up to MpiOptions::ring_lanes contiguous segments of at least ring_lane_min_bytes and runs
// one ring (or node-aware all-reduce) per segment, each with a tag of its own, advanced by the
// engine as independent lanes (Note [lanes] in progress_engine.h). Every member cuts the same way
// (the choice depends on the size, the dtype and the settings, which must agree), each segment's
// chunks are summed along one path as before, so members still end with bit-identical
// results; the bytes each rank sends are the same up to the rounding of chunk sizes.
constexpr int kMaxLanes = 8;
// The message tag of lane `lane` of the operation numbered `sequence` on its group: distinct
// for the operations of 4096 consecutive numbers, within MPI's smallest tag bound (32767).
inline int operation_tag(uint32_t sequence, int lane) {
  return static_cast<int>(sequence % 4096u) * kMaxLanes + lane;
}
// How many lanes an all-reduce of `bytes` takes (1 <= lanes <= max_lanes, each at least
// `lane_min_bytes` when there is more than one), for `numel` elements over `size` ranks
// (never more lanes than would leave a segment shorter than the group).
int ring_lane_count(int64_t bytes, int64_t numel, int size, int max_lanes, int64_t lane_min_bytes);

// Note [node-aware all-reduce]
// A flat ring over a group that spans g nodes of l members each (k = g l) crosses node
// boundaries on g of its edges, each carrying 2 (k - 1) / k of the buffer: that much leaves
// every NIC. Reducing inside each node first cuts it to 2 (g - 1) / g, the least a node can
// send when every node must end with the sum of every other node's data (1.5 -> 1 block per
// NIC for two nodes of two, 1.75 -> 1.5 for four nodes of two):
//
//   1. inside each node, the reduce-scatter half of a ring all-reduce (sum) over its l
//      members: the member at position p of the node (group order) ends with the node's sum
//      of chunk (p + 1) mod l of l chunks;
//   2. the g members holding the same chunk, one per node (nodes in the order of their
//      first member), ring all-reduce that chunk (divided by k when averaging: the one
//      division of Note [ring all-reduce over point-to-point]);
//   3. inside each node, the all-gather half of the ring passes the finished chunks around.
//
// Every member sends what it would send in the flat ring, 2 (k - 1) / k of the buffer in all
// (phases 1 and 3: (l - 1) / l each, inside the node; phase 2: 2 (g - 1) / g of a chunk,
// across), but only phase 2 leaves the node. Each chunk is summed along one path and copied
// from there, so every member of the group ends with the same bits, as with the flat ring
// (not the flat ring's bits: the order of the sum differs). All three phases use the
// operation's tag: phases 1 and 3 exchange with the same partners inside the node, phase 2
// only with other nodes; MPI matches messages of one sender, communicator and tag in the
// order they were sent, and each phase posts its receives after those of the phase before,
// so a message of phase 3 never meets a receive of phase 1. The MPI communicator takes this
// path for groups of equal node shares (g >= 2, l >= 2, topology::node_aware_shape) at or
// above MpiOptions::node_aware_min_bytes; the choice depends only on the group, its layout
// and the size, the same on every member.
class NodeAwareAllreduce {
 public:
  // `nodes[m]`: the node of group member m (members in group order, m = rank in `comm`);
  // every node must hold the same number (>= 2) of members and there must be >= 2 nodes.
  NodeAwareAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype,
                     bool average, MPI_Comm comm, int index, const std::vector<int>& nodes, int tag,
                     ScratchPool& pool);

  // As RingAllreduce::next().
  std::vector<MPI_Request> next();
  int64_t bytes_sent() const;
  int64_t bytes_received() const;

  // True when `nodes` (the node of each member) has >= 2 nodes of >= 2 members each, all
  // the same size.
  static bool applies(const std::vector<int>& nodes);

 private:
  const char* input_;
  char* output_;
  int64_t numel_;
  c10::ScalarType dtype_;
  bool average_;
  MPI_Comm comm_;
  int tag_;
  ScratchPool& pool_;
  int64_t element_size_;
  int size_;                 // k, the group
  std::vector<int> local_;   // this node's members, in group order
  int local_index_ = 0;      // this rank's position in local_
  std::vector<int> across_;  // the members of this position, one per node, in node order
  int across_index_ = 0;     // this rank's position in across_
  int64_t chunk_begin_ = 0;  // the chunk this rank reduces across the nodes (elements)
  int64_t chunk_numel_ = 0;
  int phase_ = 0;
  std::unique_ptr<RingAllreduce> ring_;
  int64_t done_sent_ = 0;  // bytes of finished phases
  int64_t done_received_ = 0;
};

}  // namespace detail
}  // namespace decent_dp
