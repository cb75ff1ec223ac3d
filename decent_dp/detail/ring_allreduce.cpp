#include "decent_dp/detail/ring_allreduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>

#include "decent_dp/detail/mpi_check.h"
#include "decent_dp/detail/multiversion.h"
#include "decent_dp/detail/progress_engine.h"
#include "decent_dp/errors.h"
#include "decent_dp/topology/traffic.h"

namespace decent_dp {
namespace detail {
namespace {

// out = a + b, or (a + b) / k with `k` > 1 (the sum rounded to T first, as an add followed by
// a divide would); `out` may be `a`.
template <typename T>
DECENT_DP_MULTIVERSION void add_typed(void* out, const void* a, const void* b, int64_t n,
                                      int64_t k) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* __restrict y = static_cast<const T*>(b);
  if (k > 1) {
    const T divisor = static_cast<T>(k);
    for (int64_t i = 0; i < n; ++i) {
      const T sum = x[i] + y[i];
      o[i] = sum / divisor;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    o[i] = x[i] + y[i];
  }
}

template <typename T>
void add_16bit(void* out, const void* a, const void* b, int64_t n, int64_t k) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  const float divisor = static_cast<float>(k);
  for (int64_t i = 0; i < n; ++i) {
    const T sum = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(y[i]));
    o[i] = k > 1 ? static_cast<T>(static_cast<float>(sum) / divisor) : sum;
  }
}

}  // namespace

ScratchPool::Buffer ScratchPool::acquire(size_t bytes) {
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) {
      best = it;
    }
  }
  if (best != free_.end()) {
    Buffer b = std::move(*best);
    free_.erase(best);
    return b;
  }
  Buffer b;
  b.bytes = std::max<size_t>(bytes, 1);
  b.data.reset(new char[b.bytes]);
  return b;
}

void ScratchPool::release(Buffer buffer) {
  if (!buffer.data) {
    return;
  }
  constexpr size_t kMaxFree = 16;
  if (free_.size() >= kMaxFree) {
    // Drop the smallest so the pool keeps the sizes that are in use.
    auto smallest =
        std::min_element(free_.begin(), free_.end(),
                         [](const Buffer& a, const Buffer& b) { return a.bytes < b.bytes; });
    if (smallest->bytes >= buffer.bytes) {
      return;
    }
    free_.erase(smallest);
  }
  free_.push_back(std::move(buffer));
}

void add_out(void* out, const void* a, const void* b, int64_t n, c10::ScalarType dtype,
             int64_t divisor) {
  const bool integral = dtype == c10::kInt || dtype == c10::kLong;
  if (divisor < 1 || (integral && divisor != 1)) {
    throw InvalidArgument(cat("add_out: divisor must be >= 1 (1 for integer dtypes), got ", divisor,
                              " for ", c10::toString(dtype)));
  }
  switch (dtype) {
    case c10::kFloat:
      return add_typed<float>(out, a, b, n, divisor);
    case c10::kDouble:
      return add_typed<double>(out, a, b, n, divisor);
    case c10::kInt:
      return add_typed<int32_t>(out, a, b, n, 1);
    case c10::kLong:
      return add_typed<int64_t>(out, a, b, n, 1);
    case c10::kBFloat16:
      return add_16bit<c10::BFloat16>(out, a, b, n, divisor);
    case c10::kHalf:
      return add_16bit<c10::Half>(out, a, b, n, divisor);
    default:
      throw InvalidArgument(cat("add_out: unsupported dtype ", c10::toString(dtype)));
  }
}

namespace {
std::vector<int> iota_ring(int size) {
  std::vector<int> ring(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) {
    ring[static_cast<size_t>(i)] = i;
  }
  return ring;
}
}  // namespace

RingAllreduce::RingAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype,
                             bool average, MPI_Comm comm, int index, int size, int tag,
                             ScratchPool& pool)
    : RingAllreduce(input, output, numel, dtype, average ? size : 1, comm, iota_ring(size), index,
                    tag, pool) {}

