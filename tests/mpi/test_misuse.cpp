// Misuse that used to be silent (the wrapper trained nothing, or undid the user's write, or
// accepted a broken optimizer factory): each is an error now, or kept where it can be.
#include "torch_catch.h"

#include <torch/torch.h>

#include <functional>
#include <limits>

#include "decent_dp/decent_optim_wrapper.h"
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
  torch::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

DataParallelOptions small(const std::string& topology = "complete") {
  DataParallelOptions o;
  o.topology = topology;
  o.bucket_cap_mb = 256.0 / (1 << 20);  // several buckets
  return o;
}

template <typename Wrapper>
void step(Wrapper& model, int s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * comm().rank() + s);
  auto x = at::randn({4, 8}, gen);
  torch::mse_loss(model.forward(x), at::zeros({4, 4})).backward();
}

using Gossip = DecentralizedDataParallel<torch::nn::Sequential>;
using AllReduce = DistributedDataParallel<torch::nn::Sequential>;

}  // namespace

TEST_CASE("a backward through the wrapped module's own forward is an error", "[misuse]") {
  auto net = make_mlp();
  Gossip model(net, small(), optim::adamw(), nullptr, shared_comm());
  auto x = at::randn({4, 8});
  // Before any step: the wrapper would never have trained.
  CHECK_THROWS_WITH(torch::mse_loss(net->forward(x), at::zeros({4, 4})).backward(),
                    Catch::Contains("arrived with no forward() of the wrapper") &&
                        Catch::Contains("the wrapped module's own forward()"));
  step(model, 0);
  step(model, 1);
  CHECK_THROWS_WITH(torch::mse_loss(net->forward(x), at::zeros({4, 4})).backward(),
                    Catch::Contains("DecentralizedDataParallel") &&
                        Catch::Contains("wrapped module's own forward()"));
  step(model, 2);  // training goes on
  CHECK(model.updates() == 3);
  // Eval mode and accumulation are not errors.
  model.train(false);
  torch::mse_loss(net->forward(x), at::zeros({4, 4})).backward();
  model.train(true);
  for (auto& p : net->parameters()) {
    p.mutable_grad() = at::Tensor();
  }
}

TEST_CASE("an in-place write between gossip steps is refused, kept under all-reduce", "[misuse]") {
  SECTION("gossip: refused while the exchange is in flight") {
    if (comm().size() == 1) {
      return;  // no exchange, nothing to undo a write
    }
    auto net = make_mlp();
    Gossip model(net, small(), optim::adamw(), nullptr, shared_comm());
    step(model, 0);
    step(model, 1);
    {
      torch::NoGradGuard no_grad;
      net->parameters()[0].clamp_(-0.01, 0.01);  // weight clipping
    }
    auto x = at::randn({4, 8});
    CHECK_THROWS_WITH(model.forward(x), Catch::Contains("was written in place after update 2") &&
                                            Catch::Contains("global_avg(false)"));
    // The way out it names: settle the exchanges, then write.
    model.global_avg(/*will_revert=*/false);
    {
      torch::NoGradGuard no_grad;
      net->parameters()[0].clamp_(-0.01, 0.01);
    }
    CHECK_NOTHROW(step(model, 2));
    CHECK(net->parameters()[0].detach().abs().max().item<double>() < 0.05);
  }
  SECTION("all-reduce: nothing is in flight between steps, the write is kept") {
    auto net = make_mlp();
    optim::SgdFactoryOptions sgd;
    sgd.lr = 1e-30;  // the update leaves the values unchanged
    sgd.weight_decay = 0;
    AllReduce model(net, small(), optim::sgd(sgd), nullptr, shared_comm());
    step(model, 0);
    {
      torch::NoGradGuard no_grad;
      net->parameters()[0].fill_(0.25);
    }
    step(model, 1);
    CHECK(torch::equal(net->parameters()[0].detach(),
                       at::full_like(net->parameters()[0].detach(), 0.25)));
  }
  SECTION("DecentOptimWrapper: refused at the next step()") {
    auto net = make_mlp();
    auto inner =
        std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
    DecentOptimWrapper opt(inner, comm().rank(), comm().size(), 1, "complete", 25, shared_comm());
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      torch::mse_loss(net->forward(at::randn({4, 8})), at::zeros({4, 4})).backward();
      if (s == 1 && comm().size() > 1) {
        torch::NoGradGuard no_grad;
        net->parameters()[1].mul_(0.5);
        CHECK_THROWS_WITH(opt.step(), Catch::Contains("DecentOptimWrapper: parameter") &&
                                          Catch::Contains("was written in place"));
      } else {
        opt.step();
      }
    }
  }
}

