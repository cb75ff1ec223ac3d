// Host staging (Note [host staging]) and the choice of backend per device (backend.h), on
// machines without a GPU: the staged communicator serving CPU tensors runs the same copies,
// inner operations and copies back as for CUDA tensors; both wrappers trained through it
// give the direct MPI run's bits. Models on several devices (Note [routed communicator]):
// each operation reaches its device's communicator (a recording one standing in for the
// second device, on meta tensors), and the wrappers pick a communicator per device.
#include "torch_catch.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include <numeric>

#include "decent_dp/backend.h"
#include "decent_dp/config.h"
#include "decent_dp/decent_optim_wrapper.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/quantize_codec.h"
#include "decent_dp/routed_communicator.h"
#include "decent_dp/staged_communicator.h"
#include "decent_dp/topology/topology.h"
#include "mpi_test_util.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

std::shared_ptr<Communicator> shared_comm() {
  return std::shared_ptr<Communicator>(&comm(), [](Communicator*) {});
}

// Stands in for a second device's communicator: takes meta tensors (no data), records each
// operation and returns it finished.
class RecordingCommunicator final : public Communicator {
 public:
  explicit RecordingCommunicator(int size_offset = 0) : size_offset_(size_offset) {}
  Backend backend() const override { return Backend::kNccl; }
  int rank() const override { return comm().rank(); }
  int size() const override { return comm().size() + size_offset_; }
  int local_rank() const override { return comm().local_rank(); }
  int local_size() const override { return comm().local_size(); }
  void make_groups(const std::vector<std::vector<int>>& groups) override {
    calls.push_back("make_groups " + std::to_string(groups.size()));
    for (const auto& g : groups) {
      groups_.push_back(g);
    }
  }
  bool has_group(const std::vector<int>& ranks) const override {
    return std::find(groups_.begin(), groups_.end(), ranks) != groups_.end();
  }
  std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                  const AllreduceOptions& options) override {
    return record("allreduce " + options.label, {input, output});
  }
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) override {
    return record("broadcast from " + std::to_string(root), {tensor});
  }
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                  const AllgatherOptions& options) override {
    return record("allgather " + options.label, {output, input});
  }
  std::shared_ptr<Work> allgather_varying(const at::Tensor& output, const at::Tensor& input,
                                          const at::Tensor& lengths,
                                          const AllgatherOptions& options) override {
    return record("allgather_varying " + options.label, {output, input, lengths});
  }
  void barrier() override { calls.push_back("barrier"); }
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options) override {
    calls.push_back("allocate " + std::to_string(numel));
    return at::empty({numel}, options);
  }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(1000); }
  bool supports(const c10::Device& device) const override { return device.is_meta(); }

  std::vector<std::string> calls;

 private:
  std::shared_ptr<Work> record(const std::string& what, std::vector<at::Tensor> tensors) {
    calls.push_back(what);
    auto work = std::make_shared<Work>(what, std::move(tensors), timeout());
    work->finish();
    return work;
  }
  int size_offset_;
  std::vector<std::vector<int>> groups_;
};

