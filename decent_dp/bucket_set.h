// The buckets of a wrapper (Note [bucket plan] in bucket.h) with what each one owns: its
// flat blocks, the model's tensors in it, its optimizer and scheduler, and the exchange in
// flight. How the model's parameters relate to the blocks is one policy object, the
// ParamBinding (Note [parameter binding]); nothing else branches on it.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "decent_dp/bucket.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/pre_mixing.h"
#include "decent_dp/topology/topology.h"
#include "decent_dp/work.h"

namespace decent_dp {

// What an exchange keeps per bucket beyond the communication block (e.g. the receive
// buffers of a gather).
struct ExchangeState {
  virtual ~ExchangeState() = default;
};

struct Bucket {
  size_t index = 0;
  BucketSpec spec;
  BucketStorage storage;
  std::vector<std::string> names;  // of its parameters, in spec order
  std::vector<at::Tensor> params;  // the model's tensors, in spec order
  // The tensors the optimizer steps, whose data are the parameter views: the model's own
  // tensors with the view binding, leaf aliases of the block with the copy binding.
  std::vector<at::Tensor> optimizer_params;
  std::unique_ptr<torch::optim::Optimizer>
      optimizer;  // null when the caller steps (optimizer wrapper)
  std::unique_ptr<torch::optim::LRScheduler> scheduler;
  // The optimizer's pre-mixing hook when it has one (Note [pre-mixing hook]), else null.
  PreMixingHook* pre_mixing = nullptr;
  std::shared_ptr<Work> work;              // exchange in flight (or done, not yet applied)
  const topology::Group* group = nullptr;  // the group of that exchange (gossip)
  int64_t exchange_update = 0;             // the update that launched it
  std::vector<int64_t> versions;           // params' version counters after the last update
  std::unique_ptr<ExchangeState> exchange_state;
};

// Note [parameter binding]
// View binding (param_as_bucket_view = true, the default): every parameter's data is its
// view of the parameter block, so the optimizer and the exchange work on the model's own
// memory; where the gradients live is Note [gradients in place]. After a bucket's update
// its gradients are released (set to none, as zero_grad() does; Note [releasing gradients]).
//
// Note [gradients in place]
// Only the all-reduce exchange (and the Gaussian mechanism, which clips and noises the
// bucket's gradient as one vector) needs the gradients in one block: there every gradient
// is moved into its view of the gradient block as it arrives. Gossip needs the gradients
// only for the optimizer, so with the view binding they stay where autograd put them and
// there is no gradient block: the fused optimizers step the flat parameter and state
// blocks' views with the gradients as they are (Note [flat parameter groups]), which
// saves a copy of every gradient per step (2-5% of a 10 M-parameter CNN's step on one core,
// 10% of a 21 M-parameter MLP's: docs/benchmarks.md) and a block of the parameters' size.
// A gradient that did not arrive becomes zeros.
//
// Copy binding: the parameters keep their storage; the optimizer steps leaf aliases of the
// block, and the model's parameters and gradients are copied in before each update and the
// parameters out after it (gradients are zeroed instead of released).
class ParamBinding {
 public:
  virtual ~ParamBinding() = default;
  virtual bool as_view() const = 0;
  // Whether each gradient is bound to its view of the bucket's gradient block.
  virtual bool grads_in_block() const = 0;
  // Called once the storage exists: the tensors the optimizer of `bucket` steps.
  virtual std::vector<at::Tensor> make_optimizer_params(Bucket& bucket) const = 0;
  // Inside a hook: parameter k of `bucket` has its gradient for this backward.
  virtual void on_grad_ready(Bucket& bucket, size_t k) const = 0;
  // The bucket is complete: its blocks hold the model's parameters and this backward's
  // gradients (a gradient that did not arrive counts as zero, spec §7).
  virtual void before_update(Bucket& bucket) const = 0;
  // After the optimizer's step: gradients released or zeroed, the model sees the block.
  virtual void after_update(Bucket& bucket) const = 0;
  // Drops the gradients of an abandoned backward (released or zeroed).
  virtual void discard_grads(Bucket& bucket) const = 0;
  // Outside the update (global averaging): the parameter block <- the model, and back.
  virtual void load_block(Bucket& bucket) const = 0;
  virtual void store_block(Bucket& bucket) const = 0;
};

// `grads_in_block` false (Note [gradients in place]) is for the view binding only.
std::unique_ptr<ParamBinding> make_param_binding(bool as_view, bool grads_in_block = true);

// Orders parameters inside a bucket: parameters with a smaller key come first (stable), so
// that every optimizer group is one contiguous run of the blocks and steps flat
// (Note [flat parameter groups] in optim/flat_layout.h). The order inside a bucket changes
// no value: every exchange and optimizer works element by element.
using LayoutKey = std::function<int(const std::string& name, const at::Tensor& param)>;
// The key matching the library's optimizer factories: decayed parameters first
// (optim::default_weight_decay), as their groups are built.
int default_layout_key(const std::string& name, const at::Tensor& param);

struct BucketSetOptions {
  double bucket_cap_mb = 25;
  bool bind_grads = true;  // false: no gradient block (the optimizer wrapper)
  LayoutKey layout_key;    // empty: gradient-ready order inside each bucket
  BlockAllocator allocate;
};

class BucketSet {
 public:
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();

