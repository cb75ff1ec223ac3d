#include "torch_catch.h"

#include <torch/torch.h>

#include <cmath>
#include <sstream>

#include "decent_dp/optim/adam.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/optim/schedulers.h"
#include "decent_dp/optim/sgd.h"

using namespace decent_dp;
using namespace decent_dp::optim;

namespace {

// Random shapes, odd sizes and an empty tensor.
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {1}, {0}, {4, 3, 2}, {33}, {2, 17}};

std::vector<at::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (const auto& s : kShapes) {
    out.push_back(torch::randn(s).requires_grad_(true));
  }
  return out;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.detach().clone().requires_grad_(true));
  }
  return out;
}

// Parameters and gradients as views of two flat blocks with 32-element alignment and zero
// padding, like DecentralizedDataParallel's buckets.
struct FlatParams {
  at::Tensor param_block, grad_block;
  std::vector<at::Tensor> params;
};

// The blocks take the dtype of `like`.
FlatParams make_flat(const std::vector<at::Tensor>& like) {
  FlatParams f;
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (const auto& p : like) {
    offsets.push_back(total);
    total += (p.numel() + 31) / 32 * 32;
  }
  const auto options = at::TensorOptions().dtype(like.front().scalar_type());
  f.param_block = torch::zeros({total}, options);
  f.grad_block = torch::zeros({total}, options);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < like.size(); ++i) {
    auto view = f.param_block.narrow(0, offsets[i], like[i].numel()).view(like[i].sizes());
    view.copy_(like[i]);
    auto p = torch::empty({0});
    p.set_data(view);
    p.requires_grad_(true);
    p.mutable_grad() = f.grad_block.narrow(0, offsets[i], like[i].numel()).view(like[i].sizes());
    f.params.push_back(p);
  }
  return f;
}

// Gradient of step `step` for parameter i: deterministic, the same for every copy.
at::Tensor grad_for(size_t i, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + i);
  return at::randn(kShapes[i], gen);
}

void set_grads(std::vector<at::Tensor>& params, int step) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto g = grad_for(i, step);
    if (params[i].grad().defined()) {
      params[i].mutable_grad().copy_(g);  // flat: stays a view of the gradient block
    } else {
      params[i].mutable_grad() = g;
    }
  }
}

// Relative error ||a - b|| / ||b|| of every tensor pair at most `rtol` (0: bit-identical).
void check_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double rtol) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (rtol == 0.0) {
      INFO("tensor " << i << " shape " << a[i].sizes());
      CHECK(torch::equal(a[i], b[i]));
      continue;
    }
    const double diff = (a[i] - b[i]).norm().item<double>();
    const double ref = b[i].norm().item<double>();
    INFO("tensor " << i << " shape " << a[i].sizes() << " ||a - b|| " << diff << " ||b|| " << ref);
    CHECK(diff <= rtol * ref);
  }
}

template <typename Ours, typename Theirs>
void run_pair(Ours& ours, std::vector<at::Tensor>& ours_params, Theirs& theirs,
              std::vector<at::Tensor>& theirs_params, int steps) {
  for (int step = 0; step < steps; ++step) {
    set_grads(ours_params, step);
    set_grads(theirs_params, step);
    ours.step();
    theirs.step();
  }
}

}  // namespace

