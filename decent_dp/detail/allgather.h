// Note [group all-gather]
// Every member of a group receives every member's block: the transport of the exchanges
// that need each peer's own values rather than their sum (robust aggregators such as the
// median or the trimmed mean; compressed payloads, which cannot be summed on the way).
// Member m's block lands at bytes [m * n, (m + 1) * n) of every member's output.
//
// Two transports, chosen like the all-reduce's (Note [shared-memory transport]):
//  - point-to-point: each member posts one receive from and one send to every other member,
//    all at once (a neighbour exchange; for the two-member groups of ring and exp it is a
//    single swap); messages above INT_MAX bytes are split;
//  - shared memory, for groups inside one node whose inputs lie in allocate()d segments:
//    members exchange descriptors of their inputs, copy every peer's block straight out of
//    its segment, and tell each other "copied"; the operation completes once every peer has
//    copied this member's block, so no input changes while someone reads it. When any
//    member's input is private, all members take the point-to-point path.
// Each member moves (k - 1) n bytes each way on either path.
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "decent_dp/detail/op_header.h"

namespace decent_dp {
namespace detail {

class PeerSegment;
class PeerSegmentCache;

// Posts, for every member m != index of the group on `comm`, a receive of `bytes` bytes
// from m into recv_base + m * recv_stride and a send of `bytes` bytes at `send` to m, all
// on `tag`; messages over INT_MAX bytes are split. Returns the requests.
std::vector<MPI_Request> post_member_exchange(const void* send, void* recv_base, size_t recv_stride,
                                              size_t bytes, MPI_Comm comm, int index, int size,
                                              int tag);
// The same with `send_bytes` sent to every member and recv_bytes[m] received from member m.
std::vector<MPI_Request> post_member_exchange_v(const void* send, size_t send_bytes,
                                                void* recv_base, size_t recv_stride,
                                                const std::vector<size_t>& recv_bytes,
                                                MPI_Comm comm, int index, int size, int tag);

class GroupAllgather {
 public:
  // `input`: this member's `bytes` bytes; `output`: size * bytes bytes (this member's own
  // block is copied there too; `input` may already be that block). The header stage (Note
  // [operation header]) comes first and carries the shared-memory descriptor; `ranks` and
  // `sequence` are for its errors.
  //
  // Varying (`lengths` not null, Note [varying all-gather]): `bytes` is the capacity of
  // every member's block in `output` and `input_bytes` (<= bytes) this member's length; the
  // lengths travel in the headers, member m's input lands at [m * bytes, m * bytes + len_m)
  // and len_m in (*lengths)[m].
  GroupAllgather(const char* input, char* output, size_t bytes, MPI_Comm comm, int index, int size,
                 int tag, bool try_shared, PeerSegmentCache& peers, const OpHeader& header,
                 const std::vector<int>& ranks, int64_t sequence, int64_t* lengths = nullptr,
                 size_t input_bytes = 0);
  ~GroupAllgather();

  // As RingAllreduce::next().
  std::vector<MPI_Request> next();
  bool used_shared_memory() const { return shared_; }
  int64_t bytes_sent() const { return static_cast<int64_t>(input_bytes_) * (size_ - 1); }
  int64_t bytes_received() const { return received_; }

 private:
  std::vector<MPI_Request> point_to_point();

  const char* input_;
  char* output_;
  size_t bytes_;
  size_t input_bytes_;
  int64_t* lengths_;
  int64_t received_ = 0;
  std::vector<size_t> recv_bytes_;
  MPI_Comm comm_;
  int index_;
  int size_;
  int tag_;
  bool try_shared_;
  PeerSegmentCache& peers_;
  int stage_ = 0;
  bool shared_ = false;
  bool p2p_ = false;
  OpHeader mine_{};
  std::vector<OpHeader> theirs_;
  const std::vector<int>& ranks_;
  int64_t sequence_;
  std::vector<int32_t> signal_in_;
  int32_t signal_out_ = 1;
  std::vector<std::shared_ptr<PeerSegment>> segments_;
};

}  // namespace detail
}  // namespace decent_dp
