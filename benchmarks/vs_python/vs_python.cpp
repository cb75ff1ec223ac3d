// vs_python: decent_dp's side of the comparison with the Python originals (the published
// `decent-dp` package and torch's DistributedDataParallel; benchmarks/vs_python/vs_python.py
// is their side). Both programs take the same command line and train the same model,
// initialized the same way, on the same batches, with the same optimizer arithmetic (ATen's
// fused AdamW / SGD), so their trajectories can be compared number for number and their
// step times side by side.
//
//   mpirun -n 2 build/bin/vs_python [--model conv|mlp|small-conv|small-mlp]
//     [--topology complete] [--optimizer adamw|sgd|accum-adamw] [--steps 3] [--rounds 5]
//     [--warmup 2] [--round-warmup 0] [--cases local,gossip,allreduce] [--json out.json]
//     [--dump prefix]
//
// Cases, run interleaved in rounds: "local" (the model and its optimizer, no communication),
// "gossip" (DecentralizedDataParallel) and "allreduce" (DistributedDataParallel; the Python
// side runs torch's DistributedDataParallel and the optimizer after it). Each round times
// --steps steps per case after a barrier; a case's time in a round is the slowest rank's
// mean step time. By default the exchanges in flight are drained inside the timed interval;
// with --round-warmup N, N untimed steps start each round and the drain is left out: the
// steady-state period, as step_bench's --round-warmup. Rank 0 writes the per-round times as
// JSON; with --dump every rank writes the final parameters of the last case named in --cases
// (float32, named_parameters order) to <prefix>.rank<r>.bin. benchmarks/vs_python/compare
// runs both programs.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "benchmarks/bench_mpi.h"
#include "benchmarks/bench_util.h"
#include "decent_dp/decent_dp.h"

