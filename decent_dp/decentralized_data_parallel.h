// DecentralizedDataParallel: decentralized (gossip) data-parallel training of a LibTorch
// module, as the ICLR 2025 Decent-DP paper defines it (spec §2-§7).
//
//   auto net = std::make_shared<Net>();
//   decent_dp::DataParallelOptions options;
//   options.topology = "exp";
//   decent_dp::DecentralizedDataParallel<Net> model(net, options, decent_dp::optim::adamw(),
//                                                   decent_dp::optim::cosine_with_warmup(1000,
//                                                   100));
//   for (auto& batch : loader) {
//     auto loss = loss_fn(model.forward(batch.data), batch.target);
//     loss.backward();   // each bucket takes its optimizer step and starts its exchange here
//   }
//   model.global_avg(/*will_revert=*/false);  // all ranks hold the mean, e.g. before evaluation
#pragma once

#include <utility>

#include "decent_dp/data_parallel.h"

namespace decent_dp {

// `ModuleType` is what the user holds: std::shared_ptr<Impl> or a module holder such as
// torch::nn::Sequential; forward() forwards to its forward().
template <typename ModuleType>
class DecentralizedDataParallel : public DataParallelCore {
 public:
  DecentralizedDataParallel(ModuleType module, DataParallelOptions options, OptimFn optim_fn,
                            LrSchedulerFn scheduler_fn = nullptr,
                            std::shared_ptr<Communicator> comm = nullptr)
      : DataParallelCore(detail::module_ptr(module), std::move(options), std::move(optim_fn),
                         std::move(scheduler_fn), std::move(comm), ExchangeMode::kGossip),
        module_(std::move(module)) {}

  // Counts the step (training mode only), then calls the wrapped module's forward with the
  // arguments unchanged.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    before_forward();
    return module_->forward(std::forward<Args>(args)...);
  }

  ModuleType& module() { return module_; }

  // Waits for pending exchanges and replaces every rank's parameters (and floating buffers
  // with sync_buffers_in_global_avg) with the mean over all ranks. With will_revert,
  // revert_global_avg() restores the exact local state; without it, pending exchanges are
  // dropped and training continues from the mean. With return_d2c, returns this rank's L2
  // distance to the mean (0 otherwise). Collective.
  double global_avg(bool will_revert = true, bool return_d2c = false) {
    return global_avg_impl(will_revert, return_d2c);
  }
  void revert_global_avg() { revert_global_avg_impl(); }
  // Mean over ranks of ||x_i - mean||^2; the same value on every rank. Collective.
  double consensus_distance() { return consensus_distance_impl(); }
  // x <- (1 - a) x + a mix(x), a in [0, 1] (default 1).
  void set_adaptive_factor(double a) { set_adaptive_factor_impl(a); }
  double adaptive_factor() const { return adaptive_factor_impl(); }

 private:
  ModuleType module_;
};

}  // namespace decent_dp
