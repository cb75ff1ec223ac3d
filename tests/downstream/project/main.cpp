#include <decent_dp/decent_dp.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::nn::Sequential net(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                            torch::nn::Linear(32, 4));  // any torch::nn::Module
  decent_dp::DataParallelOptions options;
  options.topology = "exp";  // who averages with whom, step by step
  decent_dp::DecentralizedDataParallel<torch::nn::Sequential> model(
      net, options, decent_dp::optim::adamw(), decent_dp::optim::cosine_with_warmup(100, 10));
  const int rank = decent_dp::default_communicator()->rank();
  torch::manual_seed(rank);               // different data on every rank
  for (int step = 0; step < 2; ++step) {  // your data loader here
    auto data = torch::randn({16, 8});
    auto target = torch::randint(4, {16});
    auto loss = torch::nn::functional::cross_entropy(model.forward(data), target);
    loss.backward();  // optimizer steps + gossip happen in here
  }
  model.global_avg(/*will_revert=*/false);  // every rank holds the mean model
  if (rank == 0) {
    std::printf("consumer ok: %lld updates\n", static_cast<long long>(model.updates()));
  }
  return 0;
}
