// Two ranks all-reduce tensors of different sizes over MPI messages (no shared memory), large
// enough for Open MPI's single-copy path, whose truncated receives overrun their buffer:
// the header stage (Note [operation header]) refuses the operation on both ranks, naming both
// sizes, before any payload is posted. Each rank checks its own message; the communicator
// stays usable.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/ops/ones.h>

#include <cstdio>
#include <string>

#include "decent_dp/errors.h"
#include "decent_dp/mpi_communicator.h"

int main() {
  decent_dp::MpiOptions options;
  options.timeout = std::chrono::milliseconds(3000);
  options.shared_memory = 0;
  decent_dp::MpiCommunicator comm(options);
  const int rank = comm.rank();
  const int64_t n = rank == 1 ? 65536 : 16384;
  at::Tensor t = at::ones({n});
  const std::string expected =
      rank == 0 ? "rank 0 (this rank) runs allreduce(sum, 16384 x Float), rank 1 runs "
                  "allreduce(sum, 65536 x Float)"
                : "rank 1 (this rank) runs allreduce(sum, 65536 x Float), rank 0 runs "
                  "allreduce(sum, 16384 x Float)";
  int rc = 1;
  try {
    comm.allreduce(t, {}, decent_dp::ReduceOp::kSum)->wait();
    std::printf("rank %d: no error\n", rank);
  } catch (const decent_dp::Error& e) {
    std::printf("rank %d: %s\n", rank, e.what());
    rc = std::string(e.what()).find(expected) == std::string::npos ? 1 : 0;
  }
  at::Tensor ok = at::ones({16384});
  comm.allreduce(ok, {}, decent_dp::ReduceOp::kSum)->wait();
  if (ok[0].item<float>() != 2.0f) {
    std::printf("rank %d: the communicator is broken after the error\n", rank);
    rc = 1;
  }
  std::fflush(stdout);
  return rc;
}
