// One checked-call macro for every MPI call of the library:
//
//   DECENT_DP_MPI_CHECK(MPI_Isend(...));
//
// throws CommError with the call's text, the library's error string, this process's world
// rank and host, and the call site, e.g.
//   "MPI_Isend(...) failed on rank 3 (host node7) at decent_dp/detail/allgather.cpp:88:
//    MPI_ERR_TRUNCATE: message truncated".
// Error paths never make further MPI calls beyond MPI_Error_string.
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <string>

namespace decent_dp {
namespace detail {

// The text MPI gives for `code` ("MPI error code N" when it has none).
std::string mpi_error_string(int code);
// Recorded once MPI is initialised, so error paths need no MPI call.
void set_mpi_world_rank(int rank);
int mpi_world_rank();
[[noreturn]] void throw_mpi_error(const char* call, int code, const char* file, int line);

}  // namespace detail
}  // namespace decent_dp

#define DECENT_DP_MPI_CHECK(call)                                                     \
  do {                                                                                \
    const int decent_dp_rc_ = (call);                                                 \
    if (decent_dp_rc_ != MPI_SUCCESS) {                                               \
      ::decent_dp::detail::throw_mpi_error(#call, decent_dp_rc_, __FILE__, __LINE__); \
    }                                                                                 \
  } while (0)
