// Host staging (Note [host staging]) and the choice of backend per device (backend.h), on
// machines without a GPU: the staged communicator serving CPU tensors runs the same copies,
// inner operations and copies back as for CUDA tensors; both wrappers trained through it
// give the direct MPI run's bits.
#include "torch_catch.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "decent_dp/backend.h"
#include "decent_dp/config.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/staged_communicator.h"
#include "decent_dp/topology/topology.h"
#include "mpi_test_util.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

std::shared_ptr<Communicator> shared_comm() {
  return std::shared_ptr<Communicator>(&comm(), [](Communicator*) {});
}

at::Tensor input_of(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return torch::arange(n, torch::kDouble).mul(0.37).add(rank * 1.5).sin().to(dtype);
}

}  // namespace

TEST_CASE("host staging: all-reduce, broadcast and all-gathers equal the inner communicator's",
          "[staged]") {
  const int n = comm().size();
  const int rank = comm().rank();
  HostStagedCommunicator staged(shared_comm(), c10::kCPU);
  CHECK(staged.rank() == rank);
  CHECK(staged.size() == n);
  CHECK(staged.supports(c10::Device(c10::kCPU)));
  CHECK_FALSE(staged.supports(c10::Device(c10::kCUDA, 0)));

  const auto topo = topology::make_topology(n % 2 == 0 ? "ring" : "complete", n, 1);
  staged.make_groups(topo->distinct_groups());
  for (const auto& group : topo->distinct_groups()) {
    if (std::find(group.begin(), group.end(), rank) == group.end() || !staged.has_group(group)) {
      continue;
    }
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      for (auto dtype : {at::kFloat, at::kDouble}) {
        INFO("group " << ranks_to_string(group) << " op " << to_string(op) << " " << dtype);
        // The same kind of buffer as the staged copies (shared memory where it is on), so
        // both take the same transport and summation order.
        auto direct = comm().allocate(1000, torch::TensorOptions().dtype(dtype));
        direct.copy_(input_of(rank, 1000, dtype));
        comm().allreduce(direct, group, op)->wait();
        auto in = input_of(rank, 1000, dtype);
        auto out = torch::zeros_like(in);
        auto work = staged.allreduce(in, out, AllreduceOptions{op, group, {}, "staged test"});
        // The copy back is part of the operation: not complete before the caller waits.
        CHECK_FALSE(work->is_completed());
        CHECK_THAT(work->description(), Catch::Contains("(host-staged)"));
        work->synchronize();
        CHECK(work->is_completed());
        CHECK(torch::equal(out, direct));
        CHECK(torch::equal(in, input_of(rank, 1000, dtype)));  // out of place
        // In place, through a strided view's contiguous copy.
        auto t = input_of(rank, 1000, dtype);
        staged.allreduce(t, group, op)->wait();
        CHECK(torch::equal(t, direct));
      }
    }
  }

  // Host buffers are reused per tensor once waited for, and never shared by two operations
  // in flight: the same input twice before either wait, then again after.
  {
    auto direct = comm().allocate(700, torch::TensorOptions().dtype(torch::kFloat));
    direct.copy_(input_of(rank, 700));
    comm().allreduce(direct, {}, ReduceOp::kSum)->wait();
    auto in = input_of(rank, 700);
    auto out1 = torch::zeros({700});
    auto out2 = torch::zeros({700});
    auto w1 = staged.allreduce(in, out1, AllreduceOptions{ReduceOp::kSum, {}, {}, {}});
    auto w2 = staged.allreduce(in, out2, AllreduceOptions{ReduceOp::kSum, {}, {}, {}});
    w2->wait();
    w1->wait();
    CHECK(torch::equal(out1, direct));
    CHECK(torch::equal(out2, direct));
    for (int again = 0; again < 3; ++again) {
      out1.zero_();
      staged.allreduce(in, out1, AllreduceOptions{ReduceOp::kSum, {}, {}, {}})->wait();
      CHECK(torch::equal(out1, direct));
    }
  }

  auto b = rank == 0 ? input_of(7, 33) : torch::zeros({33});
  staged.broadcast(b, 0)->wait();
  CHECK(torch::equal(b, input_of(7, 33)));

  auto mine = input_of(rank, 10);
  auto gathered = torch::full({10 * n}, -1.0);
  staged.allgather(gathered, mine)->wait();
  for (int r = 0; r < n; ++r) {
    CHECK(torch::equal(gathered.slice(0, 10 * r, 10 * (r + 1)), input_of(r, 10)));
  }

  // Varying lengths: member m sends m + 1 elements of a capacity of n.
  auto part = input_of(rank, rank + 1);
  auto blocks = torch::full({n * n}, -1.0);
  auto lengths = torch::zeros({n}, torch::kLong);
  staged.allgather_varying(blocks, part, lengths, AllgatherOptions{})->wait();
  for (int r = 0; r < n; ++r) {
    CHECK(lengths[r].item<int64_t>() == r + 1);
    CHECK(torch::equal(blocks.slice(0, n * r, n * r + r + 1), input_of(r, r + 1)));
  }
}

