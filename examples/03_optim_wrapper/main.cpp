// An ordinary LibTorch training loop — zero_grad(), backward(), step() — made decentralized
// by wrapping its optimizer in DecentOptimWrapper, with a torch::optim::StepLR scheduler.
//
//   mpirun -n 4 --oversubscribe build/bin/optim_wrapper --topology ring --steps 120
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cstdio>

#include "decent_dp/decent_dp.h"

int main(int argc, char** argv) {
  CLI::App app{"decent_dp example: DecentOptimWrapper around a torch::optim optimizer"};
  std::string topology = "ring";
  int steps = 120;
  app.add_option("--topology", topology, "complete, ring, exp, aer or a registered name");
  app.add_option("--steps", steps, "training steps")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);

  auto comm = decent_dp::default_communicator();
  torch::manual_seed(0);
  auto net =
      torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  try {
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                   torch::optim::SGDOptions(0.05).momentum(0.9));
    decent_dp::DecentOptimWrapper optimizer(sgd, comm->rank(), comm->size(), comm->local_size(),
                                            topology);
    torch::optim::StepLR scheduler(optimizer, /*step_size=*/steps / 3, /*gamma=*/0.3);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(10 + comm->rank());
    const auto w = torch::linspace(-1, 1, 10).view({10, 1});
    for (int step = 1; step <= steps; ++step) {
      auto x = at::randn({32, 10}, gen);
      auto y = x.matmul(w);
      optimizer.zero_grad();
      auto loss = torch::mse_loss(net->forward(x), y);
      loss.backward();
      optimizer.step();
      scheduler.step();
      if (comm->rank() == 0 && (step == 1 || step % (steps / 4) == 0)) {
        std::printf("step %4d  loss %.5f  lr %.4f\n", step, loss.item<double>(),
                    sgd->param_groups()[0].options().get_lr());
      }
    }
    optimizer.global_avg(/*may_revert=*/false);
    torch::NoGradGuard no_grad;
    auto x = at::randn({256, 10}, gen);
    const double eval = torch::mse_loss(net->forward(x), x.matmul(w)).item<double>();
    if (comm->rank() == 0) {
      std::printf("averaged model: evaluation loss %.5f after %lld steps on %d ranks\n", eval,
                  static_cast<long long>(optimizer.step_count()), comm->size());
    }
  } catch (const decent_dp::InvalidArgument& e) {
    if (comm->rank() == 0)
      std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
