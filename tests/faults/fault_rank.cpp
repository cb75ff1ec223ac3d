// A gossip training job in which one rank dies on purpose, for tests/faults/test_faults.py:
//   mpiexec -n 4 fault_rank <die rank> <signal number> <die at step> <steps>
// Signal 0 stalls the rank for three seconds instead; -1 makes it leave the loop and exit
// normally, as a rank with fewer batches does.
// Every rank prints "rank <r> pid <pid>" first, so the driver can check that no process
// and no shared-memory segment of the job outlives it.
#include <torch/torch.h>

#include <unistd.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "decent_dp/decent_dp.h"

int run(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;  // mpirun then ends the other ranks
  }
}

int run(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: fault_rank <die rank> <signal> <die at step> <steps>\n");
    return 2;
  }
  const int die_rank = std::atoi(argv[1]);
  const int sig = std::atoi(argv[2]);
  const int die_step = std::atoi(argv[3]);
  const int steps = std::atoi(argv[4]);
  at::set_num_threads(1);
  auto comm = decent_dp::default_communicator();
  const int rank = comm->rank();
  std::printf("rank %d pid %d\n", rank, static_cast<int>(::getpid()));
  std::fflush(stdout);
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 10));
  decent_dp::DataParallelOptions options;
  options.topology = comm->size() % 2 == 0 ? "ring" : "complete";
  options.bucket_cap_mb = 0.05;
  decent_dp::DecentralizedDataParallel<torch::nn::Sequential> model(net, options,
                                                                    decent_dp::optim::adamw());
  torch::manual_seed(rank);
  for (int step = 0; step < steps; ++step) {
    if (rank == die_rank && step == die_step) {
      if (sig < 0) {  // fewer batches than its peers: leaves the loop and exits normally
        std::printf("rank %d leaving after %d steps\n", rank, step);
        std::fflush(stdout);
        return 0;
      }
      if (sig == 0) {  // a stall, not a death: three seconds behind its peers
        std::printf("rank %d stalling at step %d\n", rank, step);
        std::fflush(stdout);
        ::sleep(3);
      } else {
        std::printf("rank %d raising signal %d at step %d\n", rank, sig, step);
        std::fflush(stdout);
        std::raise(sig);
      }
    }
    auto x = torch::randn({32, 64});
    auto y = torch::randint(10, {32});
    torch::nn::functional::cross_entropy(model.forward(x), y).backward();
    ::usleep(2000);
  }
  std::printf("rank %d finished %d steps\n", rank, steps);
  return 0;
}
