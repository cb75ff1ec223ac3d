// Note [gradient-ready hooks]
// One post-hook on each parameter's gradient accumulator (its AccumulateGrad node) fires
// right after autograd has accumulated that parameter's gradient. The variable's autograd
// metadata holds its accumulator only through a weak pointer: without an owning reference
// the node dies after each backward, the next forward makes a new one and the hook is
// silently lost — so these hooks keep the accumulators alive, and remove themselves on
// destruction so they never call into a dead object. Hooks run on the thread that runs the
// backward (for CPU tensors, the caller's), with grad mode off.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace decent_dp {

class GradReadyHooks {
 public:
  // Calls on_ready(i) each time the gradient of params[i] has been accumulated.
  GradReadyHooks(const std::vector<at::Tensor>& params, std::function<void(size_t)> on_ready);
  ~GradReadyHooks();

  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // Queues `callback` to run at the end of the current backward pass, still inside it (the
  // autograd engine's final callbacks). Only callable from inside a hook.
  static void queue_end_of_backward(std::function<void()> callback);

 private:
  struct Entry;
  std::vector<std::unique_ptr<Entry>> entries_;
};

}  // namespace decent_dp
