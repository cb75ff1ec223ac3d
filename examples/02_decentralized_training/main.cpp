// Decentralized training of a small network with DecentralizedDataParallel, on synthetic
// data: every rank fits the same linear teacher from its own random samples, exchanging
// parameters with the group its topology names at each step. Prints the loss and the
// consensus distance, then averages the model globally and evaluates it.
//
//   mpirun -n 4 --oversubscribe build/bin/decentralized_training --topology ring --steps 200
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>

#include <cstdio>

#include "decent_dp/decent_dp.h"

namespace {

// y = x W^T + noise, W fixed (the same "teacher" on every rank).
std::pair<at::Tensor, at::Tensor> sample(at::Generator& gen, int64_t batch) {
  static const at::Tensor teacher = [] {
    auto g = at::make_generator<at::CPUGeneratorImpl>(7);
    return at::randn({4, 16}, g);
  }();
  auto x = at::randn({batch, 16}, gen);
  auto y = x.matmul(teacher.t()) + 0.01 * at::randn({batch, 4}, gen);
  return {x, y};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp example: decentralized training on synthetic data"};
  std::string topology = "ring";
  int steps = 200, batch = 32, lws = 0;
  double lr = 1e-2;
  app.add_option("--topology", topology, "complete, ring, exp, aer or a registered name");
  app.add_option("--steps", steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "samples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "peak learning rate")->check(CLI::PositiveNumber);
  app.add_option("--lws", lws, "ranks per node (default: found through MPI)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);

  auto comm = decent_dp::default_communicator();
  torch::manual_seed(0);
  auto net =
      torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 4));
  decent_dp::DataParallelOptions options;
  options.topology = topology;
  options.local_world_size = lws;
  try {
    decent_dp::optim::AdamWFactoryOptions adamw;
    adamw.lr = lr;
    adamw.weight_decay = 1e-4;
    decent_dp::DecentralizedDataParallel<torch::nn::Sequential> model(
        net, options, decent_dp::optim::adamw(adamw),
        decent_dp::optim::cosine_with_warmup(/*t_max=*/steps, /*t_warmup=*/steps / 10), comm);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + comm->rank());
    for (int step = 1; step <= steps; ++step) {
      auto [x, y] = sample(gen, batch);
      auto loss = torch::mse_loss(model.forward(x), y);
      loss.backward();  // buckets step and start their exchanges inside backward
      if (step % std::max(1, steps / 5) == 0 || step == 1) {
        const double consensus = model.consensus_distance();  // collective
        if (comm->rank() == 0) {
          std::printf("step %4d  loss %.5f  lr %.5f  consensus distance %.3e\n", step,
                      loss.item<double>(), model.get_lr(), consensus);
        }
      }
    }
    model.global_avg(/*will_revert=*/false);
    torch::NoGradGuard no_grad;
    model.eval();
    auto eval_gen = at::make_generator<at::CPUGeneratorImpl>(999);
    auto [x, y] = sample(eval_gen, 1024);
    const double eval_loss = torch::mse_loss(model.forward(x), y).item<double>();
    if (comm->rank() == 0) {
      std::printf("averaged model: evaluation loss %.5f on %d ranks (%s)\n", eval_loss,
                  comm->size(), model.topology().name().c_str());
    }
  } catch (const decent_dp::InvalidArgument& e) {
    if (comm->rank() == 0)
      std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
