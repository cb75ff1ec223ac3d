#include "decent_dp/optim/schedulers.h"

#include <algorithm>
#include <cmath>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace optim {
namespace {

double warmup(double base, int64_t t, int64_t t_warmup, double warmup_decay) {
  return base * (warmup_decay +
                 (1.0 - warmup_decay) * static_cast<double>(t) / static_cast<double>(t_warmup));
}

void check_decay(double warmup_decay, const char* name) {
  DECENT_DP_CHECK_ARG(warmup_decay >= 0 && warmup_decay <= 1, name,
                      ": warmup_decay must be in [0, 1], got ", warmup_decay);
}

}  // namespace

ClosedFormScheduler::ClosedFormScheduler(torch::optim::Optimizer& optimizer)
    : LRScheduler(optimizer), optimizer_(optimizer), base_lrs_(get_current_lrs()) {}

void ClosedFormScheduler::apply_initial() {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i].options().set_lr(lr_at(base_lrs_[i], 0));
  }
}

void ClosedFormScheduler::set_steps(int64_t t) {
  TORCH_CHECK(t >= 0, "set_steps: t must be >= 0, got ", t);
  step_count_ = static_cast<unsigned>(t);
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i].options().set_lr(lr_at(base_lrs_[i], t));
  }
}

std::vector<double> ClosedFormScheduler::get_lrs() {
  // LRScheduler::step() calls this before counting the step: this is step number
  // step_count_ + 1.
  std::vector<double> out(base_lrs_.size());
  for (size_t i = 0; i < base_lrs_.size(); ++i) {
    out[i] = lr_at(base_lrs_[i], static_cast<int64_t>(step_count_) + 1);
  }
  return out;
}

CosineWithWarmup::CosineWithWarmup(torch::optim::Optimizer& optimizer, int64_t t_max,
                                   int64_t t_warmup, double warmup_decay, double eta_min)
    : ClosedFormScheduler(optimizer),
      t_max_(t_max),
      t_warmup_(t_warmup),
      warmup_decay_(warmup_decay),
      eta_min_(eta_min) {
  DECENT_DP_CHECK_ARG(t_max >= 1, "CosineWithWarmup: t_max must be >= 1, got ", t_max);
  DECENT_DP_CHECK_ARG(t_warmup >= 0, "CosineWithWarmup: t_warmup must be >= 0, got ", t_warmup);
  DECENT_DP_CHECK_ARG(eta_min >= 0, "CosineWithWarmup: eta_min must be >= 0, got ", eta_min);
  check_decay(warmup_decay, "CosineWithWarmup");
  apply_initial();
}

double CosineWithWarmup::lr_at(double base, int64_t t) const {
  if (t < t_warmup_) {
    return warmup(base, t, t_warmup_, warmup_decay_);
  }
  if (t >= t_warmup_ + t_max_) {
    return eta_min_;
  }
  const double progress = static_cast<double>(t - t_warmup_) / static_cast<double>(t_max_);
  return eta_min_ + (base - eta_min_) * (1.0 + std::cos(M_PI * progress)) / 2.0;
}

LinearWarmup::LinearWarmup(torch::optim::Optimizer& optimizer, int64_t t_warmup,
                           double warmup_decay)
    : ClosedFormScheduler(optimizer), t_warmup_(t_warmup), warmup_decay_(warmup_decay) {
  DECENT_DP_CHECK_ARG(t_warmup >= 0, "LinearWarmup: t_warmup must be >= 0, got ", t_warmup);
  check_decay(warmup_decay, "LinearWarmup");
  apply_initial();
}

double LinearWarmup::lr_at(double base, int64_t t) const {
  return t < t_warmup_ ? warmup(base, t, t_warmup_, warmup_decay_) : base;
}

StepDecay::StepDecay(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma)
    : ClosedFormScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  DECENT_DP_CHECK_ARG(step_size >= 1, "StepDecay: step_size must be >= 1, got ", step_size);
  DECENT_DP_CHECK_ARG(gamma > 0, "StepDecay: gamma must be > 0, got ", gamma);
  apply_initial();
}

double StepDecay::lr_at(double base, int64_t t) const {
  return base * std::pow(gamma_, static_cast<double>(t / step_size_));
}

MultiStepDecay::MultiStepDecay(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones,
                               double gamma)
    : ClosedFormScheduler(optimizer), milestones_(std::move(milestones)), gamma_(gamma) {
  DECENT_DP_CHECK_ARG(std::is_sorted(milestones_.begin(), milestones_.end()),
                      "MultiStepDecay: milestones must be in ascending order");
  DECENT_DP_CHECK_ARG(gamma > 0, "MultiStepDecay: gamma must be > 0, got ", gamma);
  apply_initial();
}

double MultiStepDecay::lr_at(double base, int64_t t) const {
  const auto passed =
      std::upper_bound(milestones_.begin(), milestones_.end(), t) - milestones_.begin();
  return base * std::pow(gamma_, static_cast<double>(passed));
}

InverseSqrtWithWarmup::InverseSqrtWithWarmup(torch::optim::Optimizer& optimizer, int64_t t_warmup,
                                             double warmup_decay)
    : ClosedFormScheduler(optimizer), t_warmup_(t_warmup), warmup_decay_(warmup_decay) {
  DECENT_DP_CHECK_ARG(t_warmup >= 1, "InverseSqrtWithWarmup: t_warmup must be >= 1, got ",
                      t_warmup);
  check_decay(warmup_decay, "InverseSqrtWithWarmup");
  apply_initial();
}

double InverseSqrtWithWarmup::lr_at(double base, int64_t t) const {
  if (t < t_warmup_) {
    return warmup(base, t, t_warmup_, warmup_decay_);
  }
  return base * std::sqrt(static_cast<double>(t_warmup_) / static_cast<double>(t));
}

ConstantLR::ConstantLR(torch::optim::Optimizer& optimizer) : ClosedFormScheduler(optimizer) {
  apply_initial();
}

}  // namespace optim
}  // namespace decent_dp
