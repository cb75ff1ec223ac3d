// Two ranks all-reduce tensors of different sizes over MPI messages (no shared memory): the
// rank that receives more than it expects reports MPI's own error for that message, with
// the operation and the peer, instead of a bare MPI_ERR_IN_STATUS.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/ops/ones.h>

#include <cstdio>

#include "decent_dp/errors.h"
#include "decent_dp/mpi_communicator.h"

int main() {
  decent_dp::MpiOptions options;
  options.timeout = std::chrono::milliseconds(3000);
  options.shared_memory = 0;
  decent_dp::MpiCommunicator comm(options);
  const int64_t n = comm.rank() == 1 ? 4096 : 1024;
  at::Tensor t = at::ones({n});
  try {
    comm.allreduce(t, {}, decent_dp::ReduceOp::kSum)->wait();
    std::printf("rank %d: no error\n", comm.rank());
  } catch (const decent_dp::CommError& e) {
    std::printf("rank %d: %s\n", comm.rank(), e.what());
  }
  std::fflush(stdout);
  return 0;
}