TEST_CASE("Adam, AdamW and SGD match torch::optim over 100 steps, flat and per tensor", "[optim]") {
  const auto init = make_params(1);
  SECTION("Adam") {
    for (double wd : {0.0, 0.01}) {
      auto ref = clone_params(init);
      torch::optim::Adam theirs(ref, torch::optim::AdamOptions(1e-2).weight_decay(wd));
      auto mine = clone_params(init);
      Adam ours(mine, AdamOptions(1e-2).weight_decay(wd));
      run_pair(ours, mine, theirs, ref, 100);
      CHECK(ours.last_flat_groups() == 0);
      check_close(mine, ref, 1e-6);

      auto flat = make_flat(init);
      Adam flat_opt(flat.params, AdamOptions(1e-2).weight_decay(wd));
      auto ref2 = clone_params(init);
      torch::optim::Adam theirs2(ref2, torch::optim::AdamOptions(1e-2).weight_decay(wd));
      run_pair(flat_opt, flat.params, theirs2, ref2, 100);
      CHECK(flat_opt.last_flat_groups() == 1);
      check_close(flat.params, ref2, 1e-6);
      // The flat and per-tensor paths agree (same kernel; vector and scalar lanes may round
      // differently in the last bit).
      check_close(flat.params, mine, 1e-6);
      // Padding stays zero.
      CHECK(flat.param_block.sum().item<double>() ==
            Approx(torch::cat({flat.params[0].flatten(), flat.params[1].flatten(),
                               flat.params[2].flatten(), flat.params[4].flatten(),
                               flat.params[5].flatten(), flat.params[6].flatten()})
                       .sum()
                       .item<double>()));
    }
  }
  SECTION("AdamW") {
    auto ref = clone_params(init);
    torch::optim::AdamW theirs(ref, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto flat = make_flat(init);
    AdamW ours(flat.params, AdamWOptions(1e-2).weight_decay(0.1));
    run_pair(ours, flat.params, theirs, ref, 100);
    CHECK(ours.last_flat_groups() == 1);
    check_close(flat.params, ref, 1e-6);
  }
  SECTION("SGD") {
    struct Case {
      double momentum, dampening, wd;
      bool nesterov;
    };
    for (const Case c : {Case{0, 0, 0, false}, Case{0.9, 0, 0.01, false}, Case{0.9, 0.1, 0, false},
                         Case{0.9, 0, 1e-3, true}}) {
      INFO("momentum " << c.momentum << " dampening " << c.dampening << " wd " << c.wd
                       << " nesterov " << c.nesterov);
      auto ref = clone_params(init);
      torch::optim::SGD theirs(ref, torch::optim::SGDOptions(0.05)
                                        .momentum(c.momentum)
                                        .dampening(c.dampening)
                                        .weight_decay(c.wd)
                                        .nesterov(c.nesterov));
      auto opts = SGDOptions(0.05)
                      .momentum(c.momentum)
                      .dampening(c.dampening)
                      .weight_decay(c.wd)
                      .nesterov(c.nesterov);
      auto mine = clone_params(init);
      SGD ours(mine, opts);
      auto flat = make_flat(init);
      SGD flat_opt(flat.params, opts);
      for (int step = 0; step < 100; ++step) {
        set_grads(ref, step);
        set_grads(mine, step);
        set_grads(flat.params, step);
        theirs.step();
        ours.step();
        flat_opt.step();
      }
      CHECK(flat_opt.last_flat_groups() == 1);
      check_close(mine, ref, 1e-6);
      check_close(flat.params, ref, 1e-6);
      check_close(flat.params, mine, 1e-6);
    }
  }
}

namespace {

// Spec §8, element by element, in float as the optimizer computes.
struct AccumReference {
  std::vector<float> p, m, v, acc;
  void step(const std::vector<float>& g_in, int64_t t, int64_t K, double lr, double wd,
            bool decoupled) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const int64_t r = (t + K - 1) / K;
    const double bc1 = 1 - std::pow(b1, r), bc2 = 1 - std::pow(b2, r);
    for (size_t i = 0; i < p.size(); ++i) {
      float g = g_in[i];
      if (decoupled) {
        p[i] *= static_cast<float>(1 - lr * wd);
      } else {
        g += static_cast<float>(wd) * p[i];
      }
      acc[i] += g * static_cast<float>(1.0 / K);
      const float m_hat = m[i] + static_cast<float>(1 - b1) * g;
      const float v_hat = v[i] + static_cast<float>(1 - b2) * g * g;
      p[i] -= static_cast<float>(lr / bc1) * m_hat /
              (std::sqrt(v_hat) * static_cast<float>(1 / std::sqrt(bc2)) + static_cast<float>(eps));
      if (t % K == 0) {
        m[i] = static_cast<float>(b1) * (m[i] + static_cast<float>(1 - b1) * acc[i]);
        v[i] = static_cast<float>(b2) * (v[i] + static_cast<float>(1 - b2) * acc[i] * acc[i]);
        acc[i] = 0;
      }
    }
  }
};

}  // namespace

