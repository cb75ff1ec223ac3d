// One pass of AccumAdam(W) (spec §8) over contiguous tensors.
#pragma once

#include <ATen/core/Tensor.h>

namespace decent_dp {
namespace optim {

struct AccumAdamStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // AdamW-style weight decay
  int64_t accum_iter = 4;  // K
  int64_t step = 1;        // t, already incremented
};

// Updates param, exp_avg, exp_avg_sq and accum in place from grad. CPU tensors that are
// contiguous take a single vectorized, multi-threaded pass; other tensors (CUDA included)
// are updated with ATen operations, which compute the same formula.
void accum_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& accum, const AccumAdamStep& s);

}  // namespace optim
}  // namespace decent_dp
