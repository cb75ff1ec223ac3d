// The machinery shared by DecentralizedDataParallel (gossip, spec §2-§7) and
// DistributedDataParallel (classic all-reduce, spec §9): a torch::nn::Module that wraps the
// user's module, groups its parameters into flat buckets in gradient-ready order, hooks the
// gradient accumulators, and takes each bucket's optimizer step inside backward. After its
// step a bucket's gradients are released (set to none, as zero_grad() does by default), so
// p.grad() is undefined once backward returns (Note [releasing gradients]); with
// param_as_bucket_view = false they are zeroed instead.
// Users include decent_dp/decentralized_data_parallel.h or
// decent_dp/distributed_data_parallel.h, whose header templates add forward().
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "decent_dp/bucket.h"
#include "decent_dp/communicator.h"
#include "optim/factories.h"
#include "topology/topology.h"

namespace decent_dp {

using optim::LrSchedulerFn;
using optim::NamedParams;
using optim::OptimFn;

class GradReadyHooks;

// Options of both wrappers (spec §6), validated on construction.
struct DataParallelOptions {
  std::string topology = "complete";  // registry name (gossip mode only)
  double bucket_cap_mb = 25;          // > 0
  bool param_as_bucket_view = true;   // false: keep the user's storage, copy in and out
  double grad_clip_norm = 0;          // > 0: clip each bucket's gradient norm before its step
  bool sync_buffers_in_global_avg = false;
  int local_world_size = 0;  // ranks per node for the topology; 0: found through MPI
};

// Optimizers may implement this to see their neighbours' values: called in every bucket just
// before mixing, with the group of the exchange, its self weight and the received block
// (the group mean of the parameters the members sent).
class PreMixingHook {
 public:
  virtual ~PreMixingHook() = default;
  virtual void pre_mix(const topology::Group& group, double self_weight,
                       const at::Tensor& received) = 0;
};

enum class ExchangeMode { kGossip, kAllReduce };

// The process-wide MPI communicator the wrappers use unless given one.
std::shared_ptr<Communicator> default_communicator();

class DataParallelCore : public torch::nn::Module {
 public:
  DataParallelCore(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options,
                   OptimFn optim_fn, LrSchedulerFn scheduler_fn, std::shared_ptr<Communicator> comm,
                   ExchangeMode mode);
  ~DataParallelCore() override;

  DataParallelCore(const DataParallelCore&) = delete;
  DataParallelCore& operator=(const DataParallelCore&) = delete;

  // Train / eval switch the wrapped module too. A forward in eval mode counts no step.
  void train(bool on = true) override;

  // While on, hooks neither update nor communicate and forwards count no step: gradients
  // accumulate. The backward after turning it off takes the update with the sum.
  void set_accumulate_grad(bool on);
  bool accumulate_grad() const { return accumulate_; }