at::Tensor meta(int64_t n) {
  return at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
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

TEST_CASE("routed communicator: each operation reaches its device's communicator", "[routed]") {
  const int n = comm().size();
  const int rank = comm().rank();
  const c10::Device cpu(c10::kCPU);
  const c10::Device on_meta(c10::kMeta);
  auto second = std::make_shared<RecordingCommunicator>();
  RoutedCommunicator routed(shared_comm(), {{cpu, shared_comm()}, {on_meta, second}});
  CHECK(routed.rank() == rank);
  CHECK(routed.size() == n);
  CHECK(routed.supports(cpu));
  CHECK(routed.supports(c10::Device(c10::kCPU, 0)));  // the CPU is one route
  CHECK(routed.supports(on_meta));
  CHECK_FALSE(routed.supports(c10::Device(c10::kCUDA, 0)));
  CHECK(routed.find(cpu) == &comm());
  CHECK(routed.find(on_meta) == second.get());
  CHECK(routed.describe() == "cpu: mpi, meta: nccl");
  CHECK(routed.backend() == Backend::kMpi);

  // Groups: every route makes them, and a group is there when every route has it.
  const auto topo = topology::make_topology(n % 2 == 0 ? "ring" : "complete", n, 1);
  routed.make_groups(topo->distinct_groups());
  REQUIRE(second->calls.size() == 1);
  CHECK(second->calls[0] == "make_groups " + std::to_string(topo->distinct_groups().size()));
  for (const auto& g : topo->distinct_groups()) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) {
      CHECK(routed.has_group(g) == comm().has_group(g));
    }
  }
  std::vector<int> everyone(n);
  std::iota(everyone.begin(), everyone.end(), 0);
  if (!second->has_group(everyone)) {
    CHECK_FALSE(routed.has_group(everyone));  // MPI has the world; the second route does not
  }

  // CPU tensors take the MPI route, and its results; meta tensors the recording one.
  auto direct = input_of(rank, 300);
  comm().allreduce(direct, {}, ReduceOp::kAvg)->wait();
  auto t = input_of(rank, 300);
  routed.allreduce(t, t, AllreduceOptions{ReduceOp::kAvg, {}, {}, "cpu mean"})->wait();
  CHECK(torch::equal(t, direct));
  auto b = input_of(rank, 50);
  routed.broadcast(b, 0)->wait();
  CHECK(torch::equal(b, input_of(0, 50)));
  auto gathered = torch::zeros({50 * n});
  routed.allgather(gathered, input_of(rank, 50))->wait();
  for (int r = 0; r < n; ++r) {
    CHECK(torch::equal(gathered.narrow(0, 50 * r, 50), input_of(r, 50)));
  }
  CHECK(routed.allocate(70, at::TensorOptions().dtype(at::kFloat)).numel() == 70);
  CHECK(second->calls.size() == 1);  // none of that went to the second route

  auto m = meta(64);
  routed.allreduce(m, m, AllreduceOptions{ReduceOp::kAvg, {}, {}, "bucket 1"})->wait();
  routed.broadcast(m, 0)->wait();
  routed.allgather(meta(64 * n), m, AllgatherOptions{{}, {}, "gather"})->wait();
  routed
      .allgather_varying(meta(64 * n), m, at::zeros({n}, at::kLong),
                         AllgatherOptions{{}, {}, "varying"})
      ->wait();
  auto block = routed.allocate(64, at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
  CHECK(block.is_meta());
  CHECK(second->calls ==
        std::vector<std::string>{"make_groups " + std::to_string(topo->distinct_groups().size()),
                                 "allreduce bucket 1", "broadcast from 0", "allgather gather",
                                 "allgather_varying varying", "allocate 64"});
  routed.barrier();  // the control communicator's
  CHECK(second->calls.back() == "allocate 64");

  // One device per operation; devices without a route are named with the routes.
  CHECK_THROWS_WITH(routed.allreduce(input_of(rank, 64), m, AllreduceOptions{}),
                    Catch::Contains("allreduce: output is on meta and the input on cpu; an "
                                    "operation's tensors must be on one device"));
  CHECK_THROWS_WITH(routed.allgather(torch::zeros({64 * n}), m, AllgatherOptions{}),
                    Catch::Contains("allgather: output is on cpu and the input on meta"));
  RoutedCommunicator meta_only(shared_comm(), {{on_meta, second}});
  CHECK_THROWS_WITH(meta_only.allreduce(input_of(rank, 8), {}, ReduceOp::kSum),
                    Catch::Contains("allreduce: input is on cpu; this communicator routes "
                                    "tensors on meta: nccl (one of those devices was expected)"));
  CHECK_THROWS_WITH(meta_only.broadcast(input_of(rank, 8), 0),
                    Catch::Contains("broadcast: tensor is on cpu"));
  CHECK_THROWS_WITH(meta_only.allocate(8, at::TensorOptions()),
                    Catch::Contains("allocate: the tensor is on cpu"));
  CHECK_THROWS_WITH(routed.allreduce(at::Tensor(), {}, ReduceOp::kSum),
                    Catch::Contains("allreduce: input must be defined"));
  comm().barrier();
}

TEST_CASE("routed communicator: routes that cannot serve are refused, named", "[routed]") {
  const c10::Device cpu(c10::kCPU);
  auto second = std::make_shared<RecordingCommunicator>();
  using Routes = std::vector<RoutedCommunicator::Route>;
  CHECK_THROWS_WITH(RoutedCommunicator(shared_comm(), Routes{}),
                    Catch::Contains("routes must name at least one device"));
  CHECK_THROWS_WITH(RoutedCommunicator(nullptr, Routes{{cpu, shared_comm()}}),
                    Catch::Contains("control must not be null"));
  CHECK_THROWS_WITH(RoutedCommunicator(shared_comm(), Routes{{cpu, nullptr}}),
                    Catch::Contains("the communicator of route 0 (cpu) must not be null"));
  CHECK_THROWS_WITH(
      RoutedCommunicator(shared_comm(), Routes{{cpu, shared_comm()}, {cpu, shared_comm()}}),
      Catch::Contains("routes 0 and 1 are both for cpu; expected one route per device"));
  CHECK_THROWS_WITH(RoutedCommunicator(shared_comm(), Routes{{cpu, shared_comm()},
                                                             {c10::Device(c10::kCPU, 0), second}}),
                    Catch::Contains("route 1 is for cpu:0, and its nccl communicator does not "
                                    "take tensors there"));
  CHECK_THROWS_WITH(RoutedCommunicator(shared_comm(), Routes{{c10::Device(c10::kCUDA), second}}),
                    Catch::Contains("route 0 must name its CUDA device with an index (e.g. "
                                    "cuda:0), got cuda"));
  CHECK_THROWS_WITH(
      RoutedCommunicator(shared_comm(), Routes{{c10::Device(c10::kMeta),
                                                std::make_shared<RecordingCommunicator>(1)}}),
      Catch::Contains("route 0 (meta) has rank " + std::to_string(comm().rank()) + " of " +
                      std::to_string(comm().size() + 1) + ", the control communicator rank " +
                      std::to_string(comm().rank()) + " of " + std::to_string(comm().size())));
}