  // Plans the buckets over `order` (indices into `params`, in gradient-ready order) and
  // makes their storage through `binding`.
  void build(const std::vector<size_t>& order, const std::vector<at::Tensor>& params,
             const std::vector<std::string>& names, const ParamBinding& binding,
             const BucketSetOptions& options);
  // One optimizer and (optionally) one scheduler per bucket from the factories; checks that
  // each optimizer steps exactly its bucket's tensors.
  void attach_optimizers(const optim::OptimFn& optim_fn, const optim::LrSchedulerFn& scheduler_fn);

  bool empty() const { return buckets_.empty(); }
  size_t size() const { return buckets_.size(); }
  Bucket& operator[](size_t b) { return buckets_[b]; }
  const Bucket& operator[](size_t b) const { return buckets_[b]; }
  Bucket& at(size_t b);
  const Bucket& at(size_t b) const;
  std::vector<Bucket>::iterator begin() { return buckets_.begin(); }
  std::vector<Bucket>::iterator end() { return buckets_.end(); }
  // Bucket of parameter i and its position there (kNone when not bucketed).
  size_t bucket_of(size_t i) const { return i < bucket_of_.size() ? bucket_of_[i] : kNone; }
  size_t position_of(size_t i) const { return position_of_[i]; }
  // Parameters per bucket, for counting arrivals.
  std::vector<size_t> sizes() const;

 private:
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<size_t> position_of_;
};

// Note [writes between steps]
// A gossip bucket's exchange in flight carries the parameters as they were after update u,
// and the next update mixes its result in: with the block swap the parameters become the
// group's mean, so an in-place write between the two (weight clipping, surgery) would be
// silently undone. The wrappers therefore record every parameter's version counter after
// their own writes and, before the next step uses the bucket, refuse a changed one while an
// exchange is pending (the all-reduce wrapper has none between steps, so writes there are
// simply kept). With the view binding they also check that each parameter still lives in
// its bucket's block: torch::load into the module, .to() or set_data() after the first
// backward re-point it, and the wrapper would go on training memory the model no longer
// uses. Writes through .data() bypass the version counter and are not seen.
void record_versions(Bucket& bucket);
// Throws Error naming `who`, the parameter and what to do instead.
void check_untouched(const Bucket& bucket, const ParamBinding& binding, const char* who);

// One bucket's update (spec §2 step 3): clip its gradient norm to `grad_clip_norm` (> 0),
// step its optimizer, release its gradients, step its scheduler.
void update_bucket(Bucket& bucket, const ParamBinding& binding, double grad_clip_norm);

}  // namespace decent_dp