  // RAII form of set_accumulate_grad(true).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DataParallelCore& core) : core_(&core), previous_(core.accumulate_) {
      core.set_accumulate_grad(true);
    }
    ~NoSyncGuard() {
      if (core_ != nullptr)
        core_->set_accumulate_grad(previous_);
    }
    NoSyncGuard(NoSyncGuard&& other) noexcept : core_(other.core_), previous_(other.previous_) {
      other.core_ = nullptr;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    DataParallelCore* core_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Training forwards counted so far, and optimizer updates taken.
  int64_t step() const { return steps_; }
  int64_t updates() const { return updates_; }
  // Bucket 0's current learning rate (buckets exist after the first backward).
  double get_lr() const;

  size_t bucket_count() const;
  const BucketSpec& bucket_spec(size_t b) const;
  const BucketStorage& bucket_storage(size_t b) const;
  torch::optim::Optimizer& optimizer(size_t b);
  torch::optim::LRScheduler* scheduler(size_t b);
  // Names of parameters excluded because they received no gradient in iteration 1.
  const std::vector<std::string>& unused_parameters() const { return unused_; }
  const topology::Topology& topology() const { return *topology_; }
  Communicator& communicator() { return *comm_; }
  ExchangeMode mode() const { return mode_; }

  // Waits for every exchange in flight (their results are applied by the next update).
  void synchronize();

  // Seconds this rank spent blocked on the wrappers' exchanges so far: in gossip mode waiting
  // for the previous exchange before an update, in all-reduce mode waiting for a gradient
  // reduction before the step, and in synchronize(). Exchanges that had finished cost nothing.
  double exchange_wait_seconds() const { return exchange_wait_seconds_; }

 protected:
  // Called by forward() before the wrapped module's forward.
  void before_forward();

  // ---- gossip-only operations, exposed by DecentralizedDataParallel ----
  double global_avg_impl(bool will_revert, bool return_d2c);
  void revert_global_avg_impl();
  double consensus_distance_impl();
  void set_adaptive_factor_impl(double a);
  double adaptive_factor_impl() const { return adaptive_factor_; }

 private:
  struct Bucket;

  void check_same_model();
  void broadcast_initial_state();
  void on_grad_ready(size_t index);
  void end_of_backward();
  void build_buckets();
  void process_bucket(size_t b);
  void step_bucket(Bucket& bucket);
  void step_reduced_buckets(bool block);
  void reset_counting();
  void wait_for_exchange(Work& work);

  std::shared_ptr<torch::nn::Module> module_;
  DataParallelOptions options_;
  OptimFn optim_fn_;
  LrSchedulerFn scheduler_fn_;
  std::shared_ptr<Communicator> comm_;
  ExchangeMode mode_;
  std::unique_ptr<topology::Topology> topology_;
  std::vector<int> all_ranks_;

  std::vector<std::string> names_;  // named_parameters() of the wrapped module
  std::vector<at::Tensor> params_;  // same order
  std::vector<size_t> hooked_;      // indices of parameters that require grad
  std::unique_ptr<GradReadyHooks> hooks_;

  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // parameter index -> bucket (npos: excluded)
  std::vector<std::string> unused_;

  // Per backward.
  std::vector<size_t> ready_order_;  // iteration 1
  std::vector<char> ready_;
  std::vector<size_t> pending_;
  size_t next_bucket_ = 0;
  std::vector<size_t> awaiting_step_;  // all-reduce mode: buckets reduced but not stepped
  bool armed_ = false;
  bool callback_queued_ = false;
  bool backward_done_ = false;
  bool accumulate_ = false;

  int64_t steps_ = 0;
  int64_t updates_ = 0;
  double adaptive_factor_ = 1.0;
  double exchange_wait_seconds_ = 0;

  // global_avg backup.
  std::vector<at::Tensor> backup_params_;
  std::vector<at::Tensor> backup_buffers_;
  bool has_backup_ = false;
};

namespace detail {

template <typename T>
std::shared_ptr<torch::nn::Module> module_ptr(const std::shared_ptr<T>& m) {
  return std::static_pointer_cast<torch::nn::Module>(m);
}

template <typename T>
std::shared_ptr<torch::nn::Module> module_ptr(const torch::nn::ModuleHolder<T>& m) {
  return std::static_pointer_cast<torch::nn::Module>(m.ptr());
}

}  // namespace detail

// The header-template part of both wrappers: holds the user's module and forwards to its
// forward(). `ModuleType` is what the user holds: std::shared_ptr<Impl> or a module holder
// such as torch::nn::Sequential.
template <typename ModuleType>
class WrappedModule : public DataParallelCore {
 public:
  WrappedModule(ModuleType module, DataParallelOptions options, OptimFn optim_fn,
                LrSchedulerFn scheduler_fn, std::shared_ptr<Communicator> comm, ExchangeMode mode)
      : DataParallelCore(detail::module_ptr(module), std::move(options), std::move(optim_fn),
                         std::move(scheduler_fn), std::move(comm), mode),
        module_(std::move(module)) {}

  // Counts the step (training mode only), then calls the wrapped module's forward with the
  // arguments unchanged.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    before_forward();
    return module_->forward(std::forward<Args>(args)...);
  }

  ModuleType& module() { return module_; }

 private:
  ModuleType module_;
};
}  // namespace decent_dp
