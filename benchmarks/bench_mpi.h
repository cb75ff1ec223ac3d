// Helpers the MPI benchmarks share (MPI_COMM_WORLD must be initialized).
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

namespace decent_dp {
namespace bench {

// The largest `ms` over all ranks: a step is as slow as its slowest rank. Collective.
inline double slowest(double ms) {
  double out = 0;
  MPI_Allreduce(&ms, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

}  // namespace bench
}  // namespace decent_dp
