// step_bench: time per training step of local training (no communication), classic
// all-reduce DistributedDataParallel, and DecentralizedDataParallel for each topology the
// world size allows — same model, same optimizer, same data sizes, run side by side.
//
//   mpirun -n 2 build/bin/step_bench [--model conv|mlp|resnet18|resnet20|cnn|...] [--steps 10]
//   [--batch 16] [--threads 1] [--channels 3] [--image-size 32]
//
// conv is a VGG-style network and mlp a 21 M-parameter perceptron of this benchmark's own; the
// other names are the models of examples/common (the trainer's), on images of --channels x
// --image-size x --image-size.
//
// --model sleep is the compute model for timing studies with more ranks than cores (the
// emulated cluster of benchmarks/emulate): --params parameters in --layers equal layers whose
// forward and backward cost a sleep, --compute-ms per step in all (a third forward, two
// thirds backward, spread over the layers, plus a uniform extra of up to --jitter-ms per rank
// and step, from a (rank, step) seed), and SGD as the optimizer. Step time then measures
// communication, overlap and the coupling of ranks only. --lws sets the ranks per node the
// topologies see (0: found through MPI; default: 1, and n / 2 for aer). --round-warmup N
// runs N untimed steps at the start of each round and leaves the round's final drain
// (synchronize()) out of the time: the steady-state period, what the emulated sweeps report.
//
// --device cuda trains on each rank's GPU (decent_dp::local_device: the local rank modulo
// the node's GPUs), the wrappers exchanging through NCCL, or the MPI backend with host
// staging where ranks share a GPU; every timed interval ends with a device synchronize. At
// one rank this measures the wrappers' own overhead against plain training (local).
//
// Every rank trains at the same time in every case, so the machine is equally loaded; the
// time of a case in one round is the slowest rank's mean over the timed steps. Rounds run
// every case in turn; the ratio to local training is the median over rounds of the ratio
// within a round. wait ms: the time a rank spent blocked on the wrapper's exchanges per timed
// step (exchange_wait_seconds()), the mean over ranks, median over rounds: what the planner
// calls wait. CPU columns: the training thread's CPU time and that of every other thread of
// the process (the communicator's progress thread), per step.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include <time.h>

#include "benchmarks/bench_mpi.h"
#include "benchmarks/bench_util.h"
#include "decent_dp/decent_dp.h"
#include "examples/common/models.h"

namespace {

using decent_dp::bench::slowest;

using Clock = std::chrono::steady_clock;

// A VGG-style convolutional network for 32x32 images: 10.5 M parameters.
torch::nn::Sequential make_conv() {
  torch::manual_seed(0);
  torch::nn::Sequential s;
  int64_t in = 3;
  const int64_t widths[] = {64, 128, 256, 512, 512, 512};
  for (int i = 0; i < 6; ++i) {
    s->push_back(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(in, widths[i], 3).padding(1).bias(false)));
    s->push_back(torch::nn::BatchNorm2d(widths[i]));
    s->push_back(torch::nn::ReLU());
    if (i < 4)
      s->push_back(torch::nn::MaxPool2d(2));
    in = widths[i];
  }
  s->push_back(torch::nn::Flatten());
  s->push_back(torch::nn::Linear(512 * 2 * 2, 2048));
  s->push_back(torch::nn::ReLU());
  s->push_back(torch::nn::Linear(2048, 10));
  return s;
}

// A multi-layer perceptron: 21 M parameters.
torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(1024, 4096), torch::nn::ReLU(),
                               torch::nn::Linear(4096, 4096), torch::nn::ReLU(),
                               torch::nn::Linear(4096, 10));
}

void sleep_ms(double ms) {
  if (ms > 0)
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// One layer of the sleep model: y = x, at a cost of `forward_ms` forward and `backward_ms`
// backward; the weight's gradient is a constant (one write of the layer's gradient).
struct SleepFunction : torch::autograd::Function<SleepFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, double forward_ms, double backward_ms) {
    ctx->saved_data["backward_ms"] = backward_ms;
    ctx->saved_data["numel"] = w.numel();
    sleep_ms(forward_ms);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    sleep_ms(ctx->saved_data["backward_ms"].toDouble());
    return {grad[0], at::full({ctx->saved_data["numel"].toInt()}, 1e-4), at::Tensor(),
            at::Tensor()};
  }
};

