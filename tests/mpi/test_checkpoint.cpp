// Checkpoint/resume of the three wrappers (Note [checkpoint]): exact resume in every mode,
// refused files and mismatched jobs.
#include "torch_catch.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "decent_dp/compensated_codec.h"
#include "decent_dp/decent_optim_wrapper.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/quantize_codec.h"
#include "mpi_test_util.h"
#include "tied_net.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

std::shared_ptr<Communicator> shared_comm() {
  return std::shared_ptr<Communicator>(&comm(), [](Communicator*) {});
}

// One folder per test run, the same on every rank (rank 0's pid), removed at the end.
std::string base_dir() {
  static const std::string dir = [] {
    at::Tensor pid = at::zeros({1}, at::kLong);
    if (comm().rank() == 0) {
      pid.fill_(static_cast<int64_t>(::getpid()));
    }
    comm().broadcast(pid, 0)->wait();
    return "/tmp/decent_dp_test_checkpoint." + std::to_string(pid.item<int64_t>());
  }();
  return dir;
}

std::string dir_for(const std::string& name) {
  return base_dir() + "/" + name;
}

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path);
}

void remove_tree(const std::string& dir) {
  ::nftw(dir.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

struct Cleanup {
  ~Cleanup() {
    comm().barrier();
    if (comm().rank() == 0) {
      remove_tree(base_dir());
    }
  }
};

torch::nn::Sequential make_cnn(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1).bias(false)),
      torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::Flatten(),
      torch::nn::Linear(4 * 5 * 5, 3));
}

// Different data on every rank and step.
std::pair<at::Tensor, at::Tensor> batch_for(int rank, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + step + 1);
  return {at::randn({6, 2, 5, 5}, gen), at::randn({6, 3}, gen)};
}

template <typename Wrapper>
void train(Wrapper& model, int from, int to) {
  for (int s = from; s < to; ++s) {
    auto [x, y] = batch_for(comm().rank(), s);
    torch::mse_loss(model.forward(x), y).backward();
  }
}

// Parameters and buffers, cloned.
std::vector<at::Tensor> state_of(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out.push_back(p.value().detach().clone());
  }
  for (const auto& b : m.named_buffers()) {
    out.push_back(b.value().clone());
  }
  return out;
}

void require_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("rank " << comm().rank() << " tensor " << i);
    CHECK(torch::equal(a[i], b[i]));
  }
}

DataParallelOptions options_for(const std::string& topology, double cap_bytes = 512) {
  DataParallelOptions o;
  o.topology = topology;
  o.bucket_cap_mb = cap_bytes / (1 << 20);  // several buckets even for this tiny model
  return o;
}

std::vector<std::string> topologies_for(int n) {
  std::vector<std::string> out = {"complete"};
  if (n % 2 == 0) {
    out.push_back("ring");  // period 2 from 4 ranks on
  }
  if (n > 0 && (n & (n - 1)) == 0) {
    out.push_back("exp");  // period log2(n)
  }
  return out;
}

// N steps, save, a fresh wrapper over a differently initialised model loads, M steps: the
// same parameters, buffers and counters as N + M uninterrupted steps, bit for bit.
template <typename Wrapper, typename Make>
void check_exact_resume(const std::string& name, int n_steps, int m_steps, Make make) {
  std::vector<at::Tensor> expected;
  int64_t expected_updates = 0;
  {
    auto net = make_cnn(7);
    Wrapper ref = make(net);
    train(ref, 0, n_steps + m_steps);
    ref.synchronize();
    expected = state_of(*net);
    expected_updates = ref.updates();
  }
  const std::string dir = dir_for(name);
  {
    auto net = make_cnn(7);
    Wrapper first = make(net);
    train(first, 0, n_steps);
    first.save(dir, {{"next_step", at::full({1}, n_steps, at::kLong)}});
  }
  auto net = make_cnn(99);  // other initial values: everything must come from the file
  Wrapper resumed = make(net);
  const NamedTensors user = resumed.load(dir);
  REQUIRE(user.size() == 1);
  CHECK(user[0].first == "next_step");
  CHECK(user[0].second.item<int64_t>() == n_steps);
  CHECK(resumed.step() == n_steps);
  train(resumed, n_steps, n_steps + m_steps);
  resumed.synchronize();
  CHECK(resumed.updates() == expected_updates);
  require_equal(state_of(*net), expected);
}

using Gossip = DecentralizedDataParallel<torch::nn::Sequential>;
using AllReduce = DistributedDataParallel<torch::nn::Sequential>;