TEST_CASE("host staging names tensors of the wrong device and bad arguments", "[staged]") {
  HostStagedCommunicator staged(shared_comm(), c10::kCPU);
  auto meta = torch::empty({4}, torch::TensorOptions().device(torch::kMeta));
  CHECK_THROWS_WITH(staged.allreduce(meta, {}, ReduceOp::kSum),
                    Catch::Contains("allreduce: input is on meta; this host-staged communicator "
                                    "takes CPU tensors"));
  auto a = torch::zeros({4});
  auto b = torch::zeros({5});
  CHECK_THROWS_WITH(staged.allreduce(a, b, {}, ReduceOp::kSum),
                    Catch::Contains("output must match input (4 x Float), got 5 x Float"));
  CHECK_THROWS_WITH(HostStagedCommunicator(nullptr, c10::kCUDA),
                    Catch::Contains("inner must not be null"));
  comm().barrier();
}

TEST_CASE("both wrappers trained through host staging give the direct run's bits", "[staged]") {
  const int n = comm().size();
  const int rank = comm().rank();
  auto make = [] {
    torch::manual_seed(5);
    return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(),
                                 torch::nn::Linear(12, 3));
  };
  auto batch = [rank](int step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + step + 1);
    return std::make_pair(at::randn({5, 6}, gen), at::randn({5, 3}, gen));
  };
  DataParallelOptions options;
  options.topology = n % 2 == 0 ? "ring" : "complete";
  options.bucket_cap_mb = 256.0 / (1 << 20);  // several buckets
  auto factory = optim::adamw();
  auto run = [&](const std::shared_ptr<Communicator>& c, bool gossip) {
    auto net = make();
    auto train = [&](auto& model) {
      for (int step = 0; step < 8; ++step) {
        auto [x, y] = batch(step);
        torch::mse_loss(model.forward(x), y).backward();
      }
      model.synchronize();
    };
    if (gossip) {
      DecentralizedDataParallel<torch::nn::Sequential> model(net, options, factory, nullptr, c);
      train(model);
    } else {
      DistributedDataParallel<torch::nn::Sequential> model(net, options, factory, nullptr, c);
      train(model);
    }
    return net;
  };
  auto staged = std::make_shared<HostStagedCommunicator>(shared_comm(), c10::kCPU);
  for (bool gossip : {true, false}) {
    INFO("rank " << rank << (gossip ? " gossip" : " all-reduce"));
    auto direct = run(shared_comm(), gossip);
    auto through = run(staged, gossip);
    auto p = direct->parameters();
    auto q = through->parameters();
    REQUIRE(p.size() == q.size());
    for (size_t k = 0; k < p.size(); ++k) {
      CHECK(torch::equal(p[k], q[k]));
    }
  }
}

TEST_CASE("the backend of a device: CPU is the control communicator, others are named",
          "[staged]") {
  auto control = shared_comm();
  CHECK(communicator_for_device(c10::Device(c10::kCPU), control) == control);
  CHECK(has_nccl_backend() == (DECENT_DP_HAVE_NCCL != 0));
  CHECK_THROWS_WITH(communicator_for_device(c10::Device(c10::kMeta), control),
                    Catch::Contains("no communication backend for tensors on meta"));
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  if (gpus == 0) {
    CHECK(local_device(*control) == c10::Device(c10::kCPU));
    CHECK_THROWS_WITH(communicator_for_device(c10::Device(c10::kCUDA, 0), control),
                      Catch::Contains("cuda:0 was asked for, but rank " +
                                      std::to_string(comm().rank()) + " sees 0 CUDA devices"));
  } else {
    CHECK(local_device(*control) ==
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(comm().local_rank() % gpus)));
    CHECK_THROWS_WITH(communicator_for_device(c10::Device(c10::kCUDA, gpus), control),
                      Catch::Contains(" sees " + std::to_string(gpus) + " CUDA devices"));
  }
  CHECK_THROWS_WITH(communicator_for_device(c10::Device(c10::kCUDA), control),
                    Catch::Contains("name the CUDA device (e.g. cuda:0), got cuda"));
  comm().barrier();
}

TEST_CASE("ranks sharing a GPU are found from every rank's host and device", "[staged]") {
  CHECK(decent_dp::detail::first_shared_device({}) == std::make_pair(-1, -1));
  CHECK(decent_dp::detail::first_shared_device({"a#0", "a#1", "b#0", "b#1"}) ==
        std::make_pair(-1, -1));
  CHECK(decent_dp::detail::first_shared_device({"a#0", "a#1", "b#1", "a#1"}) ==
        std::make_pair(1, 3));
  const int n = comm().size();
  const int rank = comm().rank();
  // One device per rank: nobody shares. Device 0 everywhere: ranks 0 and 1 do (one host).
  const auto own = decent_dp::detail::rank_devices(comm(), rank);
  REQUIRE(static_cast<int>(own.size()) == n);
  for (int r = 0; r < n; ++r) {
    CHECK(own[r].substr(own[r].find('#')) == "#" + std::to_string(r));
    CHECK(own[r].substr(0, own[r].find('#')) == own[0].substr(0, own[0].find('#')));
  }
  CHECK(decent_dp::detail::first_shared_device(own) == std::make_pair(-1, -1));
  const auto same = decent_dp::detail::rank_devices(comm(), 0);
  CHECK(decent_dp::detail::first_shared_device(same) ==
        (n >= 2 ? std::make_pair(0, 1) : std::make_pair(-1, -1)));
}
