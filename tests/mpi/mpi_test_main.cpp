#define CATCH_CONFIG_RUNNER
#include "torch_catch.h"

#include <ATen/Parallel.h>

#include "mpi_test_util.h"

namespace decent_dp {
namespace testing {

MpiCommunicator& comm() {
  static MpiCommunicator instance([] {
    MpiOptions options;
    options.timeout = std::chrono::seconds(60);
    // The tests' buffers are small: let all of them take shared memory when it is on.
    options.shared_memory_min_bytes = 0;
    return options;
  }());
  return instance;
}

}  // namespace testing
}  // namespace decent_dp

int main(int argc, char** argv) {
  at::set_num_threads(1);
  auto& comm = decent_dp::testing::comm();
  Catch::Session session;
  const int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) {
    return rc;
  }
  const int failed = session.run();
  // Every rank reports; mpiexec fails the job when any rank exits non-zero.
  comm.barrier();
  return failed == 0 ? 0 : 1;
}
