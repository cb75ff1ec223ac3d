// Factories that build one optimizer (and one scheduler) per bucket: the OptimFn and
// LrSchedulerFn that DecentralizedDataParallel takes (spec §6, §8).
//
// Parameter groups are split the conventional way: biases, normalization parameters and all
// other 1-D parameters get no weight decay; everything else gets the configured decay. A
// predicate can replace the rule.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace decent_dp {
namespace optim {

using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;
using OptimFn = std::function<std::unique_ptr<torch::optim::Optimizer>(const NamedParams&)>;
using LrSchedulerFn =
    std::function<std::unique_ptr<torch::optim::LRScheduler>(torch::optim::Optimizer&)>;
// True when the named parameter gets weight decay.
using DecayPredicate = std::function<bool(const std::string& name, const at::Tensor& param)>;

// The default rule: decay parameters of two or more dimensions whose name does not end in
// "bias" (Linear/Conv weights, embeddings); no decay for biases and 1-D parameters
// (normalization weights and biases).
bool default_weight_decay(const std::string& name, const at::Tensor& param);

struct AdamFactoryOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1.0 / 32768;  // L2, added to the gradient
  DecayPredicate decay;               // empty: default_weight_decay
};

struct AdamWFactoryOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled
  DecayPredicate decay;
};

struct AccumAdamFactoryOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1.0 / 32768;
  int64_t accum_iter = 4;
  DecayPredicate decay;
};

struct AccumAdamWFactoryOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.1;
  int64_t accum_iter = 4;
  DecayPredicate decay;
};

struct SgdFactoryOptions {
  double lr = 0.1;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  DecayPredicate decay;
};

OptimFn adam(AdamFactoryOptions options = {});
OptimFn adamw(AdamWFactoryOptions options = {});
OptimFn accum_adam(AccumAdamFactoryOptions options = {});
OptimFn accum_adamw(AccumAdamWFactoryOptions options = {});
OptimFn sgd(SgdFactoryOptions options = {});

// Scheduler factories (see optim/schedulers.h for the formulas).
LrSchedulerFn cosine_with_warmup(int64_t t_max, int64_t t_warmup = 0, double warmup_decay = 0.01,
                                 double eta_min = 0.0);
LrSchedulerFn linear_warmup(int64_t t_warmup, double warmup_decay = 0.01);
LrSchedulerFn step_decay(int64_t step_size, double gamma = 0.1);
LrSchedulerFn multistep_decay(std::vector<int64_t> milestones, double gamma = 0.1);
LrSchedulerFn inverse_sqrt_with_warmup(int64_t t_warmup, double warmup_decay = 0.01);
LrSchedulerFn constant_lr();

}  // namespace optim
}  // namespace decent_dp
