// Note [shared-memory transport]
// Ranks on one node can read each other's memory directly when it lives in POSIX shared
// memory, which moves a buffer at copy-loop speed; Open MPI's single-copy path for large
// messages (CMA, process_vm_readv) was measured at well under half of that. So
// MpiCommunicator::allocate() places the blocks the wrappers exchange (Communicator::allocate
// is how they get them) in named shared-memory segments, and an all-reduce whose group lies
// on one node, with every member's input and output inside such segments, runs as:
//
//   1. every member sends every other member a descriptor (segment name and offsets of its
//      input and output); if any member's buffers are not shared, all fall back to the ring
//      (the decision is made from the same k descriptors on every member);
//   2. member j reduces chunk j of the buffer straight from the members' inputs, summing in
//      member order, into its own output, and tells the others ("reduced");
//   3. each member copies chunk m from member m's output once m reduced it, and tells the
//      others ("copied"); the operation completes once every member has copied this
//      member's chunk, so no member changes an input or output another one still reads.
//
// The control messages are small MPI messages on the group's communicator and tag, so the
// operation runs in the progress engine like the ring. Every chunk is reduced once, so all
// members hold bit-identical results. Segments are unlinked when their tensor is freed, and
// those of a process killed before that by its janitor (Note [shared-memory janitor]).
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "decent_dp/detail/op_header.h"
#include "decent_dp/detail/ring_allreduce.h"

namespace decent_dp {
namespace detail {

// A zero-filled CPU tensor of `numel` elements in a new shared-memory segment of this
// process, or an undefined tensor when the segment cannot be created (e.g. /dev/shm is
// full); `why` then says why.
at::Tensor allocate_shared(int64_t numel, c10::ScalarType dtype, std::string& why);

// Where `bytes` bytes at `ptr` lie in this process's segments: false when not inside one.
bool find_shared(const void* ptr, size_t bytes, std::string& name, uint64_t& offset);

// Another process's segment, mapped read-only.
class PeerSegment {
 public:
  explicit PeerSegment(const std::string& name);  // throws CommError
  ~PeerSegment();
  PeerSegment(const PeerSegment&) = delete;
  PeerSegment& operator=(const PeerSegment&) = delete;
  const char* data() const { return static_cast<const char*>(base_); }
  size_t size() const { return size_; }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
};

// Mappings of peers' segments by name. Each miss drops the mappings of segments that their
// owners have since freed, and beyond a bound the least recently used one (an operation in
// flight keeps its own references). Used by the engine's token holder only.
class PeerSegmentCache {
 public:
  std::shared_ptr<PeerSegment> get(const std::string& name);

 private:
  static constexpr size_t kMaxMapped = 4096;
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<PeerSegment>>> mapped_;
  uint64_t clock_ = 0;
};

// An all-reduce: the header stage (Note [operation header]), then Note [shared-memory
// transport] when `try_shared` and every member's buffers are shared; otherwise
// NodeAwareAllreduce when `nodes` (the node of each member) is not empty, RingAllreduce when
// it is. `header` describes the operation (its shared-memory fields are filled here);
// `ranks` are the group's members and `sequence` the operation's number there, for errors.
class ShmAllreduce {
 public:
  ShmAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype, bool average,
               MPI_Comm comm, int index, int size, int tag, ScratchPool& pool,
               PeerSegmentCache& peers, const OpHeader& header, bool try_shared,
               const std::vector<int>& ranks, int64_t sequence, std::vector<int> nodes = {},
               int max_lanes = 1, int64_t lane_min_bytes = 0);

  // As RingAllreduce::next(), for one lane (Note [lanes] in progress_engine.h): lane 0 runs
  // the header stage and the shared-memory transport; taking messages instead opens the
  // lanes of Note [ring lanes] (`tag` is lane 0's tag, lane j uses tag + j).
  std::vector<MPI_Request> next(int lane = 0);
  // Lanes opened so far.
  int lanes() const { return lanes_.empty() ? 1 : static_cast<int>(lanes_.size()); }
  // True once the members agreed to take messages instead (the ring or the node-aware path).
  bool fell_back() const { return !lanes_.empty(); }
  // True once the members took Note [node-aware all-reduce].
  bool node_aware() const { return !lanes_.empty() && lanes_[0].node_aware != nullptr; }
  // Payload bytes moved between this rank and its peers once complete: what the peers read
  // of this rank's buffers (sent) and what this rank read of theirs (received); the ring's
  // messages after a fall-back. Descriptors and completion signals are not counted.
  int64_t bytes_sent() const;
  int64_t bytes_received() const;

 private:
  int64_t chunk_begin(int c) const { return offsets_[c]; }
  int64_t chunk_size(int c) const { return offsets_[c + 1] - offsets_[c]; }
  std::vector<MPI_Request> post_all(int stage);
  const char* peer_input(int m) const;
  const char* peer_output(int m) const;

  const char* input_;
  char* output_;
  int64_t numel_;
  c10::ScalarType dtype_;
  bool average_;
  MPI_Comm comm_;
  int index_;
  int size_;
  int tag_;
  ScratchPool& pool_;
  PeerSegmentCache& peers_;
  int64_t element_size_;
  std::vector<int64_t> offsets_;
  int stage_ = 0;
  OpHeader mine_{};  // segment: "input segment|output segment"
  std::vector<OpHeader> theirs_;
  const std::vector<int>& ranks_;
  int64_t sequence_;
  std::vector<std::shared_ptr<PeerSegment>> segments_;
  std::vector<int32_t> signal_in_;
  int32_t signal_out_ = 1;
  std::vector<int> nodes_;
  int max_lanes_;
  int64_t lane_min_bytes_;
  // Note [ring lanes]: one ring or node-aware all-reduce per segment of the buffer.
  struct Lane {
    std::unique_ptr<RingAllreduce> ring;
    std::unique_ptr<NodeAwareAllreduce> node_aware;
    std::vector<MPI_Request> next() { return ring ? ring->next() : node_aware->next(); }
    int64_t bytes_sent() const { return ring ? ring->bytes_sent() : node_aware->bytes_sent(); }
    int64_t bytes_received() const {
      return ring ? ring->bytes_received() : node_aware->bytes_received();
    }
  };
  std::vector<Lane> lanes_;
};

}  // namespace detail
}  // namespace decent_dp
