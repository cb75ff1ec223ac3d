// The Adam family over flat buckets: Adam, AdamW, AccumAdam, AccumAdamW (spec §8).
//
// Each derives from torch::optim::Optimizer, so parameter groups, learning-rate changes by
// schedulers and state serialization work the LibTorch way. A parameter group whose
// parameters are views of one flat block keeps flat state blocks and is stepped in one pass
// (gradients in a block of the same layout) or one fused call over the views (Note [flat
// parameter groups] in optim/flat_layout.h); other groups are stepped tensor by tensor. Adam and
// AdamW run ATen's fused kernels (at::_fused_adam_, at::_fused_adamw_) on CPU and CUDA;
// AccumAdam(W) runs its own single-pass CPU kernel.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

#include "decent_dp/optim/flat_cache.h"

namespace decent_dp {
namespace optim {

#define DECENT_DP_ADAM_OPTIONS_BODY(Name, default_weight_decay)            \
  explicit Name(double lr = 1e-3) : lr_(lr) {}                             \
  TORCH_ARG(double, lr);                                                   \
  typedef std::tuple<double, double> betas_t;                              \
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);                 \
  TORCH_ARG(double, eps) = 1e-8;                                           \
  TORCH_ARG(double, weight_decay) = default_weight_decay;                  \
                                                                           \
 public:                                                                   \
  void serialize(torch::serialize::InputArchive& archive) override;        \
  void serialize(torch::serialize::OutputArchive& archive) const override; \
  double get_lr() const override {                                         \
    return lr();                                                           \
  }                                                                        \
  void set_lr(const double lr) override {                                  \
    this->lr(lr);                                                          \
  }

// Adam: L2 weight decay added to the gradient (torch::optim::Adam's defaults).
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  DECENT_DP_ADAM_OPTIONS_BODY(AdamOptions, 0.0)
};

// AdamW: decoupled weight decay p *= 1 - lr * wd (torch::optim::AdamW's defaults).
struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  DECENT_DP_ADAM_OPTIONS_BODY(AdamWOptions, 1e-2)
};

// AccumAdam: the moments absorb the K-step average gradient (K = accum_iter).
struct AccumAdamOptions : public torch::optim::OptimizerCloneableOptions<AccumAdamOptions> {
  DECENT_DP_ADAM_OPTIONS_BODY(AccumAdamOptions, 0.0)
  TORCH_ARG(int64_t, accum_iter) = 4;
};

struct AccumAdamWOptions : public torch::optim::OptimizerCloneableOptions<AccumAdamWOptions> {
  DECENT_DP_ADAM_OPTIONS_BODY(AccumAdamWOptions, 1e-2)
  TORCH_ARG(int64_t, accum_iter) = 4;
};

#undef DECENT_DP_ADAM_OPTIONS_BODY

// Per-parameter state of the Adam family. In a flat group the tensors are views into the
// group's flat state blocks. `accum` is defined for AccumAdam(W) only.
struct AdamFamilyParamState
    : public torch::optim::OptimizerCloneableParamState<AdamFamilyParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, accum);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

enum class AdamVariant { kAdam, kAdamW, kAccumAdam, kAccumAdamW };

template <typename Options, AdamVariant kVariant>
class AdamFamily : public torch::optim::Optimizer {
 public:
  explicit AdamFamily(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      Options defaults = Options());
  explicit AdamFamily(std::vector<at::Tensor> params, Options defaults = Options())
      : AdamFamily({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Number of groups stepped in one pass over flat blocks by the last step().
  int last_flat_groups() const { return last_flat_groups_; }

 private:
  AdamFamilyParamState& state_of(const at::Tensor& p);
  void step_group(const Options& options, const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& grads, FlatCache::Entry* flat);

  FlatCache flat_;
  int last_flat_groups_ = 0;
};

class Adam final : public AdamFamily<AdamOptions, AdamVariant::kAdam> {
 public:
  using AdamFamily::AdamFamily;
};

class AdamW final : public AdamFamily<AdamWOptions, AdamVariant::kAdamW> {
 public:
  using AdamFamily::AdamFamily;
};

class AccumAdam final : public AdamFamily<AccumAdamOptions, AdamVariant::kAccumAdam> {
 public:
  using AdamFamily::AdamFamily;
};

class AccumAdamW final : public AdamFamily<AccumAdamWOptions, AdamVariant::kAccumAdamW> {
 public:
  using AdamFamily::AdamFamily;
};

}  // namespace optim
}  // namespace decent_dp
