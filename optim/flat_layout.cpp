#include "decent_dp/optim/flat_layout.h"

#include <algorithm>
#include <numeric>

namespace decent_dp {
namespace optim {

std::optional<FlatLayout> detect_flat_params(const std::vector<at::Tensor>& params) {
  if (params.empty()) {
    return std::nullopt;
  }
  const at::Tensor& p0 = params[0];
  if (!p0.has_storage()) {
    return std::nullopt;
  }
  const c10::StorageImpl* p_storage = p0.storage().unsafeGetStorageImpl();
  int64_t p_min = INT64_MAX;
  for (const at::Tensor& p : params) {
    if (!p.has_storage() || p.storage().unsafeGetStorageImpl() != p_storage ||
        p.scalar_type() != p0.scalar_type() || p.device() != p0.device() ||
        p.layout() != at::kStrided || !p.is_non_overlapping_and_dense()) {
      return std::nullopt;
    }
    p_min = std::min(p_min, p.storage_offset());
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
    if (k > 0 && (offset < end || offset - end >= kMaxFlatGap)) {
      return std::nullopt;  // overlapping views, or a gap that is not alignment padding
    }
    layout.offsets[i] = offset;
    end = offset + params[i].numel();
  }
  layout.params = p0.as_strided({end}, {1}, p_min);
  return layout;
}

at::Tensor detect_flat_grads(const FlatLayout& layout, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads) {
  if (grads.size() != params.size() || grads.empty() || !grads[0].defined() ||
      !grads[0].has_storage()) {
    return {};
  }
  const c10::StorageImpl* g_storage = grads[0].storage().unsafeGetStorageImpl();
  if (g_storage == layout.params.storage().unsafeGetStorageImpl()) {
    return {};
  }
  // Gradient i must sit where parameter i sits, relative to each block's start.
  const int64_t g_min = grads[0].storage_offset() - layout.offsets[0];
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    if (!g.defined() || !g.has_storage() || g.storage().unsafeGetStorageImpl() != g_storage ||
        g.scalar_type() != p.scalar_type() || g.device() != p.device() ||
        g.layout() != at::kStrided || g.sizes() != p.sizes() || g.strides() != p.strides() ||
        g.storage_offset() - g_min != layout.offsets[i]) {
      return {};
    }
  }
  if (g_min < 0) {
    return {};
  }
  return grads[0].as_strided({layout.params.numel()}, {1}, g_min);
}

bool dense_alike(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && t.layout() == at::kStrided && t.sizes() == like.sizes() &&
         ((t.is_contiguous() && like.is_contiguous()) ||
          (like.is_non_overlapping_and_dense() && t.strides() == like.strides()));
}

at::Tensor memory_order(const at::Tensor& t) {
  // Dense layouts have positive strides: the memory starts at the storage offset.
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

at::Tensor view_like(const at::Tensor& block, const at::Tensor& like, int64_t offset) {
  return block.as_strided(like.sizes(), like.strides(), block.storage_offset() + offset);
}

}  // namespace optim
}  // namespace decent_dp
