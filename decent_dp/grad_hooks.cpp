#include "decent_dp/grad_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

struct GradReadyHooks::Entry {
  std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: see the note
  uintptr_t key = 0;
};

GradReadyHooks::GradReadyHooks(const std::vector<at::Tensor>& params,
                               std::function<void(size_t)> on_ready) {
  for (size_t i = 0; i < params.size(); ++i) {
    DECENT_DP_CHECK_ARG(params[i].requires_grad() && params[i].is_leaf(),
                        "gradient hooks need leaf tensors that require grad (parameter ", i, ")");
    auto entry = std::make_unique<Entry>();
    entry->accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    entry->key = entry->accumulator->add_post_hook(
        std::make_unique<ReadyHook>([on_ready, i] { on_ready(i); }));
    entries_.push_back(std::move(entry));
  }
}

GradReadyHooks::~GradReadyHooks() {
  for (auto& e : entries_) {
    e->accumulator->del_post_hook(e->key);
  }
}

void GradReadyHooks::queue_end_of_backward(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace decent_dp
