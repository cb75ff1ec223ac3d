// DistributedDataParallel: classic data parallelism (spec §9) — what LibTorch lacks and
// torch DDP users expect. Each bucket's gradient block is averaged over all ranks as soon as
// it is full, and the bucket's optimizer steps once its reduction is done, inside the same
// backward: the result equals one process training on the union of all ranks' batches (for
// models without batch statistics).
#pragma once

#include <utility>

#include "decent_dp/data_parallel.h"

namespace decent_dp {

template <typename ModuleType>
class DistributedDataParallel : public WrappedModule<ModuleType> {
 public:
  DistributedDataParallel(ModuleType module, DataParallelOptions options, OptimFn optim_fn,
                          LrSchedulerFn scheduler_fn = nullptr,
                          std::shared_ptr<Communicator> comm = nullptr)
      : WrappedModule<ModuleType>(std::move(module), std::move(options), std::move(optim_fn),
                                  std::move(scheduler_fn), std::move(comm),
                                  ExchangeMode::kAllReduce) {}
};

}  // namespace decent_dp