TEST_CASE("AccumAdam(W) match a plain implementation of spec section 8", "[optim]") {
  for (bool decoupled : {false, true}) {
    for (int64_t K : {1, 4, 8}) {
      INFO("K " << K << " decoupled " << decoupled);
      const auto init = make_params(7);
      const double lr = 1e-2, wd = decoupled ? 0.1 : 1e-3;
      auto flat = make_flat(init);
      auto per_tensor = clone_params(init);
      std::unique_ptr<torch::optim::Optimizer> a, b;
      if (decoupled) {
        a = std::make_unique<AccumAdamW>(flat.params,
                                         AccumAdamWOptions(lr).weight_decay(wd).accum_iter(K));
        b = std::make_unique<AccumAdamW>(per_tensor,
                                         AccumAdamWOptions(lr).weight_decay(wd).accum_iter(K));
      } else {
        a = std::make_unique<AccumAdam>(flat.params,
                                        AccumAdamOptions(lr).weight_decay(wd).accum_iter(K));
        b = std::make_unique<AccumAdam>(per_tensor,
                                        AccumAdamOptions(lr).weight_decay(wd).accum_iter(K));
      }
      std::vector<AccumReference> ref(init.size());
      for (size_t i = 0; i < init.size(); ++i) {
        auto c = init[i].detach().contiguous();
        ref[i].p.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
        ref[i].m.assign(c.numel(), 0.f);
        ref[i].v.assign(c.numel(), 0.f);
        ref[i].acc.assign(c.numel(), 0.f);
      }
      const int steps = static_cast<int>(3 * K + 1);
      for (int step = 0; step < steps; ++step) {
        set_grads(flat.params, step);
        set_grads(per_tensor, step);
        a->step();
        b->step();
        for (size_t i = 0; i < init.size(); ++i) {
          auto g = grad_for(i, step).contiguous();
          ref[i].step(std::vector<float>(g.data_ptr<float>(), g.data_ptr<float>() + g.numel()),
                      step + 1, K, lr, wd, decoupled);
        }
      }
      std::vector<at::Tensor> expected;
      for (size_t i = 0; i < init.size(); ++i) {
        expected.push_back(torch::from_blob(ref[i].p.data(), kShapes[i]).clone());
      }
      check_close(flat.params, expected, 1e-6);
      check_close(per_tensor, expected, 1e-6);
      check_close(flat.params, per_tensor, 1e-6);
    }
  }
  // With K = 1 AccumAdam is Adam.
  const auto init = make_params(9);
  auto x = clone_params(init);
  auto y = clone_params(init);
  AccumAdam accum(x, AccumAdamOptions(1e-2).weight_decay(1e-3).accum_iter(1));
  torch::optim::Adam adam(y, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  run_pair(accum, x, adam, y, 50);
  check_close(x, y, 1e-5);
}

TEST_CASE("schedulers follow their closed forms", "[optim]") {
  auto p = torch::zeros({2}).requires_grad_(true);
  auto make = [&] {
    return std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                               torch::optim::SGDOptions(0.5));
  };
  auto lr_of = [](torch::optim::Optimizer& o) { return o.param_groups()[0].options().get_lr(); };
  auto run = [&](torch::optim::Optimizer& o, torch::optim::LRScheduler& s, int64_t k) {
    for (int64_t i = 0; i < k; ++i)
      s.step();
    return lr_of(o);
  };
  {
    auto o = make();
    CosineWithWarmup s(*o, /*t_max=*/10, /*t_warmup=*/4, /*warmup_decay=*/0.1, /*eta_min=*/0.01);
    CHECK(lr_of(*o) == Approx(0.5 * 0.1));                        // t = 0
    CHECK(run(*o, s, 2) == Approx(0.5 * (0.1 + 0.9 * 2 / 4.0)));  // t = 2
    CHECK(run(*o, s, 2) == Approx(0.5));                          // t = 4: end of warmup
    CHECK(run(*o, s, 5) == Approx(0.01 + 0.49 * (1 + std::cos(M_PI * 0.5)) / 2));  // t = 9
    CHECK(run(*o, s, 5) == Approx(0.01));                                          // t = 14
    CHECK(run(*o, s, 3) == Approx(0.01));                                          // later
  }
  {
    auto o = make();
    LinearWarmup s(*o, 5, 0.0);
    CHECK(lr_of(*o) == Approx(0.0));
    CHECK(run(*o, s, 1) == Approx(0.1));
    CHECK(run(*o, s, 4) == Approx(0.5));
    CHECK(run(*o, s, 10) == Approx(0.5));
  }
  {
    auto o = make();
    StepDecay s(*o, 3, 0.5);
    CHECK(lr_of(*o) == Approx(0.5));
    CHECK(run(*o, s, 2) == Approx(0.5));
    CHECK(run(*o, s, 1) == Approx(0.25));
    CHECK(run(*o, s, 3) == Approx(0.125));
  }
  {
    auto o = make();
    MultiStepDecay s(*o, {2, 5}, 0.1);
    CHECK(run(*o, s, 1) == Approx(0.5));
    CHECK(run(*o, s, 1) == Approx(0.05));
    CHECK(run(*o, s, 3) == Approx(0.005));
  }
  {
    auto o = make();
    InverseSqrtWithWarmup s(*o, 4, 0.0);
    CHECK(run(*o, s, 2) == Approx(0.25));
    CHECK(run(*o, s, 2) == Approx(0.5));
    CHECK(run(*o, s, 12) == Approx(0.5 * std::sqrt(4.0 / 16.0)));
  }
  {
    auto o = make();
    ConstantLR s(*o);
    CHECK(run(*o, s, 7) == Approx(0.5));
  }
  {
    // Two groups keep their own base rates; the factory builds the same scheduler.
    auto q = torch::zeros({2}).requires_grad_(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{p},
                        std::make_unique<torch::optim::SGDOptions>(1.0));
    groups.emplace_back(std::vector<at::Tensor>{q},
                        std::make_unique<torch::optim::SGDOptions>(0.1));
    torch::optim::SGD o(groups, torch::optim::SGDOptions(1.0));
    auto s = step_decay(1, 0.5)(o);
    s->step();
    CHECK(o.param_groups()[0].options().get_lr() == Approx(0.5));
    CHECK(o.param_groups()[1].options().get_lr() == Approx(0.05));
  }
  auto o = make();
  CHECK_THROWS_WITH(CosineWithWarmup(*o, 0), Catch::Contains("t_max must be >= 1, got 0"));
  CHECK_THROWS_WITH(LinearWarmup(*o, 3, 2.0),
                    Catch::Contains("warmup_decay must be in [0, 1], got 2"));
}

