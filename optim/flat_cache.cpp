#include "decent_dp/optim/flat_cache.h"

#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace optim {

FlatCache::Entry* FlatCache::lookup(size_t group, const std::vector<at::Tensor>& params,
                                    const std::vector<at::Tensor>& grads) {
  Cached& c = entries_[group];
  bool same = c.param_ptrs.size() == params.size() && !c.param_ptrs.empty();
  for (size_t i = 0; same && i < params.size(); ++i) {
    same = c.param_ptrs[i] == params[i].data_ptr() && c.impls[i] == params[i].unsafeGetTensorImpl();
  }
  if (same) {
    if (!c.flat) {
      return nullptr;
    }
    c.entry.fresh = false;
    c.entry.layout.grads = detect_flat_grads(c.entry.layout, params, grads);
    return &c.entry;
  }
  Cached previous = std::move(c);
  c = Cached();
  for (size_t i = 0; i < params.size(); ++i) {
    c.param_ptrs.push_back(params[i].data_ptr());
    c.impls.push_back(params[i].unsafeGetTensorImpl());
  }
  auto layout = detect_flat_params(params);
  if (!layout) {
    return nullptr;
  }
  c.flat = true;
  c.entry.layout = std::move(*layout);
  c.entry.layout.grads = detect_flat_grads(c.entry.layout, params, grads);
  const FlatLayout& before = previous.entry.layout;
  const FlatLayout& now = c.entry.layout;
  if (previous.flat && previous.impls == c.impls && before.offsets == now.offsets &&
      before.params.numel() == now.params.numel() &&
      before.params.options().type_equal(now.params.options()) &&
      before.params.device() == now.params.device()) {
    // The same tensors in the same layout over other blocks (DecentralizedDataParallel's
    // Note [block swap]): the flat state blocks stay, with their per-parameter views.
    c.entry.blocks = std::move(previous.entry.blocks);
    c.entry.step = std::move(previous.entry.step);
  }
  return &c.entry;
}

at::Tensor evaluate_closure(const std::function<at::Tensor()>& closure) {
  if (!closure) {
    return {};
  }
  at::AutoGradMode enable_grad(true);
  return closure();
}

void params_with_grads(const std::vector<at::Tensor>& group_params, const char* optimizer,
                       std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads) {
  params.clear();
  grads.clear();
  for (const auto& p : group_params) {
    if (p.grad().defined()) {
      DECENT_DP_CHECK_ARG(!p.grad().is_sparse(), optimizer, ": sparse gradients are not supported");
      params.push_back(p);
      grads.push_back(p.grad());
    }
  }
}

void bind_flat_state(const FlatLayout& layout, const std::vector<at::Tensor>& params,
                     std::vector<at::Tensor>& blocks,
                     const std::vector<std::vector<at::Tensor*>>& slots) {
  for (size_t k = 0; k < slots.size(); ++k) {
    if (!blocks[k].defined()) {
      blocks[k] = at::zeros_like(layout.params, at::MemoryFormat::Contiguous);
    }
    const at::Tensor& block = blocks[k];
    const size_t element_size = block.element_size();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& t = *slots[k][i];
      const char* expected =
          static_cast<const char*>(block.data_ptr()) + layout.offsets[i] * element_size;
      if (t.defined() && t.data_ptr() == expected && t.strides() == params[i].strides()) {
        continue;  // already a view at the right place
      }
      at::Tensor view = view_like(block, params[i], layout.offsets[i]);
      if (t.defined()) {
        view.copy_(t);
      }
      t = view;
    }
  }
}

}  // namespace optim
}  // namespace decent_dp
