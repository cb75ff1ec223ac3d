// Main of the GPU tests: exits with 77 (ctest's skip) and says so where this process sees no
// CUDA device, before MPI starts, unless DECENT_DP_GPU_TESTS_ON_CPU=1 lets the CPU stand in
// (tests/gpu/test_gpu.cpp); otherwise as the multi-rank tests' main.
#define CATCH_CONFIG_RUNNER
#include "torch_catch.h"

#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "mpi/mpi_test_util.h"

namespace decent_dp {
namespace testing {

MpiCommunicator& comm() {
  static MpiCommunicator instance([] {
    MpiOptions options;
    options.timeout = std::chrono::seconds(120);
    return options;
  }());
  return instance;
}

}  // namespace testing
}  // namespace decent_dp

int main(int argc, char** argv) {
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  const char* stand_in = std::getenv("DECENT_DP_GPU_TESTS_ON_CPU");
  const bool stand_in_asked = stand_in != nullptr && std::string(stand_in) == "1";
  if (stand_in_asked && gpus > 0) {
    std::printf("skipped: a CUDA device is seen, and the GPU tests run on it (test_gpu)\n");
    return 77;
  }
  if (gpus == 0 && !stand_in_asked) {
    std::printf("skipped: this process sees no CUDA device (the GPU tests need one)\n");
    return 77;
  }
  at::set_num_threads(1);
  auto& comm = decent_dp::testing::comm();
  if (comm.rank() == 0) {
    if (gpus == 0) {
      std::printf(
          "no CUDA device: the CPU stands in for the GPU (%d rank(s)); the NCCL, "
          "stream and GPU-only cases are skipped\n",
          comm.size());
    } else {
      std::printf("%d CUDA device(s), %d rank(s)\n", gpus, comm.size());
    }
  }
  Catch::Session session;
  const int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) {
    return rc;
  }
  const int failed = session.run();
  comm.barrier();
  return failed == 0 ? 0 : 1;
}