struct SleepCost {
  double forward_ms = 0;   // per layer
  double backward_ms = 0;  // per layer
  double jitter_ms = 0;    // per step, on the first layer's forward
  int rank = 0;
};

class SleepLayerImpl : public torch::nn::Module {
 public:
  SleepLayerImpl(int64_t numel, std::shared_ptr<SleepCost> cost, bool first)
      : cost_(std::move(cost)), first_(first) {
    w_ = register_parameter("w", torch::zeros({numel}));
  }
  at::Tensor forward(const at::Tensor& x) {
    double f = cost_->forward_ms;
    if (first_ && cost_->jitter_ms > 0) {
      // Uniform in [0, jitter_ms), from (rank, step): reproducible, different per rank.
      uint64_t h = (static_cast<uint64_t>(cost_->rank) << 32) ^ steps_++;
      h ^= h >> 33;
      h *= 0xff51afd7ed558ccdULL;
      h ^= h >> 33;
      f += cost_->jitter_ms * static_cast<double>(h >> 11) / 9007199254740992.0;
    }
    return SleepFunction::apply(x, w_, f, cost_->backward_ms);
  }

 private:
  std::shared_ptr<SleepCost> cost_;
  bool first_;
  at::Tensor w_;
  uint64_t steps_ = 0;
};
TORCH_MODULE(SleepLayer);

int64_t count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters())
    n += p.numel();
  return n;
}

