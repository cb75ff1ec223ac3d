// Communicator over MPI for CPU tensors.
//
// The MPI calls are made by the communicator's progress engine (Note [MPI progress engine]
// in detail/progress_engine.h): operations start in submission order, a progress thread
// advances them while the caller computes, and a caller blocked in Work::wait() advances
// them itself. All-reduce is a ring over non-blocking point-to-point messages (Note [ring
// all-reduce over point-to-point] in detail/ring_allreduce.h), or for groups inside one node
// whose buffers come from allocate(), direct reads of shared memory (Note [shared-memory
// transport] in detail/shm.h). MPI is initialised with
// MPI_THREAD_MULTIPLE (checked).
#pragma once

#include <chrono>
#include <memory>

#include "decent_dp/communicator.h"

namespace decent_dp {

// What a communicator's all-reduces of more than one rank did so far.
struct MpiStats {
  uint64_t ring_allreduces = 0;           // over MPI point-to-point messages
  uint64_t shared_memory_allreduces = 0;  // through shared memory
  uint64_t node_aware_allreduces = 0;     // Note [node-aware all-reduce], over MPI messages
  // Payload bytes of those all-reduces that this rank sent to and received from its group:
  // MPI messages of the ring, and for the shared-memory path the bytes peers read of this
  // rank's buffers and this rank read of theirs. Both are 2 (k-1)/k of the buffer per
  // all-reduce over k ranks (for the node-aware path: its three phases' messages, inside the
  // node and across).
  uint64_t allreduce_bytes_sent = 0;
  uint64_t allreduce_bytes_received = 0;
  // Group all-gathers of more than one rank (Note [group all-gather]) by transport, and the
  // payload bytes this rank sent and received in them: (k - 1) n each way.
  uint64_t p2p_allgathers = 0;
  uint64_t shared_memory_allgathers = 0;
  uint64_t allgather_bytes_sent = 0;
  uint64_t allgather_bytes_received = 0;
  // Lanes the ring and node-aware all-reduces above ran in (Note [ring lanes]): one each for
  // those that took a single ring.
  uint64_t allreduce_lanes = 0;
};

struct MpiOptions {
  // Default timeout of Work::wait(); <= 0 takes DECENT_DP_TIMEOUT_MS (default 10 min).
  std::chrono::milliseconds timeout{0};
  // Pause between two polls while nobody waits; < 0 takes DECENT_DP_PROGRESS_INTERVAL_US
  // (default 50 us). 0 polls continuously.
  std::chrono::microseconds progress_interval{-1};
  // Shared-memory buffers and transport for ranks of one node (Note [shared-memory
  // transport]): 1 on, 0 off, -1 takes DECENT_DP_SHM (default on). Must agree across ranks.
  int shared_memory = -1;
  // All-reduces below this many bytes take the ring even when shared memory is available
  // (the shared-memory protocol costs one more round of messages).
  int64_t shared_memory_min_bytes = 64 << 10;
  // All-reduces of a group spread over g >= 2 nodes with the same number (>= 2) of its
  // members on each reduce inside each node first (Note [node-aware all-reduce]: 2 (g-1)/g of
  // the buffer out of each NIC instead of 2 (k-1)/k): 1 on, 0 off (every group takes the flat
  // ring), -1 takes DECENT_DP_NODE_AWARE (default on). Must agree across ranks.
  int node_aware = -1;
  // All-reduces below this many bytes take the flat ring even where the node-aware one
  // applies (it costs more steps). Must agree across ranks.
  int64_t node_aware_min_bytes = 64 << 10;
  // Note [ring lanes]: an all-reduce over MPI messages (the ring or the node-aware path) of a
  // group that spans several nodes, of at least 2 * ring_lane_min_bytes, runs as up to
  // `ring_lanes` independent rings over contiguous segments of its buffer, each segment at
  // least ring_lane_min_bytes, so a network link stays busy while one ring waits between
  // its steps. 1: one ring; -1 takes
  // DECENT_DP_RING_LANES (default 4); at most 8. Both must agree across ranks.
  int ring_lanes = -1;
  int64_t ring_lane_min_bytes = 1 << 20;
  // 0: nodes as MPI finds them (MPI_COMM_TYPE_SHARED). N > 0: every block of N consecutive
  // ranks is one node (local_rank(), local_size(), the shared-memory transport and the
  // node-aware all-reduce follow it), e.g. to try a multi-node layout on one machine. N
  // must divide the world size, each block must lie on one machine, and N must agree
  // across ranks.
  int ranks_per_node = 0;
};

class MpiCommunicator final : public Communicator {
 public:
  // Initialises MPI on first use (MPI_THREAD_MULTIPLE) unless the program already did, in
  // which case the provided thread level must be MPI_THREAD_MULTIPLE. Collective over
  // MPI_COMM_WORLD, which it duplicates.
  explicit MpiCommunicator(MpiOptions options = {});
  ~MpiCommunicator() override;

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  Backend backend() const override { return Backend::kMpi; }
  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;

  void make_groups(const std::vector<std::vector<int>>& groups) override;
  bool has_group(const std::vector<int>& ranks) const override;

  using Communicator::allgather;
  using Communicator::allreduce;
  std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                  const AllreduceOptions& options) override;
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) override;
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                  const AllgatherOptions& options) override;
  std::shared_ptr<Work> allgather_varying(const at::Tensor& output, const at::Tensor& input,
                                          const at::Tensor& lengths,
                                          const AllgatherOptions& options) override;
  void barrier() override;
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options) override;
  // Counts of completed all-reduces by transport.
  MpiStats stats() const;

  std::chrono::milliseconds timeout() const override;
  bool supports(const c10::Device& device) const override { return device.is_cpu(); }

  struct Impl;

 private:
  // The equal-size all-gather, and with `lengths` defined the varying one.
  std::shared_ptr<Work> gather(const at::Tensor& output, const at::Tensor& input,
                               const at::Tensor& lengths, const AllgatherOptions& options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace decent_dp