// Expects a CheckpointError on every rank; `rank_message` on rank `who`.
template <typename F>
void expect_refused(F&& f, int who, const std::string& rank_message) {
  try {
    f();
    FAIL("load accepted the checkpoint");
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    INFO("rank " << comm().rank() << ": " << what);
    if (comm().rank() == who) {
      CHECK(what.find(rank_message) != std::string::npos);
    } else {
      CHECK(what.find("rank " + std::to_string(who) + " failed") != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("resume is exact in gossip mode for every topology, saved mid-period", "[checkpoint]") {
  Cleanup cleanup;
  const int n = comm().size();
  for (const auto& topo : topologies_for(n)) {
    for (bool view : {true, false}) {
      SECTION(topo + (view ? " view" : " copy")) {
        check_exact_resume<Gossip>(topo + std::to_string(view), 3, 4, [&](auto& net) {
          DataParallelOptions o = options_for(topo);
          o.param_as_bucket_view = view;
          return Gossip(net, o, optim::adamw(), optim::cosine_with_warmup(20, 3), shared_comm());
        });
      }
    }
  }
}

TEST_CASE("resume is exact with tied weights", "[checkpoint]") {
  Cleanup cleanup;
  const int n = comm().size();
  const std::string topo = n % 2 == 0 ? "ring" : "complete";
  using testing::TiedNet;  // the CNN's batches: 2 x 5 x 5 inputs, 3 outputs
  auto make = [&](TiedNet& net) {
    return DecentralizedDataParallel<TiedNet>(net, options_for(topo), optim::adamw(), nullptr,
                                              shared_comm());
  };
  TiedNet ref_net(50, 3, 7);
  {
    auto ref = make(ref_net);
    train(ref, 0, 6);
    ref.synchronize();
  }
  const std::string dir = dir_for("tied");
  {
    TiedNet first_net(50, 3, 7);
    auto first = make(first_net);
    train(first, 0, 3);
    first.save(dir);
  }
  TiedNet net(50, 3, 99);
  auto resumed = make(net);
  resumed.load(dir);
  train(resumed, 3, 6);
  resumed.synchronize();
  CHECK(net->named_parameters()["dec_w"].is_same(net->enc->weight));
  require_equal(state_of(*net), state_of(*ref_net));
}

TEST_CASE("resume is exact in all-reduce mode and with a robust aggregator", "[checkpoint]") {
  Cleanup cleanup;
  SECTION("all-reduce, SGD with momentum") {
    check_exact_resume<AllReduce>("allreduce", 3, 3, [&](auto& net) {
      optim::SgdFactoryOptions sgd;
      sgd.lr = 0.05;
      sgd.momentum = 0.9;
      return AllReduce(net, options_for("complete"), optim::sgd(sgd),
                       optim::cosine_with_warmup(10, 2), shared_comm());
    });
  }
  SECTION("gossip, median of the group (gather path), AccumAdamW") {
    check_exact_resume<Gossip>("median", 3, 3, [&](auto& net) {
      DataParallelOptions o = options_for(comm().size() % 2 == 0 ? "ring" : "complete");
      o.aggregator = std::make_shared<MedianAggregator>();
      return Gossip(net, o, optim::accum_adamw(), nullptr, shared_comm());
    });
  }
  SECTION("gossip, error-compensated 4-bit quantization (the codec's estimates)") {
    check_exact_resume<Gossip>("compensated", 3, 4, [&](auto& net) {
      const int n = comm().size();
      DataParallelOptions o = options_for(n > 2 && (n & (n - 1)) == 0 ? "exp" : "complete");
      o.codec = std::make_shared<ErrorCompensatedCodec>(std::make_shared<QuantizeCodec>(4, 64));
      return Gossip(net, o, optim::adamw(), nullptr, shared_comm());
    });
  }
  SECTION("saved before the first backward") {
    check_exact_resume<Gossip>("fresh", 0, 3, [&](auto& net) {
      return Gossip(net, options_for("complete"), optim::adamw(), nullptr, shared_comm());
    });
  }
}

TEST_CASE("resume is exact with DecentOptimWrapper", "[checkpoint]") {
  Cleanup cleanup;
  const int n = comm().size();
  const std::string topo = n % 2 == 0 ? "ring" : "complete";
  auto run = [&](int from, int to, const std::string& save_dir, const std::string& load_dir,
                 uint64_t seed) {
    auto net = make_cnn(seed);
    auto inner =
        std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
    DecentOptimWrapper opt(inner, comm().rank(), n, 1, topo, 512.0 / (1 << 20), shared_comm());
    // The wrapper owns parameters only: the trainer keeps BatchNorm's buffers in user_state.
    NamedTensors buffers;
    for (const auto& b : net->named_buffers()) {
      buffers.emplace_back(b.key(), b.value());
    }
    if (!load_dir.empty()) {
      const NamedTensors saved = opt.load(load_dir);
      CHECK(opt.step_count() == from);
      REQUIRE(saved.size() == buffers.size());
      for (size_t i = 0; i < saved.size(); ++i) {
        CHECK(saved[i].first == buffers[i].first);
        buffers[i].second.copy_(saved[i].second);
      }
    }
    for (int s = from; s < to; ++s) {
      auto [x, y] = batch_for(comm().rank(), s);
      opt.zero_grad();
      torch::mse_loss(net->forward(x), y).backward();
      opt.step();
    }
    if (!save_dir.empty()) {
      opt.save(save_dir, buffers);
    }
    opt.global_avg(true);  // waits for the exchange in flight
    opt.revert_global_avg();
    return state_of(*net);
  };
  const auto expected = run(0, 7, "", "", 5);
  run(0, 3, dir_for("optim_wrapper"), "", 5);
  require_equal(run(3, 7, "", dir_for("optim_wrapper"), 77), expected);
}

TEST_CASE("load refuses flipped bytes, truncated files, missing manifests and other setups",
          "[checkpoint]") {
  Cleanup cleanup;
  const int n = comm().size();
  const int rank = comm().rank();
  const std::string dir = dir_for("refused");
  {
    auto net = make_cnn(3);
    Gossip model(net, options_for("complete"), optim::adamw(), nullptr, shared_comm());
    train(model, 0, 2);
    model.save(dir);
  }
  auto fresh = [&](const std::string& topo, double cap_bytes = 512) {
    return Gossip(make_cnn(3), options_for(topo, cap_bytes), optim::adamw(), nullptr,
                  shared_comm());
  };
  const std::string file0 = checkpoint::rank_file(dir, 0);
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  auto write = [](const std::string& path, const std::string& data) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
  };
  const std::string original = read(file0);
  comm().barrier();

  SECTION("a flipped byte") {
    if (rank == 0) {
      std::string bad = original;
      bad[bad.size() - 100] ^= 0x10;
      write(file0, bad);
    }
    comm().barrier();
    auto model = fresh("complete");
    expect_refused([&] { model.load(dir); }, 0, "rank-0.ckpt: field 'fnv1a64'");
  }
  SECTION("a truncated file") {
    if (rank == 0) {
      write(file0, original.substr(0, original.size() / 2));
    }
    comm().barrier();
    auto model = fresh("complete");
    expect_refused([&] { model.load(dir); }, 0, "rank-0.ckpt: truncated");
  }
  SECTION("an interrupted save (no manifest)") {
    comm().barrier();
    if (rank == 0) {
      ::unlink(checkpoint::manifest_file(dir).c_str());
    }
    comm().barrier();
    auto model = fresh("complete");
    try {
      model.load(dir);
      FAIL("load accepted a folder without a manifest");
    } catch (const CheckpointError& e) {
      CHECK(std::string(e.what()).find("incomplete") != std::string::npos);
    }
  }
  if (n % 2 == 0) {
    SECTION("another topology") {
      auto model = fresh("ring");
      try {
        model.load(dir);
        FAIL("load accepted another topology");
      } catch (const CheckpointError& e) {
        CHECK(std::string(e.what()).find("field 'topology' is complete") != std::string::npos);
      }
    }
  }
  SECTION("another bucket plan") {
    auto model = fresh("complete", 1 << 20);
    try {
      model.load(dir);
      FAIL("load accepted another bucket plan");
    } catch (const CheckpointError& e) {
      CHECK(std::string(e.what()).find("field 'buckets'") != std::string::npos);
    }
  }
  SECTION("another wrapper") {
    AllReduce model(make_cnn(3), options_for("complete"), optim::adamw(), nullptr, shared_comm());
    try {
      model.load(dir);
      FAIL("load accepted a gossip checkpoint into the all-reduce wrapper");
    } catch (const CheckpointError& e) {
      CHECK(std::string(e.what()).find("field 'wrapper' is DecentralizedDataParallel") !=
            std::string::npos);
    }
  }
  SECTION("save between forward and backward") {
    auto model = fresh("complete");
    auto [x, y] = batch_for(rank, 0);
    auto loss = torch::mse_loss(model.forward(x), y);
    CHECK_THROWS_AS(model.save(dir_for("never")), InvalidArgument);
    loss.backward();
  }
}

// The two halves of "a checkpoint of 4 ranks loaded by 2": ctest runs them in order
// (DECENT_DP_TEST_CHECKPOINT_DIR names the folder they share).
TEST_CASE("save for the cross-world-size test", "[.cross-save]") {
  const char* dir = std::getenv("DECENT_DP_TEST_CHECKPOINT_DIR");
  REQUIRE(dir != nullptr);
  Gossip model(make_cnn(3), options_for("complete"), optim::adamw(), nullptr, shared_comm());
  train(model, 0, 2);
  model.save(dir);
}

TEST_CASE("load of a checkpoint of another world size", "[.cross-load]") {
  const char* dir = std::getenv("DECENT_DP_TEST_CHECKPOINT_DIR");
  REQUIRE(dir != nullptr);
  Gossip model(make_cnn(3), options_for("complete"), optim::adamw(), nullptr, shared_comm());
  try {
    model.load(dir);
    FAIL("load accepted a checkpoint of another world size");
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("field 'world_size' is 4, this job's world size is " +
                    std::to_string(comm().size())) != std::string::npos);
  }
  comm().barrier();
  if (comm().rank() == 0) {
    remove_tree(dir);
  }
}
