// Note [flat parameter groups]
// The wrappers keep each bucket's parameters as views into one flat block (spec §4), and
// DistributedDataParallel their gradients as views into another with the same layout. An
// optimizer that sees such a group keeps its state (moments, accumulators, momentum) as flat
// blocks of the same layout, the per-parameter state being views into them, so the state
// follows the parameters through Note [block swap].
//
// A group is flat when every parameter is a dense, non-overlapping view of one storage and
// the views are separated only by alignment padding (fewer than kMaxFlatGap elements); its
// state blocks then share that layout. Its gradients are flat too when each is laid out
// like its parameter in one other storage, at the same offset relative to the gradient
// block: then one pass steps the whole block, padding included (it must hold zeros in both
// blocks, which keeps it at zero under every optimizer here). Otherwise (gradients that
// autograd allocated per tensor: DecentralizedDataParallel leaves them where they are,
// Note [gradients in place]) one fused call steps the list of parameter and state views
// with the gradients as they are: no gradient is copied.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace decent_dp {
namespace optim {

constexpr int64_t kMaxFlatGap = 32;

struct FlatLayout {
  at::Tensor params;             // 1-D view over the parameter block
  at::Tensor grads;              // 1-D view over the gradient block; undefined: not flat
  std::vector<int64_t> offsets;  // parameter i starts at params[offsets[i]]
};

// The flat layout of `params` (grads undefined), or nullopt.
std::optional<FlatLayout> detect_flat_params(const std::vector<at::Tensor>& params);

// The 1-D view over the gradient block when `grads` (one per parameter, defined) are laid
// out like the parameters of `layout`; undefined otherwise.
at::Tensor detect_flat_grads(const FlatLayout& layout, const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads);

// Whether `t` and `like` are both contiguous, or both non-overlapping and dense with the
// same sizes and strides (a channels-last parameter, its gradient and its state). Element k
// of each one's memory_order() view is then the same element of both.
bool dense_alike(const at::Tensor& t, const at::Tensor& like);

// A non-overlapping and dense tensor as a 1-D view in memory order, for elementwise kernels
// that need contiguous tensors.
at::Tensor memory_order(const at::Tensor& t);

// A view of `block` shaped and strided like `like`, starting at element `offset`.
at::Tensor view_like(const at::Tensor& block, const at::Tensor& like, int64_t offset);

}  // namespace optim
}  // namespace decent_dp