namespace {

using decent_dp::bench::slowest;

using Clock = std::chrono::steady_clock;

// The same networks as vs_python.py's make_model (parameter names and order included).
torch::nn::Sequential make_model(const std::string& name) {
  using namespace torch::nn;
  if (name == "mlp")  // 21 M parameters
    return Sequential(Linear(1024, 4096), ReLU(), Linear(4096, 4096), ReLU(), Linear(4096, 10));
  if (name == "small-mlp")
    return Sequential(Linear(32, 64), ReLU(), Linear(64, 64), Tanh(), Linear(64, 10));
  const bool big = name == "conv";
  const std::vector<int64_t> widths =
      big ? std::vector<int64_t>{64, 128, 256, 512, 512, 512} : std::vector<int64_t>{8, 16};
  const size_t pools = big ? 4 : 2;
  Sequential s;
  int64_t in = 3;
  for (size_t i = 0; i < widths.size(); ++i) {
    s->push_back(Conv2d(Conv2dOptions(in, widths[i], 3).padding(1).bias(false)));
    s->push_back(BatchNorm2d(widths[i]));
    s->push_back(ReLU());
    if (i < pools)
      s->push_back(MaxPool2d(2));
    in = widths[i];
  }
  s->push_back(Flatten());
  if (big) {  // 10.5 M parameters, 32x32 inputs
    s->push_back(Linear(512 * 2 * 2, 2048));
    s->push_back(ReLU());
    s->push_back(Linear(2048, 10));
  } else {  // 16x16 inputs
    s->push_back(Linear(16 * 4 * 4, 10));
  }
  return s;
}

std::vector<int64_t> input_shape(const std::string& name, int64_t batch) {
  if (name == "mlp")
    return {batch, 1024};
  if (name == "small-mlp")
    return {batch, 32};
  if (name == "conv")
    return {batch, 3, 32, 32};
  return {batch, 3, 16, 16};
}

// Parameter i (named_parameters order) <- randn(shape, seeded seed * 1000003 + i) times
// 1/sqrt(fan_in) for tensors of two or more dimensions, 0.1 for the others.
void initialize(torch::nn::Module& model, int64_t seed) {
  torch::NoGradGuard no_grad;
  int64_t i = 0;
  for (auto& p : model.parameters()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + i++);
    const double scale = p.dim() >= 2 ? 1.0 / std::sqrt(static_cast<double>(p[0].numel())) : 0.1;
    p.copy_(at::randn(p.sizes(), gen).mul_(scale));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp's side of the comparison with the Python originals"};
  std::string model_name = "conv", topology = "complete", optimizer = "adamw", cases_arg;
  std::string json_path, dump;
  double lr = 1e-3, weight_decay = 0.01, momentum = 0.9, bucket_mb = 25;
  int batch = 16, n_batches = 1, steps = 3, rounds = 5, warmup = 2, threads = 1;
  int64_t seed = 1;
  cases_arg = "local,gossip";
  app.add_option("--model", model_name, "network")
      ->check(CLI::IsMember({"conv", "mlp", "small-conv", "small-mlp"}));
  app.add_option("--topology", topology, "DecentralizedDataParallel's topology");
  app.add_option("--optimizer", optimizer, "adamw, sgd or accum-adamw (on every parameter)")
      ->check(CLI::IsMember({"adamw", "sgd", "accum-adamw"}));
  int64_t accum_iter = 4, t_max = 100, t_warmup = 0;
  std::string scheduler = "none";
  app.add_option("--accum-iter", accum_iter, "accum-adamw: updates per accumulation")
      ->check(CLI::PositiveNumber);
  app.add_option("--scheduler", scheduler, "none, or cosine (with linear warmup)")
      ->check(CLI::IsMember({"none", "cosine"}));
  app.add_option("--t-max", t_max, "cosine: steps of the cosine")->check(CLI::PositiveNumber);
  app.add_option("--t-warmup", t_warmup, "cosine: steps of linear warmup")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr", lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", weight_decay, "weight decay")->check(CLI::NonNegativeNumber);
  std::string decay_split = "all";
  app.add_option("--weight-decay-split", decay_split,
                 "which parameters decay: all; factory: each implementation's factory's rule "
                 "(here decent_dp's); package: the Python package's rule")
      ->check(CLI::IsMember({"all", "factory", "package"}));
  app.add_option("--momentum", momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  app.add_option("--batch", batch, "samples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--batches", n_batches, "distinct batches per rank, cycled")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps per case and round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "rounds over the cases")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps per case first")->check(CLI::NonNegativeNumber);
  int round_warmup = 0;
  app.add_option("--round-warmup", round_warmup,
                 "untimed steps at the start of each round; N > 0 also leaves the round's final "
                 "drain out of the time")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "seed of the parameters and the batches")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-mb", bucket_mb, "bucket_cap_mb")->check(CLI::PositiveNumber);
  double grad_clip = 0;
  app.add_option("--grad-clip", grad_clip,
                 "gossip: clip each bucket's gradient norm to this (0: off)")
      ->check(CLI::NonNegativeNumber);
  std::string bucket_order = "default";
  app.add_option("--bucket-order", bucket_order,
                 "order inside a bucket: default (the layout key: decayed parameters first) or "
                 "ready (gradient-ready order, the package's)")
      ->check(CLI::IsMember({"default", "ready"}));
  app.add_option("--threads", threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--cases", cases_arg, "local, gossip and/or allreduce, comma-separated");
  app.add_option("--json", json_path, "rank 0 writes the per-round times here");
  app.add_option("--dump", dump, "each rank writes the last case's parameters to PREFIX.rankR.bin");
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> order;
  {
    std::stringstream in(cases_arg);
    for (std::string c; std::getline(in, c, ',');) {
      if (c.empty())
        continue;
      if ((c != "local" && c != "gossip" && c != "allreduce") ||
          std::find(order.begin(), order.end(), c) != order.end()) {
        std::fprintf(stderr,
                     "error: --cases takes each of local, gossip, allreduce at most once, got "
                     "'%s'\n",
                     cases_arg.c_str());
        return 2;
      }
      order.push_back(c);
    }
    if (order.empty()) {
      std::fprintf(stderr, "error: --cases must name local, gossip and/or allreduce\n");
      return 2;
    }
  }
  if (const std::string bad = decent_dp::bench::check_writable(json_path, "--json"); !bad.empty()) {
    std::fprintf(stderr, "error: %s\n", bad.c_str());
    return 2;
  }
  at::set_num_threads(threads);
  auto comm = decent_dp::default_communicator();
  const int rank = comm->rank(), n = comm->size();

  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int b = 0; b < n_batches; ++b) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + 7919 * (rank + 1) + b);
    auto x = at::randn(input_shape(model_name, batch), gen);
    auto y = at::randint(0, 10, {batch}, gen);
    data.emplace_back(x, y);
  }
  decent_dp::optim::OptimFn optim_fn;
  // Every optimizer: the same learning rate, and weight decay on every parameter, on those
  // the factory's default rule names (the spec's section 8), or on those the Python
  // package's factories name ("bn" or "bias" in the name: the spec's section 11).
  auto common = [&](auto o) {
    o.lr = lr;
    o.weight_decay = weight_decay;
    if (decay_split == "all") {
      o.decay = [](const std::string&, const at::Tensor&) { return true; };
    } else if (decay_split == "package") {
      o.decay = [](const std::string& name, const at::Tensor&) {
        return name.find("bn") != std::string::npos || name.find("bias") != std::string::npos;
      };
    }
    return o;
  };
  if (optimizer == "adamw") {
    optim_fn = decent_dp::optim::adamw(common(decent_dp::optim::AdamWFactoryOptions{}));
  } else if (optimizer == "accum-adamw") {
    auto o = common(decent_dp::optim::AccumAdamWFactoryOptions{});
    o.accum_iter = accum_iter;
    optim_fn = decent_dp::optim::accum_adamw(o);
  } else {
    auto o = common(decent_dp::optim::SgdFactoryOptions{});
    o.momentum = momentum;
    optim_fn = decent_dp::optim::sgd(o);
  }
  // The package's lr_scheduler_fn_cosine_with_warmup with its defaults (eta_min 1e-6, warmup
  // from 1% of the learning rate).
  const decent_dp::optim::LrSchedulerFn scheduler_fn =
      scheduler == "cosine" ? decent_dp::optim::cosine_with_warmup(t_max, t_warmup, 0.01, 1e-6)
                            : nullptr;

  struct Case {
    std::function<void(const at::Tensor&, const at::Tensor&)> step;
    std::function<void()> finish;
    torch::nn::Sequential net;
    int64_t counter = 0;
    std::vector<double> ms;
  };
  std::map<std::string, Case> cases;
  std::vector<std::shared_ptr<void>> keep;
  for (const auto& c : order) {
    auto net = make_model(model_name);
    initialize(*net, seed);
    cases[c].net = net;
    if (c == "local") {
      decent_dp::optim::NamedParams named;
      for (const auto& p : net->named_parameters())
        named.emplace_back(p.key(), p.value());
      std::shared_ptr<torch::optim::Optimizer> opt = optim_fn(named);
      std::shared_ptr<torch::optim::LRScheduler> sched;
      if (scheduler_fn)
        sched = scheduler_fn(*opt);
      keep.push_back(opt);
      cases[c].step = [net, opt, sched](const at::Tensor& x, const at::Tensor& y) mutable {
        opt->zero_grad();
        torch::cross_entropy_loss(net->forward(x), y).backward();
        opt->step();
        if (sched)
          sched->step();
      };
      cases[c].finish = [] {};
    } else if (c == "allreduce") {
      decent_dp::DataParallelOptions options;
      options.bucket_cap_mb = bucket_mb;
      auto model = std::make_shared<decent_dp::DistributedDataParallel<torch::nn::Sequential>>(
          net, options, optim_fn, scheduler_fn, comm);
      keep.push_back(model);
      cases[c].step = [model](const at::Tensor& x, const at::Tensor& y) {
        torch::cross_entropy_loss(model->forward(x), y).backward();
      };
      cases[c].finish = [model] { model->synchronize(); };
    } else {
      decent_dp::DataParallelOptions options;
      options.topology = topology;
      options.bucket_cap_mb = bucket_mb;
      options.grad_clip_norm = grad_clip;
      if (bucket_order == "ready")
        options.bucket_layout_key = nullptr;
      std::shared_ptr<decent_dp::DecentralizedDataParallel<torch::nn::Sequential>> model;
      try {
        model = std::make_shared<decent_dp::DecentralizedDataParallel<torch::nn::Sequential>>(
            net, options, optim_fn, scheduler_fn, comm);
      } catch (const decent_dp::InvalidArgument& e) {
        if (rank == 0)
          std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
      }
      keep.push_back(model);
      cases[c].step = [model](const at::Tensor& x, const at::Tensor& y) {
        torch::cross_entropy_loss(model->forward(x), y).backward();
      };
      cases[c].finish = [model] { model->synchronize(); };
    }
  }
  auto run = [&](Case& c, int count) {
    for (int i = 0; i < count; ++i) {
      const auto& [x, y] = data[static_cast<size_t>(c.counter++ % n_batches)];
      c.step(x, y);
    }
  };
  for (const auto& name : order) {
    run(cases[name], warmup);
    cases[name].finish();
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < order.size(); ++k) {
      Case& c = cases[order[(k + static_cast<size_t>(r)) % order.size()]];
      MPI_Barrier(MPI_COMM_WORLD);
      run(c, round_warmup);
      const auto t0 = Clock::now();
      run(c, steps);
      if (round_warmup == 0)
        c.finish();
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (round_warmup > 0)
        c.finish();
      c.ms.push_back(slowest(ms / steps));
    }
  }
  if (!dump.empty()) {
    std::vector<at::Tensor> flat;
    for (const auto& p : cases[order.back()].net->parameters())
      flat.push_back(p.detach().reshape({-1}).to(at::kFloat));
    const auto all = at::cat(flat).contiguous();
    const std::string path = dump + ".rank" + std::to_string(rank) + ".bin";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(all.data_ptr()), static_cast<std::streamsize>(all.nbytes()));
    out.close();
    if (!out) {
      std::fprintf(stderr, "error: --dump: writing '%s' failed\n", path.c_str());
      return 1;
    }
  }
  if (rank == 0 && !json_path.empty()) {
    nlohmann::json ms;
    for (const auto& name : order)
      ms[name] = cases[name].ms;
    int64_t parameters = 0;
    for (const auto& p : make_model(model_name)->parameters())
      parameters += p.numel();
    if (!decent_dp::bench::write_json(json_path,
                                      nlohmann::json{{"implementation", "decent_dp"},
                                                     {"ranks", n},
                                                     {"model", model_name},
                                                     {"topology", topology},
                                                     {"optimizer", optimizer},
                                                     {"batch", batch},
                                                     {"steps", steps},
                                                     {"rounds", rounds},
                                                     {"warmup", warmup},
                                                     {"round_warmup", round_warmup},
                                                     {"threads", threads},
                                                     {"parameters", parameters},
                                                     {"ms", ms}},
                                      "--json"))
      return 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return 0;
}
