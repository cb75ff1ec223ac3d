// SGD with momentum, dampening, Nesterov momentum and weight decay, as torch::optim::SGD
// defines them, over flat buckets (Note [flat parameter groups]); ATen's fused kernel
// (at::_fused_sgd_) on CPU and CUDA.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <vector>

#include "decent_dp/optim/flat_cache.h"

namespace decent_dp {
namespace optim {

struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  explicit SGDOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class SGD final : public torch::optim::Optimizer {
 public:
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
               SGDOptions defaults);
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults)
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  int last_flat_groups() const { return last_flat_groups_; }

 private:
  SGDParamState& state_of(const at::Tensor& p);

  FlatCache flat_;
  int last_flat_groups_ = 0;
};

}  // namespace optim
}  // namespace decent_dp
