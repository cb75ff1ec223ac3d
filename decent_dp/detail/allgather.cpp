#include "decent_dp/detail/allgather.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>

#include "decent_dp/communicator.h"
#include "decent_dp/detail/mpi_check.h"
#include "decent_dp/detail/progress_engine.h"
#include "decent_dp/detail/shm.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace detail {

std::vector<MPI_Request> post_member_exchange(const void* send, void* recv_base, size_t recv_stride,
                                              size_t bytes, MPI_Comm comm, int index, int size,
                                              int tag) {
  return post_member_exchange_v(send, bytes, recv_base, recv_stride,
                                std::vector<size_t>(static_cast<size_t>(size), bytes), comm, index,
                                size, tag);
}

std::vector<MPI_Request> post_member_exchange_v(const void* send, size_t send_bytes,
                                                void* recv_base, size_t recv_stride,
                                                const std::vector<size_t>& recv_bytes,
                                                MPI_Comm comm, int index, int size, int tag) {
  constexpr size_t kMaxMessage = INT_MAX;
  std::vector<MPI_Request> requests;
  requests.reserve(2 * (size - 1));
  auto post = [&](bool receive) {
    for (int m = 0; m < size; ++m) {
      if (m == index) {
        continue;
      }
      const size_t bytes = receive ? recv_bytes[static_cast<size_t>(m)] : send_bytes;
      const size_t pieces = std::max<size_t>(1, (bytes + kMaxMessage - 1) / kMaxMessage);
      for (size_t offset = 0, p = 0; p < pieces; ++p, offset += kMaxMessage) {
        const int count = static_cast<int>(std::min(kMaxMessage, bytes - offset));
        MPI_Request r = MPI_REQUEST_NULL;
        if (receive) {
          char* into = static_cast<char*>(recv_base) + m * recv_stride + offset;
          DECENT_DP_MPI_CHECK(MPI_Irecv(into, count, MPI_BYTE, m, tag, comm, &r));
        } else {
          const char* from = static_cast<const char*>(send) + offset;
          DECENT_DP_MPI_CHECK(MPI_Isend(from, count, MPI_BYTE, m, tag, comm, &r));
        }
        requests.push_back(r);
        track_posted(r);  // Note [abandoned requests]
      }
    }
  };
  post(/*receive=*/true);
  // What this member wrote (its input, its part of a result) is visible to the peers before
  // they learn of it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  post(/*receive=*/false);
  return requests;
}

GroupAllgather::GroupAllgather(const char* input, char* output, size_t bytes, MPI_Comm comm,
                               int index, int size, int tag, bool try_shared,
                               PeerSegmentCache& peers, const OpHeader& header,
                               const std::vector<int>& ranks, int64_t sequence, int64_t* lengths,
                               size_t input_bytes)
    : input_(input),
      output_(output),
      bytes_(bytes),
      input_bytes_(lengths != nullptr ? input_bytes : bytes),
      lengths_(lengths),
      comm_(comm),
      index_(index),
      size_(size),
      tag_(tag),
      try_shared_(try_shared),
      peers_(peers),
      mine_(header),
      ranks_(ranks),
      sequence_(sequence) {
  if (lengths_ != nullptr) {
    mine_.length = static_cast<int64_t>(input_bytes_);
  }
  if (try_shared_) {
    std::string name;
    uint64_t offset = 0;
    const bool shared =
        find_shared(input, input_bytes_, name, offset) && name.size() < sizeof(mine_.segment);
    mine_.shared = shared ? 1 : 0;
    if (shared) {
      std::memcpy(mine_.segment, name.c_str(), name.size() + 1);
    }
    mine_.input_offset = offset;
    signal_in_.resize(size_);
  }
}

GroupAllgather::~GroupAllgather() = default;

std::vector<MPI_Request> GroupAllgather::point_to_point() {
  p2p_ = true;
  char* own = output_ + index_ * bytes_;
  if (own != input_ && input_bytes_ > 0) {
    std::memcpy(own, input_, input_bytes_);
  }
  return post_member_exchange_v(input_, input_bytes_, output_, bytes_, recv_bytes_, comm_, index_,
                                size_, tag_);
}

std::vector<MPI_Request> GroupAllgather::next() {
  if (p2p_) {
    return {};  // the point-to-point messages completed
  }
  switch (stage_++) {
    case 0:
      return post_op_headers(mine_, theirs_, comm_, index_, size_, tag_);
    case 1: {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      check_op_headers(theirs_, index_, ranks_, sequence_);
      // Note [varying all-gather]: each member's length came with its header.
      recv_bytes_.assign(static_cast<size_t>(size_), bytes_);
      for (int m = 0; m < size_; ++m) {
        if (lengths_ != nullptr) {
          const int64_t len = theirs_[m].length;
          if (len < 0 || static_cast<size_t>(len) > bytes_) {
            throw CommError(cat("allgather: member ", m, " of group ", ranks_to_string(ranks_),
                                " announced ", len, " bytes for a capacity of ", bytes_));
          }
          recv_bytes_[m] = static_cast<size_t>(len);
          lengths_[m] = len;
        }
        if (m != index_) {
          received_ += static_cast<int64_t>(recv_bytes_[m]);
        }
      }
      bool shared = true;
      for (int m = 0; m < size_; ++m) {
        shared = shared && theirs_[m].shared == 1;
      }
      if (!shared) {
        return point_to_point();  // every member sees the same descriptors
      }
      shared_ = true;
      segments_.resize(size_);
      for (int m = 0; m < size_; ++m) {
        char* into = output_ + m * bytes_;
        if (m == index_) {
          if (into != input_ && input_bytes_ > 0) {
            std::memcpy(into, input_, input_bytes_);
          }
          continue;
        }
        segments_[m] = peers_.get(std::string(
            theirs_[m].segment, strnlen(theirs_[m].segment, sizeof(theirs_[m].segment))));
        if (theirs_[m].input_offset + recv_bytes_[m] > segments_[m]->size()) {
          throw CommError(cat("allgather: member ", m, "'s block lies outside its segment"));
        }
        std::memcpy(into, segments_[m]->data() + theirs_[m].input_offset, recv_bytes_[m]);
      }
      return post_member_exchange(&signal_out_, signal_in_.data(), sizeof(int32_t), sizeof(int32_t),
                                  comm_, index_, size_, tag_);  // "copied"
    }
    default:
      segments_.clear();
      return {};
  }
}

}  // namespace detail
}  // namespace decent_dp
