#include "torch_catch.h"

#include <torch/torch.h>

#include "decent_dp/decent_optim_wrapper.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "mpi_test_util.h"
#include "observing_sgd.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

std::shared_ptr<Communicator> shared_comm() {
  return std::shared_ptr<Communicator>(&comm(), [](Communicator*) {});
}

torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(),
                               torch::nn::Linear(12, 3));
}

at::Tensor loss_on(torch::nn::Sequential& net, int rank, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 * rank + step + 7);
  auto x = at::randn({5, 6}, gen);
  auto y = at::randn({5, 3}, gen);
  return torch::mse_loss(net->forward(x), y);
}

using MakeOptimizer =
    std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

bool power_of_two(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// A registered topology of period 2 whose weights are not uniform: slot 0 pairs (2i, 2i+1)
// with self weight 0.7 (a last rank alone when n is odd), slot 1 the whole world with self
// weight 0.4.
const std::string& weighted_topology() {
  static const std::string name = [] {
    topology::register_topology("test-weighted-pairs", topology::SlotsFn([](int n, int) {
                                  std::vector<topology::Slot> slots(2);
                                  for (int r = 0; r < n; r += 2) {
                                    if (r + 1 < n)
                                      slots[0].push_back({{r, r + 1}, 0.7});
                                    else
                                      slots[0].push_back({{r}, 1.0});
                                  }
                                  std::vector<int> all(n);
                                  for (int r = 0; r < n; ++r)
                                    all[r] = r;
                                  slots[1].push_back({all, n > 1 ? 0.4 : 1.0});
                                  return slots;
                                }));
    return std::string("test-weighted-pairs");
  }();
  return name;
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const double ref = b.norm().item<double>();
  return ref == 0 ? (a - b).norm().item<double>() : (a - b).norm().item<double>() / ref;
}

}  // namespace

TEST_CASE("the optimizer wrapper follows the recursion of spec section 10", "[wrapper]") {
  const int n = comm().size();
  const int rank = comm().rank();
  std::vector<std::string> topologies = {"complete", weighted_topology()};
  if (n % 2 == 0 || n == 1)
    topologies.push_back("ring");
  if (power_of_two(n))
    topologies.push_back("exp");
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"SGD",
       [](std::vector<at::Tensor> p) {
         return std::make_shared<torch::optim::SGD>(p,
                                                    torch::optim::SGDOptions(0.05).momentum(0.9));
       }},
      {"Adam", [](std::vector<at::Tensor> p) {
         return std::make_shared<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
       }}};
  for (const auto& name : topologies) {
    for (const auto& [opt_name, make_opt] : optimizers) {
      INFO("rank " << rank << " topology " << name << " optimizer " << opt_name);
      auto net = make_net();
      DecentOptimWrapper opt(make_opt(net->parameters()), rank, n, 1, name, 1e-4, shared_comm());
      for (int step = 0; step < 20; ++step) {
        opt.zero_grad();
        loss_on(net, rank, step).backward();
        opt.step();
      }
      // The recursion, all replicas in one process (0-based step t is update u = t + 1):
      // before update u > 1, mix exchange u-1, which ran on slot (u-1) mod P over the values
      // sent after update u-1, x_i <- w x_i + (1-w)/(k-1) sum_{j != i} x_j; take the inner step
      // with the gradient computed before the mixing; send the result.
      auto topo = topology::make_topology(name, n, 1);
      std::vector<torch::nn::Sequential> nets;
      std::vector<std::shared_ptr<torch::optim::Optimizer>> opts;
      for (int r = 0; r < n; ++r) {
        nets.push_back(make_net());
        opts.push_back(make_opt(nets.back()->parameters()));
      }
      std::vector<std::vector<at::Tensor>> sent(n);
      for (int step = 0; step < 20; ++step) {
        for (int r = 0; r < n; ++r) {
          opts[r]->zero_grad();
          loss_on(nets[r], r, step).backward();
        }
        torch::NoGradGuard no_grad;
        for (int r = 0; r < n && step > 0; ++r) {
          const auto& group = topo->group_of(r, step);  // slot of exchange u-1 = step
          const double w = group.self_weight;
          const double k = group.size();
          auto params = nets[r]->parameters();
          for (size_t p = 0; p < params.size(); ++p) {
            at::Tensor mixed = sent[r][p] * w;
            for (int j : group.ranks)
              if (j != r)
                mixed += sent[j][p] * ((1 - w) / (k - 1));
            params[p].copy_(mixed);
          }
        }
        for (int r = 0; r < n; ++r) {
          opts[r]->step();
          sent[r].clear();
          for (const auto& p : nets[r]->parameters())
            sent[r].push_back(p.detach().clone());
        }
      }
      auto mine = net->parameters();
      auto ref = nets[rank]->parameters();
      for (size_t k = 0; k < mine.size(); ++k) {
        CHECK(relative_error(mine[k], ref[k]) <= 1e-5);
      }
      CHECK(opt.step_count() == 20);
      CHECK(opt.bucket_count() > 1);  // 1e-4 MiB cap: several buckets
    }
  }
}

