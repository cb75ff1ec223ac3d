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

#include "decent_dp/backend.h"
#include "decent_dp/bucket_set.h"
#include "decent_dp/communicator.h"
#include "decent_dp/exchange_stage.h"
#include "decent_dp/global_averager.h"
#include "decent_dp/metrics.h"
#include "decent_dp/model_sync.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/privacy.h"
#include "decent_dp/topology/topology.h"

namespace decent_dp {

using optim::LrSchedulerFn;
using optim::NamedParams;
using optim::OptimFn;

class Exchange;
class GossipExchange;
class GradReady;

// Options of both wrappers (spec §6), validated on construction.
struct DataParallelOptions {
  std::string topology = "complete";  // registry name (gossip mode only)
  double bucket_cap_mb = 25;          // > 0
  bool param_as_bucket_view = true;   // false: keep the user's storage, copy in and out
  double grad_clip_norm = 0;          // > 0: clip each bucket's gradient norm before its step
  bool sync_buffers_in_global_avg = false;
  int local_world_size = 0;  // ranks per node for the topology; 0: found through MPI
  // Order of the parameters inside each bucket (Note [flat parameter groups]): the default
  // keeps the groups of the library's optimizer factories contiguous, so they step flat.
  // Empty: gradient-ready order.
  LayoutKey bucket_layout_key = default_layout_key;
  // Gossip mode: the stages of the exchange (Note [exchange seam]). Both null: the group
  // all-reduce to the mean; otherwise the group all-gather, decoded and aggregated.
  std::shared_ptr<Codec> codec;
  std::shared_ptr<Aggregator> aggregator;
  // The Gaussian mechanism on each rank's gradient (Note [differential privacy] in
  // decent_dp/privacy.h), both modes; clip_norm 0: off.
  PrivacyOptions privacy;
};

enum class ExchangeMode { kGossip, kAllReduce };

// The thin nn::Module facade that wires the pieces together: GradReady (hooks, counting) ->
// BucketSet (storage, binding) -> Exchange (gossip or all-reduce) -> the buckets' optimizers;
// GlobalAverager for global_avg / revert / consensus distance. docs/architecture.md follows
// one step through them.
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
  // The communicator of the exchanges (the parameters' device).
  Communicator& communicator() { return *data_; }
  ExchangeMode mode() const { return mode_; }

  // Waits for every exchange in flight (their results are applied by the next update).
  void synchronize();

  // Uneven inputs (Note [join]). Every rank calls enable_join() before its training loop;
  // from then on each training forward first agrees with the other ranks that some rank
  // still trains (one all-reduce of one integer over all ranks per step). A rank that runs
  // out of data calls join(): until every rank has joined it shadows the others' steps, so
  // no exchange waits for it — in gossip mode it contributes its parameters to its groups
  // and mixes their result in without an optimizer step; in all-reduce mode it contributes
  // zero gradients (the mean is over all ranks) and takes the update, staying identical to
  // the others. join() returns once every rank has joined; it turns the agreement off (call
  // enable_join() again for the next loop). Collectives of your own (consensus_distance(),
  // global_avg()) must wait until every rank has joined.
  void enable_join();
  void join();
  bool join_enabled() const { return join_enabled_; }
  // Steps this rank shadowed in its last join().
  int64_t shadowed_steps() const { return shadowed_steps_; }

  // Checkpoint (Note [checkpoint] in checkpoint.h, docs/checkpoint.md). Collective: every
  // rank calls it between two steps with the same folder. Saves this rank's parameters and
  // buffers, the bucket plan, each bucket's optimizer and scheduler state, the step and
  // update counts, the adaptive factor, the exchange in flight (waited for; its result is
  // saved and the next update applies it, as in an uninterrupted run) and `user_state`
  // (e.g. the data loader's position, generator states). Not allowed between forward and
  // backward, while accumulating gradients, or between global_avg(true) and its revert.
  void save(const std::string& dir, const NamedTensors& user_state = {});
  // Collective. Refuses (CheckpointError, on every rank) a checkpoint of another wrapper,
  // world size, ranks per node, topology or bucket plan, and a missing, torn or truncated
  // file; otherwise restores everything save() wrote (before or after the first backward)
  // and returns its user_state. Training then continues exactly as it would have.
  NamedTensors load(const std::string& dir);
  using torch::nn::Module::load;
  using torch::nn::Module::save;

  // Seconds this rank spent blocked on the wrappers' exchanges so far: in gossip mode waiting
  // for the previous exchange before an update, in all-reduce mode waiting for a gradient
  // reduction before the step, and in synchronize(). Exchanges that had finished cost nothing.
  double exchange_wait_seconds() const;
  // This rank's counters and timers (Note [metrics] in decent_dp/metrics.h): steps, updates,
  // exchanges and their bytes after encoding, time blocked on exchanges, encoding, decoding,
  // aggregation, optimizer steps and the privacy mechanism. reset() on it starts afresh.
  Metrics& metrics();
  const Metrics& metrics() const;

 protected:
  // Called by forward() before the wrapped module's forward.
  void before_forward();

  // ---- gossip-only operations, exposed by DecentralizedDataParallel ----
  double global_avg_impl(bool will_revert, bool return_d2c);
  void revert_global_avg_impl();
  double consensus_distance_impl();
  void set_adaptive_factor_impl(double a);
  double adaptive_factor_impl() const;

 private:
  void build_buckets();
  void check_between_steps(const char* what) const;
  int64_t agree_active(bool active);
  void shadow_step();
  void on_bucket(size_t b);
  void on_missing_gradient(size_t i);
  void take_update(Bucket& bucket);
  std::vector<at::Tensor> averaged_buffers();

  std::shared_ptr<torch::nn::Module> module_;
  DataParallelOptions options_;
  OptimFn optim_fn_;
  LrSchedulerFn scheduler_fn_;
  std::shared_ptr<Communicator> control_;  // CPU: model checks, bucket metadata
  std::shared_ptr<Communicator> data_;     // the parameters' device: exchanges
  ExchangeMode mode_;
  const char* who_;
  std::unique_ptr<topology::Topology> topology_;

  std::vector<std::string> names_;  // named_parameters() of the wrapped module, each tensor once
  std::vector<at::Tensor> params_;  // same order
  std::unique_ptr<ParamBinding> binding_;
  BucketSet buckets_;
  std::unique_ptr<Exchange> exchange_;
  GossipExchange* gossip_ = nullptr;  // exchange_ in gossip mode
  GlobalAverager averager_;
  std::unique_ptr<GradReady> ready_;
  std::vector<std::string> unused_;
  std::vector<char> warned_missing_;  // per parameter: a missing gradient was reported

  bool accumulate_ = false;
  bool join_enabled_ = false;
  int64_t shadowed_steps_ = 0;
  int64_t steps_ = 0;
  int64_t updates_ = 0;
  int64_t bucketed_numel_ = 0;  // parameter elements in the buckets (privacy's N)
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