double cpu_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double rank_mean(double ms) {
  double out = 0;
  int n = 1;
  MPI_Allreduce(&ms, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return out / n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "decent_dp step time: local vs DistributedDataParallel vs DecentralizedDataParallel"};
  std::string model_name = "conv";
  int steps = 5, warmup = 3, batch = 16, threads = 1, rounds = 5;
  std::vector<std::string> topologies = {"complete", "ring", "exp", "aer"};
  std::string json_path;
  std::vector<std::string> models = {"conv", "mlp", "sleep"};
  for (const auto& m : decent_dp::examples::model_names())
    if (m != "mlp")
      models.push_back(m);
  int64_t channels = 3, image_size = 32;
  app.add_option("--model", model_name, "conv (VGG-style), mlp (21 M) or an examples/common model")
      ->check(CLI::IsMember(models));
  app.add_option("--channels", channels, "input channels (examples/common models)")
      ->check(CLI::PositiveNumber);
  app.add_option("--image-size", image_size, "image side (examples/common models)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps per case and round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "rounds over all cases")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", batch, "samples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("-t,--topology", topologies, "topologies (skipped when n does not fit)");
  app.add_option("-J,--json", json_path, "also write the results as JSON");
  double compute_ms = 100, jitter_ms = 0, sleep_params = 4e6, bucket_mb = 25;
  int layers = 8, lws = -1, round_warmup = 0;
  app.add_option("--round-warmup", round_warmup,
                 "untimed steps at the start of each round; with N > 0 the round's final "
                 "synchronize() is not timed either (steady-state time per step)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--compute-ms", compute_ms, "sleep model: forward + backward ms per step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--jitter-ms", jitter_ms, "sleep model: up to this much more per rank and step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--params", sleep_params, "sleep model: parameters in all")
      ->check(CLI::Range(1.0, 4e9));
  app.add_option("--layers", layers, "sleep model: layers (parameter tensors)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--bucket-mb", bucket_mb, "both wrappers' bucket_cap_mb")
      ->check(CLI::PositiveNumber);
  app.add_option("--lws", lws, "ranks per node for the topologies (0: found through MPI)")
      ->check(CLI::NonNegativeNumber);
  std::string device_name = "cpu";
  app.add_option("--device", device_name, "cpu, or cuda (the local rank's GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  bool no_local_barrier = false, no_ddp = false;
  app.add_flag("--no-local-barrier", no_local_barrier, "skip the local + barrier case");
  app.add_flag("--no-ddp", no_ddp, "skip the DistributedDataParallel case");
  std::vector<std::string> flat_ring;
  app.add_option("--flat-ring", flat_ring,
                 "also run these cases ('allreduce' or topology names) with every group on one "
                 "flat ring (a second MPI communicator with the node-aware all-reduce off)");
  CLI11_PARSE(app, argc, argv);
  if (const std::string bad = decent_dp::bench::check_writable(json_path, "-J/--json");
      !bad.empty()) {
    std::fprintf(stderr, "error: %s\n", bad.c_str());
    return 2;
  }
  at::set_num_threads(threads);

  auto comm = decent_dp::default_communicator();
  const int rank = comm->rank(), n = comm->size();
  const c10::Device device =
      device_name == "cuda" ? decent_dp::local_device(*comm) : c10::Device(c10::kCPU);
  if (device_name == "cuda" && !device.is_cuda()) {
    if (rank == 0)
      std::fprintf(stderr, "error: --device cuda: this process sees no CUDA device\n");
    return 2;
  }
  auto sync_device = [device] {
    if (device.is_cuda())
      torch::cuda::synchronize(device.index());
  };
  const bool sleep_model = model_name == "sleep";
  const bool common = model_name != "conv" && model_name != "mlp" && !sleep_model;
  auto cost = std::make_shared<SleepCost>();
  cost->forward_ms = compute_ms / 3 / layers;
  cost->backward_ms = compute_ms * 2 / 3 / layers;
  cost->jitter_ms = jitter_ms;
  cost->rank = rank;
  if (sleep_model && static_cast<int64_t>(sleep_params) < layers) {
    if (rank == 0)
      std::fprintf(stderr, "error: --params (%.0f) must be at least --layers (%d)\n", sleep_params,
                   layers);
    return 2;
  }
  auto make = [&] {
    if (model_name == "conv")
      return make_conv();
    if (model_name == "mlp")
      return make_mlp();
    if (sleep_model) {
      torch::nn::Sequential s;
      const auto total = static_cast<int64_t>(sleep_params);
      for (int i = 0; i < layers; ++i)
        s->push_back(SleepLayer(total / layers + (i < total % layers ? 1 : 0), cost, i == 0));
      return s;
    }
    torch::manual_seed(0);
    return decent_dp::examples::make_model(model_name, channels, 10, image_size);
  };
  auto make_on_device = [&] {
    auto net = make();
    net->to(device);
    return net;
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(rank + 1);
  const int64_t c = common ? channels : 3, side = common ? image_size : 32;  // conv: 3x32x32
  const auto x = (model_name == "mlp" ? at::randn({batch, 1024}, gen)
                  : sleep_model       ? at::randn({batch, 10}, gen)
                                      : at::randn({batch, c, side, side}, gen))
                     .to(device);
  const auto y = at::randint(0, 10, {batch}, gen).to(device);
  auto optim_fn = sleep_model ? decent_dp::optim::sgd() : decent_dp::optim::adamw();
  {
    auto probe = make();
    if (rank == 0) {
      fmt::print(
          "# step_bench: {} ({} parameters), {} ranks, batch {} per rank, {} thread(s) per "
          "rank, {}, {} rounds of {} steps per case after {} warm-up steps, on {}\n",
          model_name, count(*probe), n, batch, threads, sleep_model ? "SGD" : "AdamW", rounds,
          steps, warmup, device.str());
      if (sleep_model)
        fmt::print("# sleep model: {} layers, {} ms compute per step (+ up to {} ms jitter)\n",
                   layers, compute_ms, jitter_ms);
    }
  }
  // Every case is built first; then `rounds` rounds each run every case for `steps` steps, so
  // load changes on the machine hit all cases alike. A case's time is the median over rounds
  // of the slowest rank's mean step time.
  struct Case {
    std::string name;
    std::function<void()> step;
    std::function<void()> finish;
    std::function<double()> wait_s;  // seconds blocked on exchanges so far (0: no wrapper)
    std::vector<double> ms;
    std::vector<double> wait_ms;       // ranks' mean time blocked on exchanges
    std::vector<double> main_cpu_ms;   // CPU time of the calling thread
    std::vector<double> other_cpu_ms;  // CPU time of threads other than the caller's
    Case(
        std::string n, std::function<void()> s, std::function<void()> f,
        std::function<double()> w = [] { return 0.0; })
        : name(std::move(n)), step(std::move(s)), finish(std::move(f)), wait_s(std::move(w)) {}
  };
  std::vector<Case> cases;
  std::vector<std::shared_ptr<void>> keep;  // models, optimizers and wrappers of the cases
  auto local_case = [&](bool barrier) {
    auto net = make_on_device();
    decent_dp::optim::NamedParams named;
    for (const auto& p : net->named_parameters())
      named.emplace_back(p.key(), p.value());
    std::shared_ptr<torch::optim::Optimizer> opt = optim_fn(named);
    keep.push_back(net.ptr());
    keep.push_back(opt);
    cases.push_back({barrier ? "local + barrier after each step" : "local (no communication)",
                     [net, opt, barrier, &x, &y, comm]() mutable {
                       opt->zero_grad();
                       torch::cross_entropy_loss(net->forward(x), y).backward();
                       opt->step();
                       if (barrier)
                         comm->barrier();
                     },
                     [] {}});
  };
  local_case(false);
  // The same with every rank waiting for the others after each step: the cost of coupling
  // ranks step by step on this machine, without moving any data.
  if (!no_local_barrier)
    local_case(true);
  // The flat-ring cases exchange through a communicator of their own (CPU tensors only).
  std::shared_ptr<decent_dp::Communicator> flat_comm;
  if (!flat_ring.empty()) {
    if (device.is_cuda()) {
      if (rank == 0)
        std::fprintf(stderr,
                     "error: --flat-ring compares the MPI backend's paths (--device cpu)\n");
      return 2;
    }
    decent_dp::MpiOptions flat_options;
    flat_options.node_aware = 0;
    flat_comm = std::make_shared<decent_dp::MpiCommunicator>(flat_options);
  }
  auto add_ddp = [&](const std::shared_ptr<decent_dp::Communicator>& with, const char* suffix) {
    decent_dp::DataParallelOptions options;
    options.bucket_cap_mb = bucket_mb;
    auto model = std::make_shared<decent_dp::DistributedDataParallel<torch::nn::Sequential>>(
        make_on_device(), options, optim_fn, nullptr, with);
    keep.push_back(model);
    cases.push_back(
        {std::string("DistributedDataParallel (all-reduce)") + suffix,
         [model, &x, &y] { torch::cross_entropy_loss(model->forward(x), y).backward(); },
         [model] { model->synchronize(); }, [model] { return model->exchange_wait_seconds(); }});
  };
  auto add_gossip = [&](const std::string& t, const std::shared_ptr<decent_dp::Communicator>& with,
                        const char* suffix) {
    decent_dp::DataParallelOptions options;
    options.topology = t;
    options.bucket_cap_mb = bucket_mb;
    options.local_world_size = lws >= 0 ? lws : t == "aer" ? std::max(2, n / 2) : 1;
    std::shared_ptr<decent_dp::DecentralizedDataParallel<torch::nn::Sequential>> model;
    try {
      model = std::make_shared<decent_dp::DecentralizedDataParallel<torch::nn::Sequential>>(
          make_on_device(), options, optim_fn, nullptr, with);
    } catch (const decent_dp::InvalidArgument& e) {
      if (rank == 0)
        fmt::print("# skipping {}: {}\n", t, e.what());
      return;
    }
    keep.push_back(model);
    cases.push_back(
        {"DecentralizedDataParallel " + model->topology().name() + suffix,
         [model, &x, &y] { torch::cross_entropy_loss(model->forward(x), y).backward(); },
         [model] { model->synchronize(); }, [model] { return model->exchange_wait_seconds(); }});
  };
  if (!no_ddp)
    add_ddp(comm, "");
  for (const auto& t : topologies)
    add_gossip(t, comm, "");
  for (const auto& t : flat_ring) {
    if (t == "allreduce")
      add_ddp(flat_comm, " flat ring");
    else
      add_gossip(t, flat_comm, " flat ring");
  }
  for (auto& c : cases) {
    for (int i = 0; i < warmup; ++i)
      c.step();
    c.finish();
    sync_device();
  }
  for (int r = 0; r < rounds; ++r) {
    // Each round starts at another case, so no case always follows the same one.
    for (size_t k = 0; k < cases.size(); ++k) {
      auto& c = cases[(k + static_cast<size_t>(r)) % cases.size()];
      MPI_Barrier(MPI_COMM_WORLD);
      // With --round-warmup the pipeline is full when the clock starts (the first timed step
      // waits for the exchange of the untimed one before it, as in the steady state) and the
      // exchanges still in flight at the end are drained after the clock stops: the time is
      // exactly `steps` periods of the steady state.
      for (int i = 0; i < round_warmup; ++i)
        c.step();
      sync_device();
      const double process0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID);
      const double thread0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID);
      const double wait0 = c.wait_s();
      const auto t0 = Clock::now();
      for (int i = 0; i < steps; ++i)
        c.step();
      if (round_warmup == 0)
        c.finish();
      sync_device();
      const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      // Blocked on exchanges during the timed steps (the drain after the clock is not).
      const double waited_ms = (c.wait_s() - wait0) * 1000.0;
      if (round_warmup > 0) {
        c.finish();
        sync_device();
      }
      c.ms.push_back(slowest(elapsed / steps));
      c.wait_ms.push_back(rank_mean(waited_ms / steps));
      const double other = (cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - process0) -
                           (cpu_ms(CLOCK_THREAD_CPUTIME_ID) - thread0);
      c.other_cpu_ms.push_back(slowest(std::max(0.0, other) / steps));
      c.main_cpu_ms.push_back(slowest((cpu_ms(CLOCK_THREAD_CPUTIME_ID) - thread0) / steps));
    }
  }
  // Load on this machine drifts between minutes, and the rounds interleave the cases: the
  // headline ratio is paired, the median over rounds of (case / local) within one round.
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  nlohmann::json rows = nlohmann::json::array();
  const std::vector<double> local_rounds = cases.front().ms;
  const double local_ms = median(local_rounds);
  if (rank == 0) {
    fmt::print("{:<40} {:>9} {:>8} {:>9} {:>17} {:>8} {:>13}\n", "case", "ms/step", "x local",
               "(medians)", "rounds ms", "wait ms", "CPU ms/step: caller, other threads");
  }
  for (auto& c : cases) {
    std::vector<double> paired;
    for (size_t r = 0; r < c.ms.size(); ++r)
      paired.push_back(c.ms[r] / local_rounds[r]);
    const double ratio = median(paired);
    const double ms = median(c.ms);
    const double main_cpu = median(c.main_cpu_ms);
    const double other_cpu = median(c.other_cpu_ms);
    const double wait = median(c.wait_ms);
    const auto [lo, hi] = std::minmax_element(c.ms.begin(), c.ms.end());
    if (rank == 0) {
      fmt::print(
          "{:<40} {:>9.1f} {:>7.3f}x {:>9.3f} {:>8.1f} .. {:<6.1f} {:>8.1f} {:>8.1f}, {:.1f}\n",
          c.name, ms, ratio, ms / local_ms, *lo, *hi, wait, main_cpu, other_cpu);
    }
    rows.push_back({{"case", c.name},
                    {"ms_per_step", ms},
                    {"ratio_to_local", ratio},
                    {"ratio_of_medians", ms / local_ms},
                    {"rounds_ms", c.ms},
                    {"wait_ms_per_step", wait},
                    {"caller_cpu_ms_per_step", main_cpu},
                    {"other_threads_cpu_ms_per_step", other_cpu}});
  }
  if (rank == 0 && !json_path.empty() &&
      !decent_dp::bench::write_json(json_path,
                                    nlohmann::json{{"model", model_name},
                                                   {"ranks", n},
                                                   {"batch", batch},
                                                   {"threads", threads},
                                                   {"device", device.str()},
                                                   {"rows", rows}},
                                    "-J/--json")) {
    return 1;
  }
  return 0;
}
