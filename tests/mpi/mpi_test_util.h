// Shared helpers of the multi-rank tests (run under mpiexec -n N).
#pragma once

#include <chrono>
#include <memory>

#include "decent_dp/mpi_communicator.h"

namespace decent_dp {
namespace testing {

// The process's communicator, created on first use with a test-sized timeout so a
// mismatched collective fails the test instead of hanging it.
MpiCommunicator& comm();

}  // namespace testing
}  // namespace decent_dp
