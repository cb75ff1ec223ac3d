// Note [flat parameter groups]
// DecentralizedDataParallel keeps each bucket's parameters as views into one flat block and
// their gradients as views into another, with the same layout (spec §4). An optimizer that
// sees such a group steps the whole block in one pass instead of looping over tensors, and
// keeps its state (moments, accumulators, momentum) as flat blocks of the same layout, the
// per-parameter state being views into them.
//
// A group is flat when every parameter (and its gradient) is a dense, non-overlapping view
// of one storage (one for parameters, one for gradients), gradient i sits at the same offset
// relative to the gradient block as parameter i relative to the parameter block, and the
// views are separated only by alignment padding (fewer than kMaxFlatGap elements). Padding
// is stepped along with the parameters: it must hold zeros in both blocks, which keeps it at
// zero under every optimizer here.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace decent_dp {
namespace optim {

constexpr int64_t kMaxFlatGap = 32;

struct FlatLayout {
  at::Tensor params;             // 1-D view over the parameter block
  at::Tensor grads;              // 1-D view over the gradient block
  std::vector<int64_t> offsets;  // parameter i starts at params[offsets[i]]
};

// The flat layout of `params` / `grads` (same length, grads defined), or nullopt.
std::optional<FlatLayout> detect_flat_layout(const std::vector<at::Tensor>& params,
                                             const std::vector<at::Tensor>& grads);

// A view of `block` shaped and strided like `like`, starting at element `offset`.
at::Tensor view_like(const at::Tensor& block, const at::Tensor& like, int64_t offset);

}  // namespace optim
}  // namespace decent_dp
