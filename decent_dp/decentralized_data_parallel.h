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

template <typename ModuleType>
class DecentralizedDataParallel : public WrappedModule<ModuleType> {
 public:
  DecentralizedDataParallel(ModuleType module, DataParallelOptions options, OptimFn optim_fn,
                            LrSchedulerFn scheduler_fn = nullptr,
                            std::shared_ptr<Communicator> comm = nullptr)
      : WrappedModule<ModuleType>(std::move(module), std::move(options), std::move(optim_fn),
                                  std::move(scheduler_fn), std::move(comm), ExchangeMode::kGossip) {
  }

  // Waits for pending exchanges and replaces every rank's parameters (and floating buffers
  // with sync_buffers_in_global_avg) with the mean over all ranks. With will_revert,
  // revert_global_avg() restores the exact local state; without it, pending exchanges are
  // dropped and training continues from the mean. With return_d2c, returns this rank's L2
  // distance to the mean (0 otherwise). Collective.
  double global_avg(bool will_revert = true, bool return_d2c = false) {
    return this->global_avg_impl(will_revert, return_d2c);
  }
  void revert_global_avg() { this->revert_global_avg_impl(); }
  // Mean over ranks of ||x_i - mean||^2; the same value on every rank. Collective.
  double consensus_distance() { return this->consensus_distance_impl(); }
  // x <- (1 - a) x + a mix(x), a in [0, 1] (default 1).
  void set_adaptive_factor(double a) { this->set_adaptive_factor_impl(a); }
  double adaptive_factor() const { return this->adaptive_factor_impl(); }
};

}  // namespace decent_dp