TEST_CASE("save, load and continue is bit-identical to an uninterrupted run", "[optim]") {
  const auto init = make_params(3);
  auto check_resume = [&](auto make_optimizer) {
    // Uninterrupted.
    auto a = make_flat(init);
    auto opt_a = make_optimizer(a.params);
    for (int step = 0; step < 10; ++step) {
      set_grads(a.params, step);
      opt_a->step();
    }
    // Interrupted after 6 steps: parameters and optimizer state go through archives.
    auto b = make_flat(init);
    auto opt_b = make_optimizer(b.params);
    for (int step = 0; step < 6; ++step) {
      set_grads(b.params, step);
      opt_b->step();
    }
    std::stringstream buffer;
    {
      torch::serialize::OutputArchive archive;
      opt_b->save(archive);
      archive.save_to(buffer);
    }
    auto c = make_flat(b.params);  // same values, new storage, like a restarted process
    auto opt_c = make_optimizer(c.params);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(buffer);
      opt_c->load(archive);
    }
    for (int step = 6; step < 10; ++step) {
      set_grads(c.params, step);
      opt_c->step();
    }
    check_close(c.params, a.params, 0.0);
  };
  SECTION("AdamW") {
    check_resume(
        [](std::vector<at::Tensor>& p) { return std::make_unique<AdamW>(p, AdamWOptions(1e-2)); });
  }
  SECTION("AccumAdamW keeps its accumulator") {
    check_resume([](std::vector<at::Tensor>& p) {
      return std::make_unique<AccumAdamW>(p, AccumAdamWOptions(1e-2).accum_iter(4));
    });
  }
  SECTION("SGD with momentum") {
    check_resume([](std::vector<at::Tensor>& p) {
      return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9).nesterov(true));
    });
  }
}

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(2));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    emb = register_module("emb", torch::nn::Embedding(10, 4));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Embedding emb{nullptr};
};

