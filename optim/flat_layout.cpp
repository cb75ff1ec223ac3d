#include "decent_dp/optim/flat_layout.h"

#include <algorithm>
#include <numeric>

namespace decent_dp {
namespace optim {

std::optional<FlatLayout> detect_flat_layout(const std::vector<at::Tensor>& params,
                                             const std::vector<at::Tensor>& grads) {
  if (params.empty() || params.size() != grads.size()) {
    return std::nullopt;
  }
  const at::Tensor& p0 = params[0];
  const at::Tensor& g0 = grads[0];
  if (!p0.has_storage() || !g0.has_storage()) {
    return std::nullopt;
  }
  const c10::StorageImpl* p_storage = p0.storage().unsafeGetStorageImpl();
  const c10::StorageImpl* g_storage = g0.storage().unsafeGetStorageImpl();
  if (p_storage == g_storage) {
    return std::nullopt;
  }
  int64_t p_min = INT64_MAX;
  int64_t g_min = INT64_MAX;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    if (!g.defined() || !p.has_storage() || !g.has_storage() ||
        p.storage().unsafeGetStorageImpl() != p_storage ||
        g.storage().unsafeGetStorageImpl() != g_storage || p.scalar_type() != p0.scalar_type() ||
        g.scalar_type() != p0.scalar_type() || p.device() != p0.device() ||
        g.device() != p0.device() || p.layout() != at::kStrided || g.layout() != at::kStrided ||
        !p.is_non_overlapping_and_dense() || p.sizes() != g.sizes() || p.strides() != g.strides()) {
      return std::nullopt;
    }
    p_min = std::min(p_min, p.storage_offset());
    g_min = std::min(g_min, g.storage_offset());
  }
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params[a].storage_offset() < params[b].storage_offset();
  });
  FlatLayout layout;
  layout.offsets.resize(params.size());
  int64_t end = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const int64_t offset = params[i].storage_offset() - p_min;
    if (grads[i].storage_offset() - g_min != offset) {
      return std::nullopt;
    }
    if (k > 0 && (offset < end || offset - end >= kMaxFlatGap)) {
      return std::nullopt;  // overlapping views, or a gap that is not alignment padding
    }
    layout.offsets[i] = offset;
    end = offset + params[i].numel();
  }
  layout.params = p0.as_strided({end}, {1}, p_min);
  layout.grads = g0.as_strided({end}, {1}, g_min);
  return layout;
}

at::Tensor view_like(const at::Tensor& block, const at::Tensor& like, int64_t offset) {
  return block.as_strided(like.sizes(), like.strides(), block.storage_offset() + offset);
}

}  // namespace optim
}  // namespace decent_dp
