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

class RingAllreduce {
 public:
  // Reduces `input` over the group into `output` (they may be the same buffer); with
  // `average`, divides by the group size.
  RingAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype, bool average,
                MPI_Comm comm, int index, int size, int tag, ScratchPool& pool);
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
  bool average_;
  int64_t element_size_;
  c10::ScalarType dtype_;
  MPI_Comm comm_;
  int index_;
  int size_;
  int tag_;
  ScratchPool& pool_;
  ScratchPool::Buffer scratch_;
  std::vector<int64_t> offsets_;
  int step_ = 0;
  int pending_chunk_ = -1;  // chunk received into scratch_ in the last reduce-scatter step
  int64_t bytes_sent_ = 0;
  int64_t bytes_received_ = 0;
};

}  // namespace detail
}  // namespace decent_dp
