// Learning-rate schedulers (spec §8), deriving from torch::optim::LRScheduler.
//
// Each computes lr(t) in closed form from the base learning rate of every parameter group
// (the group's lr when the scheduler is constructed). The constructor already sets lr(0);
// after k calls to step() every group's lr is lr(k).
#pragma once

#include <torch/optim/schedulers/lr_scheduler.h>

#include <vector>

namespace decent_dp {
namespace optim {

class ClosedFormScheduler : public torch::optim::LRScheduler {
 public:
  explicit ClosedFormScheduler(torch::optim::Optimizer& optimizer);
  // The learning rate after t steps of a group whose base learning rate is `base`.
  virtual double lr_at(double base, int64_t t) const = 0;
  // Number of step() calls so far.
  int64_t steps() const { return static_cast<int64_t>(step_count_); }
  // As if step() had been called `t` (>= 0) times since construction: sets every group's
  // lr to lr(t) (a checkpoint's resume).
  void set_steps(int64_t t);
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 protected:
  // Sets lr(0); derived constructors call it once their fields are set.
  void apply_initial();

 private:
  std::vector<double> get_lrs() override;

  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_lrs_;
};

// Linear warmup from warmup_decay * base over t_warmup steps, then a half cosine from base
// down to eta_min over t_max steps, then eta_min:
//   t <  t_warmup:            base * (warmup_decay + (1 - warmup_decay) * t / t_warmup)
//   t_warmup <= t < t_w + t_max: eta_min + (base - eta_min) * (1 + cos(pi (t - t_warmup) / t_max))
//   / 2 later:                    eta_min
// (eta_min is absolute, the same for every group.)
class CosineWithWarmup final : public ClosedFormScheduler {
 public:
  CosineWithWarmup(torch::optim::Optimizer& optimizer, int64_t t_max, int64_t t_warmup = 0,
                   double warmup_decay = 0.01, double eta_min = 0.0);
  double lr_at(double base, int64_t t) const override;

 private:
  int64_t t_max_, t_warmup_;
  double warmup_decay_, eta_min_;
};

// base * (warmup_decay + (1 - warmup_decay) * t / t_warmup) for t < t_warmup, then base.
class LinearWarmup final : public ClosedFormScheduler {
 public:
  LinearWarmup(torch::optim::Optimizer& optimizer, int64_t t_warmup, double warmup_decay = 0.01);
  double lr_at(double base, int64_t t) const override;

 private:
  int64_t t_warmup_;
  double warmup_decay_;
};

// base * gamma^floor(t / step_size).
class StepDecay final : public ClosedFormScheduler {
 public:
  StepDecay(torch::optim::Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(double base, int64_t t) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// base * gamma^(number of milestones <= t).
class MultiStepDecay final : public ClosedFormScheduler {
 public:
  MultiStepDecay(torch::optim::Optimizer& optimizer, std::vector<int64_t> milestones,
                 double gamma = 0.1);
  double lr_at(double base, int64_t t) const override;

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

// Linear warmup as LinearWarmup, then base * sqrt(t_warmup / t) for t >= t_warmup
// (t_warmup >= 1).
class InverseSqrtWithWarmup final : public ClosedFormScheduler {
 public:
  InverseSqrtWithWarmup(torch::optim::Optimizer& optimizer, int64_t t_warmup,
                        double warmup_decay = 0.01);
  double lr_at(double base, int64_t t) const override;

 private:
  int64_t t_warmup_;
  double warmup_decay_;
};

// base, always.
class ConstantLR final : public ClosedFormScheduler {
 public:
  explicit ConstantLR(torch::optim::Optimizer& optimizer);
  double lr_at(double base, int64_t) const override { return base; }
};

}  // namespace optim
}  // namespace decent_dp