TEST_CASE("parameters re-pointed after the first backward are an error", "[misuse]") {
  auto net = make_mlp();
  Gossip model(net, small(), optim::adamw(), nullptr, shared_comm());
  step(model, 0);
  {
    torch::NoGradGuard no_grad;
    net->parameters()[2].set_data(net->parameters()[2].detach().clone());  // as torch::load does
  }
  CHECK_THROWS_WITH(
      model.forward(at::randn({4, 8})),
      Catch::Contains("no longer lives in its bucket's memory") && Catch::Contains("load()"));
}

TEST_CASE("an optimizer factory that lists a parameter twice and omits another is refused",
          "[misuse]") {
  auto net = make_mlp();
  OptimFn twice = [](const NamedParams& params) -> std::unique_ptr<torch::optim::Optimizer> {
    std::vector<at::Tensor> list;
    for (size_t i = 0; i < params.size(); ++i) {
      list.push_back(params[0].second);  // the first one, again and again
    }
    return std::make_unique<torch::optim::SGD>(list, torch::optim::SGDOptions(0.1));
  };
  DataParallelOptions o = small();
  o.bucket_cap_mb = 1;  // one bucket holding every parameter
  Gossip model(net, o, twice, nullptr, shared_comm());
  CHECK_THROWS_WITH(step(model, 0), Catch::Contains("twice") && Catch::Contains("exactly once"));
}

TEST_CASE("a sparse gradient is refused by name, by both wrappers", "[misuse]") {
  // An Embedding built with sparse(true): its gradient is a sparse tensor, which the
  // all-reduce used to meet as ATen's "copy_() between dense and sparse" mid-backward.
  auto make = [] {
    torch::manual_seed(2);
    return torch::nn::Sequential(
        torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 8).sparse(true)), torch::nn::Flatten(),
        torch::nn::Linear(16, 4));
  };
  auto ids = at::arange(8).remainder(10).view({4, 2});
  auto check = [&](auto& model) {
    CHECK_THROWS_WITH(
        torch::mse_loss(model.forward(ids), at::zeros({4, 4})).backward(),
        Catch::Contains("parameter '0.weight' received a gradient of layout Sparse") &&
            Catch::Contains("sparse(false)"));
  };
  auto a = make();
  Gossip gossip(a, small(), optim::sgd(), nullptr, shared_comm());
  check(gossip);
  auto b = make();
  AllReduce allreduce(b, small(), optim::sgd(), nullptr, shared_comm());
  check(allreduce);
}

TEST_CASE("an unbounded bucket cap means one bucket", "[misuse]") {
  for (double cap : {std::numeric_limits<double>::infinity(), 1e13, 1e300}) {
    INFO("bucket_cap_mb " << cap);
    auto net = make_mlp();
    DataParallelOptions o = small();
    o.bucket_cap_mb = cap;
    Gossip model(net, o, optim::adamw(), nullptr, shared_comm());
    step(model, 0);
    CHECK(model.bucket_count() == 1);
  }
  auto net = make_mlp();
  DataParallelOptions o = small();
  o.bucket_cap_mb = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(Gossip(net, o, optim::adamw(), nullptr, shared_comm()), InvalidArgument);
}