RingAllreduce::RingAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype,
                             int64_t divisor, MPI_Comm comm, std::vector<int> ring, int position,
                             int tag, ScratchPool& pool, RingPart part)
    : input_(input),
      data_(output),
      divisor_(divisor),
      element_size_(static_cast<int64_t>(c10::elementSize(dtype))),
      dtype_(dtype),
      comm_(comm),
      ring_(std::move(ring)),
      index_(position),
      size_(static_cast<int>(ring_.size())),
      tag_(tag),
      pool_(pool) {
  if (size_ < 1 || index_ < 0 || index_ >= size_ || divisor_ < 1) {
    throw InvalidArgument(cat("RingAllreduce: position must be in [0, ", size_ - 1,
                              "] of a non-empty ring and divisor >= 1, got position ", index_,
                              " and divisor ", divisor_));
  }
  offsets_.resize(size_ + 1);
  const int64_t base = numel / size_;
  const int64_t extra = numel % size_;
  offsets_[0] = 0;
  for (int c = 0; c < size_; ++c) {
    offsets_[c + 1] = offsets_[c] + base + (c < extra ? 1 : 0);
  }
  const int64_t max_chunk = base + (extra > 0 ? 1 : 0);
  if (max_chunk * element_size_ > INT_MAX) {
    throw InvalidArgument(cat("allreduce: a chunk of ", max_chunk * element_size_,
                              " bytes exceeds what one MPI message can carry (", INT_MAX,
                              "); reduce the tensor size or use a larger group"));
  }
  step_ = part == RingPart::kAllGather ? size_ - 1 : 0;
  end_step_ = part == RingPart::kReduceScatter ? size_ - 1 : 2 * (size_ - 1);
  if (part != RingPart::kAllGather) {
    scratch_ = pool_.acquire(static_cast<size_t>(max_chunk * element_size_));
  }
}

RingAllreduce::~RingAllreduce() {
  pool_.release(std::move(scratch_));
}

std::vector<MPI_Request> RingAllreduce::next() {
  const int k = size_;
  if (pending_chunk_ >= 0) {
    // output[c] = input[c] + received (the first time chunk c is reduced on this rank). The
    // last reduce-scatter step completes the chunk this rank owns, chunk (index + 1) mod k:
    // with a divisor (k when averaging) it is divided in the same pass, before it is passed
    // around, so each rank divides 1/k of the buffer and every member gets the same bits.
    const int64_t offset = chunk_begin(pending_chunk_) * element_size_;
    const bool owned = step_ == k - 1;
    add_out(data_ + offset, input_ + offset, scratch_.data.get(), chunk_size(pending_chunk_),
            dtype_, owned ? divisor_ : 1);
    pending_chunk_ = -1;
  }
  if (step_ >= end_step_) {
    return {};
  }
  const int right = ring_[static_cast<size_t>((index_ + 1) % k)];
  const int left = ring_[static_cast<size_t>((index_ - 1 + k) % k)];
  int send_chunk, recv_chunk;
  char* recv_into;
  const char* send_from;
  if (step_ < k - 1) {  // reduce-scatter
    const int s = step_;
    send_chunk = ((index_ - s) % k + k) % k;
    recv_chunk = ((index_ - s - 1) % k + k) % k;
    recv_into = scratch_.data.get();
    pending_chunk_ = recv_chunk;
    // The first step sends this rank's own input; later ones the partial sums.
    send_from = (s == 0 ? input_ : data_) + chunk_begin(send_chunk) * element_size_;
  } else {  // all-gather of the reduced chunks
    const int s = step_ - (k - 1);
    send_chunk = ((index_ + 1 - s) % k + k) % k;
    recv_chunk = ((index_ - s) % k + k) % k;
    recv_into = data_ + chunk_begin(recv_chunk) * element_size_;
    send_from = data_ + chunk_begin(send_chunk) * element_size_;
  }
  ++step_;
  bytes_received_ += chunk_size(recv_chunk) * element_size_;
  bytes_sent_ += chunk_size(send_chunk) * element_size_;
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  DECENT_DP_MPI_CHECK(MPI_Irecv(recv_into, static_cast<int>(chunk_size(recv_chunk) * element_size_),
                                MPI_BYTE, left, tag_, comm_, &requests[0]));
  track_posted(requests[0]);  // Note [abandoned requests]
  DECENT_DP_MPI_CHECK(MPI_Isend(send_from, static_cast<int>(chunk_size(send_chunk) * element_size_),
                                MPI_BYTE, right, tag_, comm_, &requests[1]));
  return {requests[0], requests[1]};
}