TEST_CASE("both gossip APIs train identically", "[wrapper]") {
  // The same model, data and plain SGD through DecentralizedDataParallel and through
  // DecentOptimWrapper: one slot rule (exchange u on slot u mod P) and one mixing rule (the
  // slot's self weight), so the parameters agree up to float rounding.
  const int n = comm().size();
  const int rank = comm().rank();
  std::vector<std::string> topologies = {weighted_topology(), "complete"};
  if (power_of_two(n))
    topologies.push_back("exp");
  for (const auto& name : topologies) {
    INFO("rank " << rank << " topology " << name);
    auto a = make_net();
    DataParallelOptions options;
    options.topology = name;
    options.local_world_size = 1;
    options.bucket_cap_mb = 1e-4;
    OptimFn sgd = [](const NamedParams& named) -> std::unique_ptr<torch::optim::Optimizer> {
      std::vector<at::Tensor> params;
      for (const auto& [n, p] : named)
        params.push_back(p);
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05));
    };
    DecentralizedDataParallel<torch::nn::Sequential> model(a, options, sgd, nullptr, shared_comm());
    auto b = make_net();
    DecentOptimWrapper opt(
        std::make_shared<torch::optim::SGD>(b->parameters(), torch::optim::SGDOptions(0.05)), rank,
        n, 1, name, 1e-4, shared_comm());
    for (int step = 0; step < 12; ++step) {
      {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(500 * rank + step + 7);
        auto x = at::randn({5, 6}, gen);
        auto y = at::randn({5, 3}, gen);
        torch::mse_loss(model.forward(x), y).backward();
      }
      opt.zero_grad();
      loss_on(b, rank, step).backward();
      opt.step();
    }
    CHECK(model.updates() == 12);
    CHECK(opt.step_count() == 12);
    // Both have exchange 12 in flight; compare the parameters after update 12.
    model.synchronize();
    auto pa = a->parameters();
    auto pb = b->parameters();
    REQUIRE(pa.size() == pb.size());
    for (size_t k = 0; k < pa.size(); ++k) {
      INFO("parameter " << k);
      CHECK(relative_error(pa[k], pb[k]) <= 1e-5);
    }
  }
}

TEST_CASE("the wrapped optimizer's pre-mixing hook is called in every bucket before mixing",
          "[wrapper][premix]") {
  const int n = comm().size();
  const int rank = comm().rank();
  const int steps = 6;
  // The weighted topology's self weights are not 1/k, so mixing lerps.
  for (const std::string& name : {std::string("complete"), weighted_topology()}) {
    INFO("rank " << rank << " topology " << name);
    auto net = make_net();
    auto inner = std::make_shared<testing::ObservingSgd>(net->parameters(), 0.05);
    DecentOptimWrapper opt(inner, rank, n, 1, name, 1e-4, shared_comm());
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      loss_on(net, rank, step).backward();
      opt.step();
    }
    REQUIRE(opt.bucket_count() > 1);
    testing::check_observations(inner->seen, opt.topology(), opt.bucket_count(), steps, 1.0,
                                /*gather=*/false);
    // The hook only read: the same parameters as the same SGD without it, bit for bit.
    auto plain_net = make_net();
    DecentOptimWrapper plain(std::make_shared<torch::optim::SGD>(plain_net->parameters(),
                                                                 torch::optim::SGDOptions(0.05)),
                             rank, n, 1, name, 1e-4, shared_comm());
    for (int step = 0; step < steps; ++step) {
      plain.zero_grad();
      loss_on(plain_net, rank, step).backward();
      plain.step();
    }
    auto p1 = net->parameters();
    auto p2 = plain_net->parameters();
    for (size_t k = 0; k < p1.size(); ++k)
      CHECK(torch::equal(p1[k], p2[k]));
  }
}

