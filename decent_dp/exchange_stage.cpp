#include "decent_dp/exchange_stage.h"

#include <ATen/ops/sum.h>

#include <tuple>

#include "decent_dp/errors.h"

namespace decent_dp {

void MeanAggregator::aggregate(const at::Tensor& rows, int64_t self, const topology::Group& group,
                               const at::Tensor& out) {
  const int64_t k = rows.size(0);
  const at::Tensor x = rows.select(0, self);
  if (k == 1) {
    out.copy_(x);
    return;
  }
  const double w = group.self_weight;
  at::Tensor target = out;
  at::sum_out(target, rows, {0});
  out.sub_(x).mul_((1.0 - w) / static_cast<double>(k - 1)).add_(x, w);
}

void MedianAggregator::aggregate(const at::Tensor& rows, int64_t /*self*/,
                                 const topology::Group& /*group*/, const at::Tensor& out) {
  const int64_t k = rows.size(0);
  const at::Tensor sorted = std::get<0>(rows.sort(0));
  if (k % 2 == 1) {
    out.copy_(sorted.select(0, k / 2));
  } else {
    out.copy_(sorted.select(0, k / 2 - 1)).add_(sorted.select(0, k / 2)).mul_(0.5);
  }
}

}  // namespace decent_dp
