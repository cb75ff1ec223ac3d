// Per-group cache of flat layouts (Note [flat parameter groups]): the parameters' detection
// runs again only when a group's parameter tensors change; the gradients' at every lookup
// (a pointer comparison per tensor).
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "decent_dp/optim/flat_layout.h"

namespace decent_dp {
namespace optim {

class FlatCache {
 public:
  struct Entry {
    FlatLayout layout;
    std::vector<at::Tensor> blocks;  // the optimizer's flat state blocks, in its own order
    at::Tensor step;                 // scalar float step for the fused kernels
    bool fresh = true;               // created by the last lookup
  };

  // The flat entry of group `group` for these tensors, or null when the parameters are not
  // flat; its layout's grads are undefined when the gradients are not.
  Entry* lookup(size_t group, const std::vector<at::Tensor>& params,
                const std::vector<at::Tensor>& grads);
  void clear() { entries_.clear(); }

 private:
  struct Cached {
    std::vector<const void*> param_ptrs;
    std::vector<const c10::TensorImpl*> impls;  // the parameters themselves
    bool flat = false;
    Entry entry;
  };
  std::map<size_t, Cached> entries_;
};

// Runs an optimizer's closure (if any) with gradients enabled and returns its loss.
at::Tensor evaluate_closure(const std::function<at::Tensor()>& closure);

// The parameters of `group_params` that have a gradient, and those gradients; throws for
// sparse gradients, naming `optimizer`.
void params_with_grads(const std::vector<at::Tensor>& group_params, const char* optimizer,
                       std::vector<at::Tensor>& params, std::vector<at::Tensor>& grads);

// Makes every per-parameter state tensor in `slots[k][i]` (state tensor k of parameter i)
// a view into `blocks[k]`: values already held by a per-parameter tensor that is not yet a
// view (a fresh block, or state loaded from an archive) are copied into the block first;
// undefined ones start at zero.
void bind_flat_state(const FlatLayout& layout, const std::vector<at::Tensor>& params,
                     std::vector<at::Tensor>& blocks,
                     const std::vector<std::vector<at::Tensor*>>& slots);

}  // namespace optim
}  // namespace decent_dp