std::set<std::string> names_in_group(const torch::optim::Optimizer& o, size_t g,
                                     const NamedParams& named) {
  std::set<std::string> out;
  for (const auto& p : o.param_groups()[g].params()) {
    for (const auto& [name, q] : named) {
      if (q.is_same(p))
        out.insert(name);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("factories split weight decay the conventional way", "[optim]") {
  Net net;
  NamedParams named;
  for (const auto& item : net.named_parameters()) {
    named.emplace_back(item.key(), item.value());
  }
  auto opt = adamw()(named);
  REQUIRE(opt->param_groups().size() == 2);
  CHECK(names_in_group(*opt, 0, named) ==
        std::set<std::string>{"fc.weight", "conv.weight", "emb.weight"});
  CHECK(names_in_group(*opt, 1, named) == std::set<std::string>{"fc.bias", "conv.bias", "bn.weight",
                                                                "bn.bias", "ln.weight", "ln.bias"});
  CHECK(static_cast<AdamWOptions&>(opt->param_groups()[0].options()).weight_decay() == 0.1);
  CHECK(static_cast<AdamWOptions&>(opt->param_groups()[1].options()).weight_decay() == 0.0);
  // Spec defaults.
  auto adam_opt = adam()(named);
  const auto& ao = static_cast<AdamOptions&>(adam_opt->param_groups()[0].options());
  CHECK(ao.lr() == 1e-3);
  CHECK(ao.weight_decay() == 1.0 / 32768);
  CHECK(std::get<0>(ao.betas()) == 0.9);
  auto accum = accum_adamw()(named);
  CHECK(static_cast<AccumAdamWOptions&>(accum->param_groups()[0].options()).accum_iter() == 4);
  // A user predicate replaces the rule: decay everything.
  AdamWFactoryOptions all;
  all.decay = [](const std::string&, const at::Tensor&) { return true; };
  CHECK(adamw(all)(named)->param_groups().size() == 1);
  CHECK_THROWS_WITH(adamw()(NamedParams{}), Catch::Contains("the parameter list is empty"));
  AccumAdamFactoryOptions bad;
  bad.accum_iter = 0;
  CHECK_THROWS_WITH(accum_adam(bad), Catch::Contains("accum_iter must be >= 1, got 0"));
  CHECK_THROWS_WITH(Adam(std::vector<at::Tensor>{torch::zeros({1})}, AdamOptions(-1.0)),
                    Catch::Contains("Adam: lr must be >= 0, got -1"));
  CHECK_THROWS_WITH(SGD(std::vector<at::Tensor>{torch::zeros({1})}, SGDOptions(0.1).nesterov(true)),
                    Catch::Contains("nesterov needs momentum > 0"));
}

TEST_CASE("a channels-last parameter steps as its contiguous twin, bit for bit", "[optim]") {
  // A channels-last conv weight, alone (tensor by tensor) or as a view of a flat block with
  // its gradient apart (DecentralizedDataParallel's layout, Note [gradients in place]), is
  // stepped in memory order by the single-pass kernels, as its contiguous twin is.
  using MakeOpt = std::function<std::unique_ptr<torch::optim::Optimizer>(at::Tensor)>;
  const std::vector<std::pair<const char*, MakeOpt>> optimizers = {
      {"AdamW",
       [](at::Tensor p) {
         return std::make_unique<AdamW>(std::vector<at::Tensor>{p},
                                        AdamWOptions(1e-2).weight_decay(0.1));
       }},
      {"AccumAdamW",
       [](at::Tensor p) {
         return std::make_unique<AccumAdamW>(std::vector<at::Tensor>{p},
                                             AccumAdamWOptions(1e-2).weight_decay(0.1));
       }},
      {"SGD momentum", [](at::Tensor p) {
         return std::make_unique<SGD>(std::vector<at::Tensor>{p},
                                      SGDOptions(0.05).momentum(0.9).nesterov(true));
       }}};
  const std::vector<int64_t> shape = {8, 5, 3, 3};
  for (const auto& [name, make] : optimizers) {
    for (bool in_block : {false, true}) {
      INFO(name << (in_block ? ", a view of a flat block" : ", alone"));
      torch::manual_seed(3);
      const at::Tensor w = torch::randn(shape);
      const auto cl_strides = w.contiguous(at::MemoryFormat::ChannelsLast).strides().vec();
      at::Tensor block, cl;
      torch::NoGradGuard no_grad;
      if (in_block) {
        block = torch::zeros({w.numel() + 32});
        auto view = block.as_strided(shape, cl_strides, 32);
        view.copy_(w);
        cl = torch::empty({0});
        cl.set_data(view);
      } else {
        cl = w.contiguous(at::MemoryFormat::ChannelsLast).clone(at::MemoryFormat::Preserve);
      }
      REQUIRE(cl.is_contiguous(at::MemoryFormat::ChannelsLast));
      REQUIRE_FALSE(cl.is_contiguous());
      cl.requires_grad_(true);
      at::Tensor twin = w.clone().requires_grad_(true);
      auto opt_cl = make(cl);
      auto opt_twin = make(twin);
      for (int step = 0; step < 6; ++step) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
        const at::Tensor g = at::randn(shape, gen);
        cl.mutable_grad() = g.contiguous(at::MemoryFormat::ChannelsLast);
        twin.mutable_grad() = g.clone();
        opt_cl->step();
        opt_twin->step();
      }
      CHECK(torch::equal(cl, twin));
      if (in_block) {
        CHECK(cl.data_ptr() == block.as_strided(shape, cl_strides, 32).data_ptr());
      }
    }
  }
}

TEST_CASE("bfloat16 and float16 parameters step as the float32 formula, rounded", "[optim]") {
  // Every element moves: torch 2.11's CPU _fused_sgd_ skips the vectorized blocks of float16
  // and bfloat16 tensors (pytorch/pytorch#191763), so SGD steps those through ATen operations.
  // Reference: the same optimizer on float32 copies; the low-precision run may differ by its
  // rounding only (the kernels compute in float32 and round each step's result).
  using MakeOpt = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  const std::vector<std::pair<const char*, MakeOpt>> optimizers = {
      {"Adam", [](auto p) { return std::make_unique<Adam>(p, AdamOptions(1e-2)); }},
      {"AdamW",
       [](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(1e-2).weight_decay(0.1)); }},
      {"AccumAdamW",
       [](auto p) {
         return std::make_unique<AccumAdamW>(p, AccumAdamWOptions(1e-2).accum_iter(2));
       }},
      {"SGD", [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.05)); }},
      {"SGD momentum, weight decay", [](auto p) {
         return std::make_unique<SGD>(p, SGDOptions(0.05).momentum(0.9).weight_decay(1e-2));
       }}};
  const std::vector<int64_t> sizes = {5, 8, 64, 1003};  // under and over a vector's width
  // The Adam family warns once per process about float16 state (Note [float16 Adam state]);
  // no other test of this program steps float16 parameters with it.
  struct Collect final : c10::WarningHandler {
    std::vector<std::string> seen;
    void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
  } collect;
  c10::WarningUtils::WarningHandlerGuard guard(&collect);
  for (const auto& [name, make] : optimizers) {
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      for (bool flat : {false, true}) {
        INFO(name << " " << dtype << (flat ? ", flat" : ", per tensor"));
        torch::manual_seed(9);
        std::vector<at::Tensor> ref, low;
        for (auto n : sizes) {
          ref.push_back(torch::randn({n}).to(dtype).to(at::kFloat).requires_grad_(true));
          low.push_back(ref.back().detach().to(dtype).requires_grad_(true));
        }
        if (flat) {
          low = make_flat(low).params;  // views of one block of the dtype
        }
        torch::NoGradGuard no_grad;
        auto opt_ref = make(ref);
        auto opt_low = make(low);
        for (int step = 0; step < 10; ++step) {
          for (size_t i = 0; i < ref.size(); ++i) {
            auto gen = at::make_generator<at::CPUGeneratorImpl>(31 * step + i);
            const auto g = at::randn({sizes[i]}, gen).to(dtype);
            ref[i].mutable_grad() = g.to(at::kFloat);
            low[i].mutable_grad() = g.clone();
          }
          opt_ref->step();
          opt_low->step();
        }
        for (size_t i = 0; i < ref.size(); ++i) {
          INFO("size " << sizes[i]);
          CHECK(low[i].scalar_type() == dtype);
          const double diff = (low[i].to(at::kFloat) - ref[i]).norm().item<double>();
          // Measured: bfloat16 0.8% apart at most (a 5-element tensor), float16 0.09%; a
          // step skipped is 10% or more.
          CHECK(diff <= (dtype == at::kBFloat16 ? 2e-2 : 2e-3) * ref[i].norm().item<double>());
        }
      }
    }
  }
  REQUIRE(collect.seen.size() == 1);
  CHECK_THAT(collect.seen[0], Catch::Contains("Adam steps float16 parameters with its moments in "
                                              "float16: the second moment underflows for "
                                              "gradients under 0.0077"));
}
