#include "decent_dp/exchange_stage.h"

#include <ATen/ops/sum.h>

#include <tuple>

#include "decent_dp/communicator.h"
#include "decent_dp/detail/order_statistics.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

// out = (sum of the per-coordinate order statistics lo..hi-1 of the k rows) / divisor: the
// sorting network for float and double rows of up to kMaxNetworkRows (Note [sorting
// network]), ATen's sort otherwise.
void sorted_range_mean(const at::Tensor& rows, int64_t lo, int64_t hi, double divisor,
                       const at::Tensor& out) {
  const int64_t k = rows.size(0);
  const int64_t n = rows.size(1);
  const bool network = k <= detail::kMaxNetworkRows && rows.stride(1) == 1 && out.is_contiguous() &&
                       out.scalar_type() == rows.scalar_type() &&
                       (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kDouble) &&
                       rows.device().is_cpu() && out.device().is_cpu();
  if (!network) {
    const at::Tensor sorted = std::get<0>(rows.sort(0));
    at::Tensor target = out;
    at::sum_out(target, sorted.narrow(0, lo, hi - lo), {0});
    out.div_(divisor);
    return;
  }
  const int64_t stride = k > 1 ? rows.stride(0) : n;
  if (rows.scalar_type() == at::kFloat) {
    detail::sorted_range_sum(rows.data_ptr<float>(), stride, static_cast<int>(k), n,
                             static_cast<int>(lo), static_cast<int>(hi),
                             static_cast<float>(divisor), out.data_ptr<float>());
  } else {
    detail::sorted_range_sum(rows.data_ptr<double>(), stride, static_cast<int>(k), n,
                             static_cast<int>(lo), static_cast<int>(hi), divisor,
                             out.data_ptr<double>());
  }
}

}  // namespace

void Codec::load_state(const NamedTensors& state) {
  DECENT_DP_CHECK_ARG(state.empty(), name(), ": keeps no state between updates, got ", state.size(),
                      " tensor(s), the first '", state.front().first, "'");
}

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
  if (k % 2 == 1) {
    sorted_range_mean(rows, k / 2, k / 2 + 1, 1.0, out);
  } else {
    sorted_range_mean(rows, k / 2 - 1, k / 2 + 1, 2.0, out);
  }
}

}  // namespace decent_dp

namespace decent_dp {

TrimmedMeanAggregator::TrimmedMeanAggregator(int64_t b) : b_(b) {
  DECENT_DP_CHECK_ARG(
      b >= 0, "TrimmedMeanAggregator: b (values dropped at each end) must be >= 0, got ", b);
}

std::string TrimmedMeanAggregator::name() const {
  return detail::cat("trimmed-mean(b=", b_, ")");
}

void TrimmedMeanAggregator::aggregate(const at::Tensor& rows, int64_t /*self*/,
                                      const topology::Group& group, const at::Tensor& out) {
  const int64_t k = rows.size(0);
  if (k == 1) {
    out.copy_(rows.select(0, 0));
    return;
  }
  if (k <= 2 * b_) {
    throw InvalidArgument(detail::cat("trimmed mean with b = ", b_, " needs groups of more than ",
                                      2 * b_, " members; group ", ranks_to_string(group.ranks),
                                      " has ", k));
  }
  if (b_ == 0) {
    at::Tensor target = out;
    at::sum_out(target, rows, {0});
    out.div_(static_cast<double>(k));
  } else {
    sorted_range_mean(rows, b_, k - b_, static_cast<double>(k - 2 * b_), out);
  }
}

void TrimmedMeanAggregator::check(const topology::Topology& topology) const {
  for (int s = 0; s < topology.period(); ++s) {
    for (const topology::Group& g : topology.slot(s)) {
      if (g.size() > 1 && g.size() <= 2 * b_) {
        throw InvalidArgument(detail::cat(
            "aggregator trimmed-mean(b=", b_, ") drops ", b_,
            " values at each end and needs groups of more than ", 2 * b_,
            " members, but topology '", topology.name(), "' has group ", ranks_to_string(g.ranks),
            " (", g.size(), " members) in slot ", s,
            "; use a smaller b or a topology with larger groups (complete, or random-<k> with "
            "k > 2b)"));
      }
    }
  }
}

}  // namespace decent_dp