TEST_CASE("models on several devices: a communicator per device, device types checked",
          "[routed]") {
  auto control = shared_comm();
  const auto cpu_t = torch::zeros({2});
  CHECK(decent_dp::detail::distinct_devices({cpu_t, meta(3), cpu_t, meta(1)}) ==
        std::vector<c10::Device>{c10::Device(c10::kCPU), c10::Device(c10::kMeta)});
  CHECK(decent_dp::detail::route_device(c10::Device(c10::kCPU, 0)) == c10::Device(c10::kCPU));
  CHECK(communicator_for_devices({c10::Device(c10::kCPU)}, control) == control);
  CHECK_THROWS_WITH(communicator_for_devices({}, control),
                    Catch::Contains("communicator_for_devices: devices must not be empty"));
  CHECK_THROWS_WITH(
      communicator_for_devices({c10::Device(c10::kCPU), c10::Device(c10::kMeta)}, control),
      Catch::Contains("no communication backend for tensors on meta"));

  // Two layers, "0" on the CPU and "1" on the CPU or on meta. With one on meta, the wrappers
  // ask each device for its communicator (and none exists for meta tensors).
  auto make = [](bool tail_on_meta) {
    torch::manual_seed(3);
    auto net = std::make_shared<torch::nn::Module>();
    net->register_module("0", torch::nn::Linear(8, 8));
    auto tail = std::make_shared<torch::nn::Module>();
    const auto on = at::TensorOptions().device(tail_on_meta ? c10::kMeta : c10::kCPU);
    tail->register_parameter("weight", torch::empty({2, 8}, on));
    tail->register_parameter("bias", torch::empty({2}, on));
    net->register_module("1", tail);
    return net;
  };
  auto split = [&make] { return make(true); };
  using Wrapped = std::shared_ptr<torch::nn::Module>;
  CHECK_THROWS_WITH((DecentralizedDataParallel<Wrapped>(split(), DataParallelOptions(),
                                                        optim::adamw(), nullptr, control)),
                    Catch::Contains("no communication backend for tensors on meta"));
  CHECK_THROWS_WITH((DistributedDataParallel<Wrapped>(split(), DataParallelOptions(),
                                                      optim::adamw(), nullptr, control)),
                    Catch::Contains("no communication backend for tensors on meta"));
  {
    auto net = split();
    auto inner =
        std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH(
        DecentOptimWrapper(inner, comm().rank(), comm().size(), 1, "complete", 25.0, control),
        Catch::Contains("no communication backend for tensors on meta"));
  }
  // Codecs stay on CPU buckets: the parameter elsewhere is named.
  DataParallelOptions with_codec;
  with_codec.codec = std::make_shared<QuantizeCodec>(8, 256);
  CHECK_THROWS_WITH(
      (DecentralizedDataParallel<Wrapped>(split(), with_codec, optim::adamw(), nullptr, control)),
      Catch::Contains("codecs and aggregators run on CPU buckets, and parameter "
                      "'1.weight' is on meta"));

  if (comm().size() > 1) {
    // Device types are part of the model every rank must hold alike.
    auto net = make(comm().rank() == 1);
    CHECK_THROWS_WITH((DecentralizedDataParallel<Wrapped>(net, DataParallelOptions(),
                                                          optim::adamw(), nullptr, control)),
                      Catch::Contains("the model differs across ranks at entry 2: rank 0 has "
                                      "'1.weight' [2, 8] Float requires_grad on cpu (its device "
                                      "#0), rank 1 has '1.weight' [2, 8] Float requires_grad on "
                                      "meta (its device #1)"));
  }
  comm().barrier();
}
