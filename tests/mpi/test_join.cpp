// Uneven inputs under join (Note [join]): ranks with different numbers of batches finish
// cleanly, and the result is exactly that of a run in which the ranks with fewer batches
// trained the missing steps on zero gradients.
#include "torch_catch.h"

#include <torch/torch.h>

#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/optim/factories.h"
#include "mpi_test_util.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

std::shared_ptr<Communicator> shared_comm() {
  return std::shared_ptr<Communicator>(&comm(), [](Communicator*) {});
}

torch::nn::Sequential make_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

int batches_of(int rank) {
  const int counts[] = {10, 12, 15};
  return counts[rank % 3];
}

int most_batches(int n) {
  int m = 0;
  for (int r = 0; r < n; ++r) {
    m = std::max(m, batches_of(r));
  }
  return m;
}

// Plain SGD: a zero gradient leaves a parameter exactly as it is.
OptimFn plain_sgd() {
  optim::SgdFactoryOptions o;
  o.lr = 0.05;
  o.momentum = 0;
  o.weight_decay = 0;
  return optim::sgd(o);
}

DataParallelOptions options() {
  DataParallelOptions o;
  o.topology = comm().size() % 2 == 0 ? "ring" : "complete";
  o.bucket_cap_mb = 256.0 / (1 << 20);  // several buckets
  return o;
}

template <typename Wrapper>
void step(Wrapper& model, int s, bool real) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * comm().rank() + s);
  auto x = at::randn({4, 8}, gen);
  auto loss = torch::mse_loss(model.forward(x), at::randn({4, 4}, gen));
  (real ? loss : loss * 0).backward();
}

std::vector<at::Tensor> params_of(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

template <typename Wrapper>
void check_join(const std::string& what) {
  INFO(what << ", rank " << comm().rank() << " of " << comm().size());
  const int mine = batches_of(comm().rank());
  const int most = most_batches(comm().size());
  std::vector<at::Tensor> expected;
  int64_t expected_updates = 0;
  {
    auto net = make_mlp();
    Wrapper ref(net, options(), plain_sgd(), nullptr, shared_comm());
    for (int s = 0; s < most; ++s) {
      step(ref, s, s < mine);
    }
    ref.synchronize();
    expected = params_of(*net);
    expected_updates = ref.updates();
  }
  auto net = make_mlp();
  Wrapper model(net, options(), plain_sgd(), nullptr, shared_comm());
  model.enable_join();
  for (int s = 0; s < mine; ++s) {
    step(model, s, true);
  }
  model.join();
  CHECK_FALSE(model.join_enabled());
  CHECK(model.shadowed_steps() == most - mine);
  CHECK(model.updates() == expected_updates);
  model.synchronize();
  const auto got = params_of(*net);
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::equal(got[i], expected[i]));
  }
  // Every rank is in step again: a collective of everyone works.
  if constexpr (std::is_same_v<Wrapper, DecentralizedDataParallel<torch::nn::Sequential>>) {
    CHECK(model.consensus_distance() >= 0);
  }
}

}  // namespace

TEST_CASE("uneven inputs under join: gossip", "[join]") {
  check_join<DecentralizedDataParallel<torch::nn::Sequential>>("gossip");
}

TEST_CASE("uneven inputs under join: all-reduce", "[join]") {
  check_join<DistributedDataParallel<torch::nn::Sequential>>("all-reduce");
}

TEST_CASE("join needs enable_join and at least one step", "[join]") {
  auto net = make_mlp();
  DecentralizedDataParallel<torch::nn::Sequential> model(net, options(), plain_sgd(), nullptr,
                                                         shared_comm());
  CHECK_THROWS_WITH(model.join(), Catch::Contains("call enable_join() on every rank"));
  model.enable_join();
  CHECK_THROWS_WITH(model.join(), Catch::Contains("has not trained a single step"));
}
