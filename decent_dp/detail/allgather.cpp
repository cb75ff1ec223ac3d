#include "decent_dp/detail/allgather.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>

#include "decent_dp/detail/mpi_check.h"
#include "decent_dp/detail/shm.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace detail {

std::vector<MPI_Request> post_member_exchange(const void* send, void* recv_base, size_t recv_stride,
                                              size_t bytes, MPI_Comm comm, int index, int size,
                                              int tag) {
  constexpr size_t kMaxMessage = INT_MAX;
  const size_t pieces = std::max<size_t>(1, (bytes + kMaxMessage - 1) / kMaxMessage);
  std::vector<MPI_Request> requests;
  requests.reserve(2 * (size - 1) * pieces);
  auto post = [&](bool receive) {
    for (int m = 0; m < size; ++m) {
      if (m == index) {
        continue;
      }
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
                               PeerSegmentCache& peers)
    : input_(input),
      output_(output),
      bytes_(bytes),
      comm_(comm),
      index_(index),
      size_(size),
      tag_(tag),
      try_shared_(try_shared),
      peers_(peers) {
  if (try_shared_) {
    std::string name;
    uint64_t offset = 0;
    const bool shared = find_shared(input, bytes, name, offset) && name.size() < sizeof(mine_.name);
    mine_.shared = shared ? 1 : 0;
    if (shared) {
      std::memcpy(mine_.name, name.c_str(), name.size() + 1);
    }
    mine_.offset = offset;
    mine_.bytes = bytes;
    theirs_.resize(size_);
    signal_in_.resize(size_);
  }
}

GroupAllgather::~GroupAllgather() = default;

std::vector<MPI_Request> GroupAllgather::point_to_point() {
  p2p_ = true;
  char* own = output_ + index_ * bytes_;
  if (own != input_ && bytes_ > 0) {
    std::memcpy(own, input_, bytes_);
  }
  return post_member_exchange(input_, output_, bytes_, bytes_, comm_, index_, size_, tag_);
}

std::vector<MPI_Request> GroupAllgather::next() {
  if (!try_shared_) {
    return stage_++ == 0 ? point_to_point() : std::vector<MPI_Request>{};
  }
  if (p2p_) {
    return {};  // the point-to-point messages completed
  }
  switch (stage_++) {
    case 0:
      return post_member_exchange(&mine_, theirs_.data(), sizeof(Descriptor), sizeof(Descriptor),
                                  comm_, index_, size_, tag_);
    case 1: {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      theirs_[index_] = mine_;
      bool shared = true;
      for (int m = 0; m < size_; ++m) {
        if (theirs_[m].bytes != bytes_) {
          throw CommError(cat("allgather: group members disagree on the block size: member ", m,
                              " sends ", theirs_[m].bytes, " bytes, member ", index_, " ", bytes_));
        }
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
          if (into != input_ && bytes_ > 0) {
            std::memcpy(into, input_, bytes_);
          }
          continue;
        }
        segments_[m] = peers_.get(theirs_[m].name);
        if (theirs_[m].offset + bytes_ > segments_[m]->size()) {
          throw CommError(cat("allgather: member ", m, "'s block lies outside its segment"));
        }
        std::memcpy(into, segments_[m]->data() + theirs_[m].offset, bytes_);
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