TEST_CASE("a broadcast of another size than the root's is an error on every rank", "[misuse]") {
  if (comm().size() < 2) {
    return;
  }
  const int rank = comm().rank();
  at::Tensor t = at::zeros({rank == 1 ? 5 : 4}, at::kFloat);
  try {
    comm().broadcast(t, 0)->wait();
    FAIL("a broadcast of mismatched sizes returned");
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    INFO(what);
    if (rank == 1) {
      CHECK(what.find("rank 1 (this rank) runs broadcast(5 x Float, root 0), rank 0 runs "
                      "broadcast(4 x Float, root 0)") != std::string::npos);
    } else {
      CHECK(what.find("rank " + std::to_string(rank) +
                      " (this rank) runs broadcast(4 x Float, root 0), rank 1 runs "
                      "broadcast(5 x Float, root 0)") != std::string::npos);
    }
  }
  // The communicator is still usable.
  at::Tensor ok = at::full({3}, static_cast<float>(rank), at::kFloat);
  comm().broadcast(ok, 0)->wait();
  CHECK(ok[2].item<float>() == 0.0f);
}

namespace {

// Runs `mine` on this rank, expects an InvalidArgument naming the mismatch on every rank,
// then checks the communicator still reduces correctly.
void expect_mismatch(const std::function<void()>& mine, const std::string& expected) {
  try {
    mine();
    FAIL("mismatched collectives returned");
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("mismatched operations on group [") != std::string::npos);
    CHECK(what.find("rank " + std::to_string(comm().rank()) + " (this rank) runs ") !=
          std::string::npos);
    CHECK(what.find(expected) != std::string::npos);
  }
  at::Tensor ok = at::full({5}, 1.0f, at::kFloat);
  comm().allreduce(ok, {}, ReduceOp::kSum)->wait();
  CHECK(ok[4].item<float>() == static_cast<float>(comm().size()));
}

}  // namespace

TEST_CASE("mismatched collectives are one error on every member, not silent pairing", "[misuse]") {
  const int n = comm().size();
  const int rank = comm().rank();
  if (n < 2) {
    return;
  }
  for (bool shared : {true, false}) {
    INFO("rank " << rank << (shared ? " shared-memory buffers" : " private buffers"));
    auto buffer = [shared](int64_t numel) {
      return shared ? comm().allocate(numel, at::TensorOptions().dtype(at::kFloat))
                    : at::zeros({numel}, at::kFloat);
    };
    // Equal sizes, different purposes: rank 0's global average against the others'
    // exchange. Without the header they would sum each other's bytes.
    at::Tensor x = buffer(4096);
    const std::string label = rank == 0 ? "global average" : "bucket 0, exchange of update 3";
    expect_mismatch(
        [&] {
          comm().allreduce(x, x, AllreduceOptions{ReduceOp::kAvg, {}, {}, label})->wait();
        },
        rank == 0 ? "runs allreduce(avg, 4096 x Float, bucket 0, exchange of update 3)"
                  : "rank 0 runs allreduce(avg, 4096 x Float, global average)");
    // Sum against average.
    expect_mismatch(
        [&] { comm().allreduce(x, {}, rank == 1 ? ReduceOp::kAvg : ReduceOp::kSum)->wait(); },
        rank == 1 ? "runs allreduce(sum, 4096 x Float)"
                  : "rank 1 runs allreduce(avg, 4096 x Float)");
    // Different sizes, large enough for Open MPI's single-copy path: refused before any
    // payload is posted (a truncated single-copy receive overruns its buffer).
    at::Tensor y = buffer(rank == 1 ? 65536 : 16384);
    expect_mismatch([&] { comm().allreduce(y, {}, ReduceOp::kSum)->wait(); },
                    rank == 1 ? "runs allreduce(sum, 16384 x Float)"
                              : "rank 1 runs allreduce(sum, 65536 x Float)");
    // An all-reduce against an all-gather whose input has the same size.
    at::Tensor gathered = buffer(4096 * n);
    expect_mismatch(
        [&] {
          if (rank == 0) {
            comm().allgather(gathered, x)->wait();
          } else {
            comm().allreduce(x, {}, ReduceOp::kSum)->wait();
          }
        },
        rank == 0 ? "runs allreduce(sum, 4096 x Float)" : "rank 0 runs allgather(4096 x Float)");
    // An all-gather of another block size.
    at::Tensor block = buffer(rank == 1 ? 8 : 4);
    at::Tensor out = buffer(block.numel() * n);
    expect_mismatch([&] { comm().allgather(out, block)->wait(); },
                    rank == 1 ? "runs allgather(4 x Float)" : "rank 1 runs allgather(8 x Float)");
  }
}
