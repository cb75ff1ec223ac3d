// A program that initialises and finalises MPI itself, as docs/communicator.md allows, and
// uses the library's default communicator in between. The default communicator outlives
// main(), so it is destroyed after MPI_Finalize: that must be a clean exit, not an abort.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/ops/ones.h>

#include <cstdio>

#include "decent_dp/backend.h"
#include "decent_dp/communicator.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  auto comm = decent_dp::default_communicator();
  at::Tensor t = at::ones({4});
  comm->allreduce(t, {}, decent_dp::ReduceOp::kSum)->wait();
  std::printf("rank %d: sum %g\n", comm->rank(), t[0].item<double>());
  comm.reset();  // the library still holds its default communicator
  MPI_Finalize();
  std::printf("rank done: finalized by the program\n");
  return 0;
}