bool NodeAwareAllreduce::applies(const std::vector<int>& nodes) {
  return topology::node_aware_shape(nodes).nodes > 0;
}

NodeAwareAllreduce::NodeAwareAllreduce(const char* input, char* output, int64_t numel,
                                       c10::ScalarType dtype, bool average, MPI_Comm comm,
                                       int index, const std::vector<int>& nodes, int tag,
                                       ScratchPool& pool)
    : input_(input),
      output_(output),
      numel_(numel),
      dtype_(dtype),
      average_(average),
      comm_(comm),
      tag_(tag),
      pool_(pool),
      element_size_(static_cast<int64_t>(c10::elementSize(dtype))),
      size_(static_cast<int>(nodes.size())) {
  if (!applies(nodes) || index < 0 || index >= size_) {
    throw InvalidArgument(
        cat("NodeAwareAllreduce: needs >= 2 nodes of the same number (>= 2) of "
            "members and index in [0, ",
            size_ - 1, "], got ", size_, " members and index ", index));
  }
  const topology::NodeLayout layout = topology::node_layout(nodes, index);
  local_ = layout.local;
  local_index_ = layout.local_index;
  across_ = layout.across;
  across_index_ = layout.across_index;
  // The chunk phase 1 leaves reduced here: RingAllreduce's chunk (position + 1) mod l, with
  // its chunk sizes (the first numel mod l chunks one element longer).
  const int64_t l = static_cast<int64_t>(local_.size());
  const int64_t c = (local_index_ + 1) % l;
  const int64_t base = numel / l, extra = numel % l;
  chunk_begin_ = c * base + std::min(c, extra);
  chunk_numel_ = base + (c < extra ? 1 : 0);
}

int64_t NodeAwareAllreduce::bytes_sent() const {
  return done_sent_ + (ring_ ? ring_->bytes_sent() : 0);
}

int64_t NodeAwareAllreduce::bytes_received() const {
  return done_received_ + (ring_ ? ring_->bytes_received() : 0);
}

std::vector<MPI_Request> NodeAwareAllreduce::next() {
  for (;;) {
    if (ring_) {
      std::vector<MPI_Request> requests = ring_->next();
      if (!requests.empty()) {
        return requests;
      }
      done_sent_ += ring_->bytes_sent();
      done_received_ += ring_->bytes_received();
      ring_.reset();
    }
    switch (phase_++) {
      case 0:  // 1. the node's sum of this rank's chunk
        ring_ =
            std::make_unique<RingAllreduce>(input_, output_, numel_, dtype_, 1, comm_, local_,
                                            local_index_, tag_, pool_, RingPart::kReduceScatter);
        continue;
      case 1: {  // 2. that chunk across the nodes
        char* chunk = output_ + chunk_begin_ * element_size_;
        ring_ = std::make_unique<RingAllreduce>(chunk, chunk, chunk_numel_, dtype_,
                                                average_ ? size_ : 1, comm_, across_, across_index_,
                                                tag_, pool_);
        continue;
      }
      case 2:  // 3. the finished chunks, inside the node
        ring_ = std::make_unique<RingAllreduce>(output_, output_, numel_, dtype_, 1, comm_, local_,
                                                local_index_, tag_, pool_, RingPart::kAllGather);
        continue;
      default:
        return {};
    }
  }
}

int ring_lane_count(int64_t bytes, int64_t numel, int size, int max_lanes, int64_t lane_min_bytes) {
  if (max_lanes <= 1 || lane_min_bytes <= 0 || bytes < 2 * lane_min_bytes) {
    return 1;
  }
  int64_t lanes = std::min<int64_t>(bytes / lane_min_bytes, std::min(max_lanes, kMaxLanes));
  lanes = std::min<int64_t>(lanes, numel / std::max(size, 1));
  return static_cast<int>(std::max<int64_t>(lanes, 1));
}

}  // namespace detail
}  // namespace decent_dp
