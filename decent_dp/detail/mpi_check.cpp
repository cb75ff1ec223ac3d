#include "decent_dp/detail/mpi_check.h"

#include <atomic>

#include "decent_dp/communicator.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace detail {
namespace {

std::atomic<int> g_world_rank{-1};

}  // namespace

std::string mpi_error_string(int code) {
  char buffer[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS) {
    return cat("MPI error code ", code);
  }
  return std::string(buffer, static_cast<size_t>(length));
}

void set_mpi_world_rank(int rank) {
  g_world_rank.store(rank);
}

int mpi_world_rank() {
  return g_world_rank.load();
}

void throw_mpi_error(const char* call, int code, const char* file, int line) {
  throw CommError(cat(call, " failed on rank ", g_world_rank.load(), " (host ", host_name(),
                      ") at ", file, ":", line, ": ", mpi_error_string(code)));
}

}  // namespace detail
}  // namespace decent_dp