TEST_CASE("optimizer wrapper: global_avg, revert, schedulers", "[wrapper]") {
  const int n = comm().size();
  const int rank = comm().rank();
  const std::string name = n % 2 == 0 ? "ring" : "complete";
  auto flat = [](torch::nn::Sequential& net) {
    std::vector<at::Tensor> v;
    for (auto& p : net->parameters())
      v.push_back(p.detach().flatten());
    return torch::cat(v);
  };
  auto train = [&](torch::nn::Sequential& net, DecentOptimWrapper& opt, int from, int to) {
    for (int step = from; step < to; ++step) {
      opt.zero_grad();
      loss_on(net, rank, step).backward();
      opt.step();
    }
  };
  auto ref_net = make_net();
  DecentOptimWrapper ref(
      std::make_shared<torch::optim::Adam>(ref_net->parameters(), torch::optim::AdamOptions(1e-2)),
      rank, n, 1, name, 25, shared_comm());
  train(ref_net, ref, 0, 10);
  auto net = make_net();
  DecentOptimWrapper opt(
      std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2)),
      rank, n, 1, name, 25, shared_comm());
  train(net, opt, 0, 5);
  const auto local = flat(net).clone();
  opt.global_avg(/*may_revert=*/true);
  auto gathered = torch::empty({local.numel() * n});
  comm().allgather(gathered, flat(net).contiguous())->wait();
  for (int r = 0; r < n; ++r) {
    CHECK(torch::equal(gathered.view({n, local.numel()})[r], flat(net)));
  }
  opt.revert_global_avg();
  CHECK(torch::equal(flat(net), local));
  train(net, opt, 5, 10);
  CHECK(torch::equal(flat(net), flat(ref_net)));  // bit for bit as without the call
  CHECK_THROWS_WITH(opt.revert_global_avg(), Catch::Contains("no backup to restore"));
  // Without revert, training continues from the mean: a step with zero gradients under
  // plain SGD leaves the mean in place (an exchange still in flight would have replaced it).
  auto net3 = make_net();
  DecentOptimWrapper opt3(
      std::make_shared<torch::optim::SGD>(net3->parameters(), torch::optim::SGDOptions(0.1)), rank,
      n, 1, name, 25, shared_comm());
  train(net3, opt3, 0, 3);
  opt3.global_avg(/*may_revert=*/false);
  const auto mean = flat(net3).clone();
  opt3.zero_grad(/*set_to_none=*/false);
  opt3.step();
  CHECK(torch::equal(flat(net3), mean));
  CHECK(opt3.step_count() == 4);

  // A scheduler attached to the wrapper drives the inner optimizer's learning rate.
  auto net2 = make_net();
  auto inner =
      std::make_shared<torch::optim::SGD>(net2->parameters(), torch::optim::SGDOptions(0.1));
  DecentOptimWrapper opt2(inner, rank, n, 1, name, 25, shared_comm());
  torch::optim::StepLR sched(opt2, /*step_size=*/2, /*gamma=*/0.5);
  for (int step = 0; step < 4; ++step) {
    opt2.zero_grad();
    loss_on(net2, rank, step).backward();
    opt2.step();
    sched.step();
  }
  opt2.zero_grad();
  loss_on(net2, rank, 4).backward();
  opt2.step();
  // The same schedule on a plain optimizer.
  auto plain_param = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD plain(std::vector<at::Tensor>{plain_param}, torch::optim::SGDOptions(0.1));
  torch::optim::StepLR plain_sched(plain, 2, 0.5);
  for (int step = 0; step < 4; ++step)
    plain_sched.step();
  CHECK(inner->param_groups()[0].options().get_lr() == plain.param_groups()[0].options().get_lr());
  CHECK(inner->param_groups()[0].options().get_lr() < 0.1);
}

TEST_CASE("optimizer wrapper misuse", "[wrapper]") {
  const int n = comm().size();
  const int rank = comm().rank();
  auto net = make_net();
  auto sgd = [&] {
    return std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  };
  if (n % 2 == 1 && n > 1) {
    CHECK_THROWS_WITH(DecentOptimWrapper(sgd(), rank, n, 1, "ring", 25, shared_comm()),
                      Catch::Contains("ring topology needs an even world size"));
  }
  CHECK_THROWS_WITH(
      DecentOptimWrapper(std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{},
                                                             torch::optim::SGDOptions(0.1)),
                         rank, n, 1, "complete", 25, shared_comm()),
      Catch::Contains("the optimizer has no parameters"));
  CHECK_THROWS_WITH(DecentOptimWrapper(sgd(), rank + 1, n, 1, "complete", 25, shared_comm()),
                    Catch::Contains("do not match the communicator"));
  // A tensor listed twice (tied weights as module->parameters() lists them): refused by name.
  auto w = net->parameters()[0];
  auto twice = std::make_shared<torch::optim::SGD>(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup(net->parameters()),
          torch::optim::OptimizerParamGroup(std::vector<at::Tensor>{w})},
      torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH(
      DecentOptimWrapper(twice, rank, n, 1, "complete", 25, shared_comm()),
      Catch::Contains("lists one tensor twice (group 0 parameter 0 and group 1 parameter 0)"));
  DecentOptimWrapper opt(sgd(), rank, n, 1, "complete", 25, shared_comm());
  CHECK_THROWS_WITH(opt.step([] { return torch::zeros({}); }),
                    Catch::Contains("closures are not supported"));
}
