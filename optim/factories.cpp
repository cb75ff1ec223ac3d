#include "decent_dp/optim/factories.h"

#include "decent_dp/errors.h"
#include "decent_dp/optim/adam.h"
#include "decent_dp/optim/schedulers.h"
#include "decent_dp/optim/sgd.h"

namespace decent_dp {
namespace optim {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Two groups, decayed first; empty groups are left out.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> split_groups(const NamedParams& named,
                                                            const DecayPredicate& decay,
                                                            const Options& options,
                                                            double weight_decay,
                                                            const char* factory) {
  DECENT_DP_CHECK_ARG(!named.empty(), factory,
                      ": the parameter list is empty; expected at least one (name, tensor)");
  std::vector<at::Tensor> decayed, undecayed;
  for (const auto& [name, p] : named) {
    DECENT_DP_CHECK_ARG(p.defined(), factory, ": parameter '", name, "' is undefined");
    const bool d = decay ? decay(name, p) : default_weight_decay(name, p);
    (d ? decayed : undecayed).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) {
    auto o = std::make_unique<Options>(options);
    o->weight_decay(weight_decay);
    groups.emplace_back(decayed, std::move(o));
  }
  if (!undecayed.empty()) {
    auto o = std::make_unique<Options>(options);
    o->weight_decay(0.0);
    groups.emplace_back(undecayed, std::move(o));
  }
  return groups;
}

template <typename Optimizer, typename Options, typename FactoryOptions>
OptimFn adam_like(const FactoryOptions& f, const char* factory,
                  std::function<void(Options&)> extra = nullptr) {
  Options options(f.lr);
  options.betas(std::make_tuple(f.beta1, f.beta2)).eps(f.eps).weight_decay(f.weight_decay);
  if (extra) {
    extra(options);
  }
  DECENT_DP_CHECK_ARG(f.weight_decay >= 0, factory, ": weight_decay must be >= 0, got ",
                      f.weight_decay);
  return
      [f, options, factory](const NamedParams& named) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<Optimizer>(
            split_groups(named, f.decay, options, f.weight_decay, factory), options);
      };
}

}  // namespace

bool default_weight_decay(const std::string& name, const at::Tensor& param) {
  return param.dim() >= 2 && !ends_with(name, "bias");
}

OptimFn adam(AdamFactoryOptions o) {
  return adam_like<Adam, AdamOptions>(o, "adam");
}

OptimFn adamw(AdamWFactoryOptions o) {
  return adam_like<AdamW, AdamWOptions>(o, "adamw");
}

OptimFn accum_adam(AccumAdamFactoryOptions o) {
  DECENT_DP_CHECK_ARG(o.accum_iter >= 1, "accum_adam: accum_iter must be >= 1, got ", o.accum_iter);
  return adam_like<AccumAdam, AccumAdamOptions>(
      o, "accum_adam", [k = o.accum_iter](AccumAdamOptions& x) { x.accum_iter(k); });
}

OptimFn accum_adamw(AccumAdamWFactoryOptions o) {
  DECENT_DP_CHECK_ARG(o.accum_iter >= 1, "accum_adamw: accum_iter must be >= 1, got ",
                      o.accum_iter);
  return adam_like<AccumAdamW, AccumAdamWOptions>(
      o, "accum_adamw", [k = o.accum_iter](AccumAdamWOptions& x) { x.accum_iter(k); });
}

OptimFn sgd(SgdFactoryOptions f) {
  SGDOptions options(f.lr);
  options.momentum(f.momentum)
      .dampening(f.dampening)
      .weight_decay(f.weight_decay)
      .nesterov(f.nesterov);
  return [f, options](const NamedParams& named) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<SGD>(split_groups(named, f.decay, options, f.weight_decay, "sgd"),
                                 options);
  };
}

LrSchedulerFn cosine_with_warmup(int64_t t_max, int64_t t_warmup, double warmup_decay,
                                 double eta_min) {
  return [=](torch::optim::Optimizer& o) {
    return std::make_unique<CosineWithWarmup>(o, t_max, t_warmup, warmup_decay, eta_min);
  };
}

LrSchedulerFn linear_warmup(int64_t t_warmup, double warmup_decay) {
  return [=](torch::optim::Optimizer& o) {
    return std::make_unique<LinearWarmup>(o, t_warmup, warmup_decay);
  };
}

LrSchedulerFn step_decay(int64_t step_size, double gamma) {
  return
      [=](torch::optim::Optimizer& o) { return std::make_unique<StepDecay>(o, step_size, gamma); };
}

LrSchedulerFn multistep_decay(std::vector<int64_t> milestones, double gamma) {
  return [=](torch::optim::Optimizer& o) {
    return std::make_unique<MultiStepDecay>(o, milestones, gamma);
  };
}

LrSchedulerFn inverse_sqrt_with_warmup(int64_t t_warmup, double warmup_decay) {
  return [=](torch::optim::Optimizer& o) {
    return std::make_unique<InverseSqrtWithWarmup>(o, t_warmup, warmup_decay);
  };
}

LrSchedulerFn constant_lr() {
  return [](torch::optim::Optimizer& o) { return std::make_unique<ConstantLR>(o); };
}

}  // namespace optim
}  // namespace decent_dp
