// optim_bench: time per optimizer step over a ResNet-50-shaped parameter set (25.6 M
// parameters in 161 tensors): decent_dp's optimizers on flat buckets (one parameter block,
// and one gradient block as DistributedDataParallel lays them out or gradients apart as
// DecentralizedDataParallel leaves them; also with the convolution weights channels-last)
// against torch::optim's
// per-parameter loops, with the memory bandwidth each achieves next to that of a plain
// large-tensor copy measured in the same run.
//
//   build/bin/optim_bench [--iters 20] [--threads 1] [--device cpu|cuda] [--json out.json]
//
// --device cuda runs every case on the GPU (the fused ATen kernels; the copy baseline is then
// the device's copy bandwidth), synchronizing the device around each timed step.
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "benchmarks/bench_util.h"
#include "decent_dp/optim/adam.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/optim/sgd.h"

namespace {

using Clock = std::chrono::steady_clock;

// Where the benchmark runs (--device).
c10::Device g_device(c10::kCPU);

void sync_device() {
  if (g_device.is_cuda())
    torch::cuda::synchronize(g_device.index());
}

// The parameter shapes of torchvision's ResNet-50.
std::vector<std::vector<int64_t>> resnet50_shapes() {
  std::vector<std::vector<int64_t>> s;
  auto conv = [&](int64_t out, int64_t in, int64_t k) { s.push_back({out, in, k, k}); };
  auto bn = [&](int64_t c) {
    s.push_back({c});
    s.push_back({c});
  };
  conv(64, 3, 7);
  bn(64);
  int64_t in = 64;
  const int64_t widths[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t w = widths[stage];
    for (int b = 0; b < blocks[stage]; ++b) {
      conv(w, in, 1);
      bn(w);
      conv(w, w, 3);
      bn(w);
      conv(4 * w, w, 1);
      bn(4 * w);
      if (b == 0) {
        conv(4 * w, in, 1);
        bn(4 * w);
      }
      in = 4 * w;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

struct ParamSet {
  at::Tensor param_block, grad_block;  // defined for flat sets (grad_block: unless apart)
  std::vector<at::Tensor> params;
};

// `flat`: the parameters are views of one block, and (unless `grads_apart`) their gradients
// views of another, as DistributedDataParallel lays them out; with `grads_apart` every
// gradient is a tensor of its own, as DecentralizedDataParallel leaves them (Note
// [gradients in place]).
// With `channels_last` every 4-D parameter (a convolution's weight) and its gradient are
// laid out channels-last (the parameter a view of its block in that order), as a model
// converted with .to(torch::MemoryFormat::ChannelsLast) has them.
ParamSet make_set(const std::vector<std::vector<int64_t>>& shapes, bool flat,
                  bool grads_apart = false, bool channels_last = false) {
  torch::manual_seed(0);
  ParamSet set;
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (const auto& sh : shapes) {
    int64_t n = 1;
    for (auto d : sh)
      n *= d;
    offsets.push_back(total);
    total += (n + 31) / 32 * 32;
  }
  torch::NoGradGuard no_grad;
  if (flat) {
    set.param_block = torch::randn({total}, g_device) * 0.01;
    if (!grads_apart)
      set.grad_block = torch::randn({total}, g_device) * 0.01;
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor p;
    if (flat) {
      int64_t n = 1;
      for (auto d : shapes[i])
        n *= d;
      const bool cl = channels_last && shapes[i].size() == 4;
      const auto& sh = shapes[i];
      auto shaped = [&](const at::Tensor& run) {
        return cl ? run.view({sh[0], sh[2], sh[3], sh[1]}).permute({0, 3, 1, 2}) : run.view(sh);
      };
      p = torch::empty({0}, g_device);
      p.set_data(shaped(set.param_block.narrow(0, offsets[i], n)));
      p.requires_grad_(true);
      p.mutable_grad() = grads_apart ? (torch::randn(sh, g_device) * 0.01)
                                           .contiguous(cl ? at::MemoryFormat::ChannelsLast
                                                          : at::MemoryFormat::Contiguous)
                                     : shaped(set.grad_block.narrow(0, offsets[i], n));
    } else {
      p = (torch::randn(shapes[i], g_device) * 0.01).requires_grad_(true);
      p.mutable_grad() = torch::randn(shapes[i], g_device) * 0.01;
    }
    set.params.push_back(p);
  }
  return set;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

template <typename F>
double time_ms(F&& f, int iters) {
  f();  // warm-up: allocates optimizer state
  f();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    sync_device();
    const auto t0 = Clock::now();
    f();
    sync_device();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp optimizer step: fused flat buckets vs torch::optim"};
  int iters = 20;
  int threads = 1;
  std::string json_path;
  app.add_option("-n,--iters", iters, "timed steps per case")->check(CLI::PositiveNumber);
  app.add_option("-t,--threads", threads, "intra-op threads")->check(CLI::PositiveNumber);
  app.add_option("-J,--json", json_path, "also write the results as JSON");
  std::string device_name = "cpu";
  app.add_option("--device", device_name, "cpu, or cuda (the first GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  if (device_name == "cuda") {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "error: --device cuda: this process sees no CUDA device\n");
      return 2;
    }
    g_device = c10::Device(c10::kCUDA, 0);
  }
  if (const std::string bad = decent_dp::bench::check_writable(json_path, "-J/--json");
      !bad.empty()) {
    std::fprintf(stderr, "error: %s\n", bad.c_str());
    return 2;
  }
  at::set_num_threads(threads);

  const auto shapes = resnet50_shapes();
  int64_t numel = 0;
  for (const auto& sh : shapes) {
    int64_t n = 1;
    for (auto d : sh)
      n *= d;
    numel += n;
  }
  fmt::print(
      "# optim_bench: {} parameters in {} tensors, float32, on {}, {} thread(s), median of {} "
      "steps\n",
      numel, shapes.size(), g_device.str(), threads, iters);

  // Memory-bandwidth baseline: copy a tensor as large as the parameters (read + write).
  auto src = torch::randn({numel}, g_device);
  auto dst = torch::empty({numel}, g_device);
  const double copy_ms = time_ms([&] { dst.copy_(src); }, iters);
  const double copy_gbps = 2.0 * 4 * numel / copy_ms / 1e6;
  fmt::print("{:<34} {:>9.2f} ms  {:>7.2f} GB/s\n", "copy (baseline)", copy_ms, copy_gbps);

  nlohmann::json rows = nlohmann::json::array();
  auto report = [&](const std::string& name, double ms, double bytes_per_param, double base_ms) {
    const double gbps = bytes_per_param * numel / ms / 1e6;
    fmt::print("{:<34} {:>9.2f} ms  {:>7.2f} GB/s  {:>5.1f}% of copy", name, ms, gbps,
               100.0 * gbps / copy_gbps);
    if (base_ms > 0)
      fmt::print("  {:>5.2f}x vs torch::optim", base_ms / ms);
    fmt::print("\n");
    rows.push_back({{"case", name},
                    {"ms", ms},
                    {"GBps", gbps},
                    {"copy_fraction", gbps / copy_gbps},
                    {"speedup_vs_torch", base_ms > 0 ? base_ms / ms : 0.0}});
  };
  // Bytes touched per parameter and step (float32): AdamW reads p, g, m, v and writes
  // p, m, v (7 x 4); AccumAdamW also reads and writes the accumulator (9 x 4); SGD with
  // momentum reads p, g, buf and writes p, buf (5 x 4).
  {
    auto ref = make_set(shapes, false);
    torch::optim::AdamW theirs(ref.params, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    const double base = time_ms([&] { theirs.step(); }, iters);
    report("torch::optim::AdamW (per tensor)", base, 28, 0);
    auto per = make_set(shapes, false);
    decent_dp::optim::AdamW ours_per(per.params,
                                     decent_dp::optim::AdamWOptions(1e-3).weight_decay(0.1));
    report("decent_dp AdamW (per tensor)", time_ms([&] { ours_per.step(); }, iters), 28, base);
    auto flat = make_set(shapes, true);
    decent_dp::optim::AdamW ours(flat.params,
                                 decent_dp::optim::AdamWOptions(1e-3).weight_decay(0.1));
    const double fused = time_ms([&] { ours.step(); }, iters);
    report("decent_dp AdamW (flat)", fused, 28, base);
    auto apart = make_set(shapes, true, /*grads_apart=*/true);
    decent_dp::optim::AdamW ours_apart(apart.params,
                                       decent_dp::optim::AdamWOptions(1e-3).weight_decay(0.1));
    report("decent_dp AdamW (flat, grads apart)", time_ms([&] { ours_apart.step(); }, iters), 28,
           base);
    // Convolution weights channels-last: stepped in memory order by the same fused call.
    auto cl = make_set(shapes, true, /*grads_apart=*/true, /*channels_last=*/true);
    decent_dp::optim::AdamW ours_cl(cl.params,
                                    decent_dp::optim::AdamWOptions(1e-3).weight_decay(0.1));
    report("decent_dp AdamW (grads apart, NHWC)", time_ms([&] { ours_cl.step(); }, iters), 28,
           base);
    // What the wrappers give their optimizers: the adamw() factory's two groups (decayed
    // weights, undecayed 1-D parameters) over one flat bucket, laid out by the default bucket
    // layout key (each group one contiguous run) or in gradient-ready order (interleaved).
    auto ordered = shapes;
    std::stable_partition(ordered.begin(), ordered.end(),
                          [](const std::vector<int64_t>& sh) { return sh.size() >= 2; });
    for (bool layout : {true, false}) {
      auto set = make_set(layout ? ordered : shapes, true);
      decent_dp::optim::NamedParams named;
      for (size_t i = 0; i < set.params.size(); ++i)
        named.emplace_back("p" + std::to_string(i), set.params[i]);
      decent_dp::optim::AdamWFactoryOptions fo;
      fo.weight_decay = 0.1;
      auto opt = decent_dp::optim::adamw(fo)(named);
      const double ms = time_ms([&] { opt->step(); }, iters);
      const auto* a = dynamic_cast<decent_dp::optim::AdamW*>(opt.get());
      const int flat_groups = a != nullptr ? a->last_flat_groups() : -1;
      report(layout ? "decent_dp adamw() factory, wrapper's bucket layout"
                    : "decent_dp adamw() factory, gradient-ready order",
             ms, 28, base);
      fmt::print("  flat groups: {} of {}\n", flat_groups, opt->param_groups().size());
      rows.push_back({{"case", layout ? "factory_wrapper_layout" : "factory_interleaved"},
                      {"flat_groups", flat_groups}});
    }
    auto flat2 = make_set(shapes, true);
    decent_dp::optim::AccumAdamW accum(
        flat2.params, decent_dp::optim::AccumAdamWOptions(1e-3).weight_decay(0.1).accum_iter(4));
    const double accum_ms = time_ms([&] { accum.step(); }, iters);
    report("decent_dp AccumAdamW (flat)", accum_ms, 36, base);
    auto apart2 = make_set(shapes, true, /*grads_apart=*/true);
    decent_dp::optim::AccumAdamW accum_apart(
        apart2.params, decent_dp::optim::AccumAdamWOptions(1e-3).weight_decay(0.1).accum_iter(4));
    report("decent_dp AccumAdamW (flat, grads apart)", time_ms([&] { accum_apart.step(); }, iters),
           36, base);
    fmt::print("AccumAdamW / fused AdamW time: {:.2f}x\n", accum_ms / fused);
    rows.push_back({{"case", "accum_over_fused_adamw"}, {"ratio", accum_ms / fused}});
  }
  {
    auto ref = make_set(shapes, false);
    torch::optim::SGD theirs(ref.params, torch::optim::SGDOptions(0.1).momentum(0.9));
    const double base = time_ms([&] { theirs.step(); }, iters);
    report("torch::optim::SGD momentum", base, 20, 0);
    auto flat = make_set(shapes, true);
    decent_dp::optim::SGD ours(flat.params, decent_dp::optim::SGDOptions(0.1).momentum(0.9));
    report("decent_dp SGD momentum (flat)", time_ms([&] { ours.step(); }, iters), 20, base);
    auto apart = make_set(shapes, true, /*grads_apart=*/true);
    decent_dp::optim::SGD ours_apart(apart.params, decent_dp::optim::SGDOptions(0.1).momentum(0.9));
    report("decent_dp SGD momentum (flat, grads apart)", time_ms([&] { ours_apart.step(); }, iters),
           20, base);
  }
  if (!json_path.empty() && !decent_dp::bench::write_json(json_path,
                                                          nlohmann::json{{"numel", numel},
                                                                         {"tensors", shapes.size()},
                                                                         {"threads", threads},
                                                                         {"device", g_device.str()},
                                                                         {"copy_GBps", copy_gbps},
                                                                         {"rows", rows}},
                                                          "-J/--json")) {
    return 1;
  }
  return 0;
}
