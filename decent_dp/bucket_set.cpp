#include "decent_dp/bucket_set.h"

#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

// Makes the gradient of `p` the view `view`, keeping what it accumulated elsewhere; with
// `zero_if_missing`, a missing gradient becomes a zeroed view.
void bind_grad(at::Tensor& p, const at::Tensor& view, bool zero_if_missing) {
  if (p.grad().is_same(view)) {
    return;
  }
  if (p.grad().defined()) {
    view.copy_(p.grad());
  } else if (zero_if_missing) {
    view.zero_();
  }
  p.mutable_grad() = view;
}

class ViewBinding final : public ParamBinding {
 public:
  explicit ViewBinding(bool grads_in_block) : grads_in_block_(grads_in_block) {}
  bool as_view() const override { return true; }
  bool grads_in_block() const override { return grads_in_block_; }
  std::vector<at::Tensor> make_optimizer_params(Bucket& bucket) const override {
    return bucket.params;
  }
  void on_grad_ready(Bucket& bucket, size_t k) const override {
    // In the block, the gradient must live in its view; an optimizer's or module's
    // zero_grad(set_to_none) makes autograd allocate a fresh one: move it in. Otherwise it
    // stays where it is (Note [gradients in place]).
    if (grads_in_block_) {
      bind_grad(bucket.params[k], bucket.storage.grad_views[k], /*zero_if_missing=*/false);
    }
  }
  void before_update(Bucket& bucket) const override {
    // A gradient accumulated without this backward (no_sync) moves in; one that did not
    // arrive counts as zero.
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      at::Tensor& p = bucket.params[k];
      if (grads_in_block_) {
        bind_grad(p, bucket.storage.grad_views[k], /*zero_if_missing=*/true);
      } else if (!p.grad().defined()) {
        p.mutable_grad() = at::zeros_like(p, at::MemoryFormat::Preserve);
      }
    }
  }
  void after_update(Bucket& bucket) const override {
    // Note [releasing gradients]: the gradients are dropped (set to none) instead of zeroed.
    // The next backward's AccumulateGrad then takes over the gradient it computed instead of
    // adding it into a zeroed view, and on_grad_ready copies it into the view: one pass over
    // the block instead of three (zero, read-add-write), no allocation either way.
    for (auto& p : bucket.params) {
      p.mutable_grad() = at::Tensor();
    }
  }
  void discard_grads(Bucket& bucket) const override { after_update(bucket); }
  void load_block(Bucket& /*bucket*/) const override {}
  void store_block(Bucket& /*bucket*/) const override {}

 private:
  bool grads_in_block_;
};

class CopyBinding final : public ParamBinding {
 public:
  bool as_view() const override { return false; }
  bool grads_in_block() const override { return true; }
  std::vector<at::Tensor> make_optimizer_params(Bucket& bucket) const override {
    std::vector<at::Tensor> shadows;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      at::Tensor shadow = bucket.storage.param_views[k].detach();
      shadow.requires_grad_(true);
      if (!bucket.storage.grad_views.empty() && bucket.storage.grad_views[k].defined()) {
        shadow.mutable_grad() = bucket.storage.grad_views[k];
        const at::Tensor& g = bucket.params[k].grad();
        if (g.defined()) {
          bucket.storage.grad_views[k].copy_(g);
        }
      }
      shadows.push_back(shadow);
    }
    return shadows;
  }
  void on_grad_ready(Bucket& /*bucket*/, size_t /*k*/) const override {}
  void before_update(Bucket& bucket) const override {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.storage.param_views[k].copy_(bucket.params[k].detach());
      const at::Tensor& g = bucket.params[k].grad();
      if (g.defined()) {
        bucket.storage.grad_views[k].copy_(g);
      }
    }
  }
  void after_update(Bucket& bucket) const override {
    bucket.storage.grads.zero_();
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.params[k].detach().copy_(bucket.storage.param_views[k]);
      if (bucket.params[k].grad().defined()) {
        bucket.params[k].mutable_grad().zero_();
      }
    }
  }
  void discard_grads(Bucket& bucket) const override {
    bucket.storage.grads.zero_();
    for (auto& p : bucket.params) {
      if (p.grad().defined()) {
        p.mutable_grad().zero_();
      }
    }
  }
  void load_block(Bucket& bucket) const override {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.storage.param_views[k].copy_(bucket.params[k].detach());
    }
  }
  void store_block(Bucket& bucket) const override {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.params[k].detach().copy_(bucket.storage.param_views[k]);
    }
  }
};

// Reorders the parameters of `spec` stably by key and recomputes the offsets.
void order_within(BucketSpec& spec, const std::vector<at::Tensor>& params,
                  const std::vector<std::string>& names, const LayoutKey& key) {
  std::vector<std::pair<int, size_t>> keyed;
  for (size_t i : spec.params) {
    keyed.emplace_back(key(names[i], params[i]), i);
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  int64_t offset = 0;
  for (size_t k = 0; k < keyed.size(); ++k) {
    spec.params[k] = keyed[k].second;
    spec.offsets[k] = offset;
    offset += align_numel(params[keyed[k].second].numel());
  }
}

}  // namespace

std::unique_ptr<ParamBinding> make_param_binding(bool as_view, bool grads_in_block) {
  if (as_view) {
    return std::make_unique<ViewBinding>(grads_in_block);
  }
  DECENT_DP_CHECK_ARG(grads_in_block,
                      "make_param_binding: the copy binding keeps the gradients in the block");
  return std::make_unique<CopyBinding>();
}

int default_layout_key(const std::string& name, const at::Tensor& param) {
  return optim::default_weight_decay(name, param) ? 0 : 1;
}

void BucketSet::build(const std::vector<size_t>& order, const std::vector<at::Tensor>& params,
                      const std::vector<std::string>& names, const ParamBinding& binding,
                      const BucketSetOptions& options) {
  DECENT_DP_CHECK_ARG(buckets_.empty(), "BucketSet::build: the buckets exist already");
  std::vector<BucketEntry> entries;
  for (size_t i : order) {
    entries.push_back({i, params[i].numel(), params[i].scalar_type(), params[i].device()});
  }
  // Caps beyond what int64 bytes hold (up to infinity) mean one bucket per dtype and device.
  const double cap_bytes = options.bucket_cap_mb * (1 << 20);
  const int64_t cap = cap_bytes >= 9.0e18 ? std::numeric_limits<int64_t>::max()
                                          : std::max<int64_t>(1, static_cast<int64_t>(cap_bytes));
  auto specs = plan_buckets(entries, std::max<int64_t>(cap, 1));
  at::NoGradGuard no_grad;
  bucket_of_.assign(params.size(), kNone);
  position_of_.assign(params.size(), kNone);
  buckets_.resize(specs.size());
  for (size_t b = 0; b < specs.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.index = b;
    bucket.spec = std::move(specs[b]);
    if (options.layout_key) {
      order_within(bucket.spec, params, names, options.layout_key);
    }
    for (size_t k = 0; k < bucket.spec.params.size(); ++k) {
      const size_t i = bucket.spec.params[k];
      bucket.params.push_back(params[i]);
      bucket.names.push_back(names[i]);
      bucket_of_[i] = b;
      position_of_[i] = k;
    }
    bucket.storage = make_bucket_storage(bucket.spec, bucket.params, binding.as_view(),
                                         options.bind_grads, options.allocate);
    bucket.optimizer_params = binding.make_optimizer_params(bucket);
  }
}

void BucketSet::attach_optimizers(const optim::OptimFn& optim_fn,
                                  const optim::LrSchedulerFn& scheduler_fn) {
  for (Bucket& bucket : buckets_) {
    const size_t b = bucket.index;
    optim::NamedParams named;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      named.emplace_back(bucket.names[k], bucket.optimizer_params[k]);
    }
    bucket.optimizer = optim_fn(named);
    DECENT_DP_CHECK_ARG(bucket.optimizer != nullptr,
                        "the optimizer factory returned null for bucket ", b);
    // The optimizer must step exactly this bucket's tensors, each once.
    std::unordered_map<const c10::TensorImpl*, size_t> position;
    for (size_t k = 0; k < bucket.optimizer_params.size(); ++k) {
      position.emplace(bucket.optimizer_params[k].unsafeGetTensorImpl(), k);
    }
    std::vector<char> stepped(bucket.optimizer_params.size(), 0);
    for (const auto& group : bucket.optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        const auto it = position.find(p.unsafeGetTensorImpl());
        DECENT_DP_CHECK_ARG(it != position.end(),
                            "the optimizer factory returned an optimizer over tensors "
                            "that are not the parameters it was given (bucket ",
                            b, ")");
        DECENT_DP_CHECK_ARG(!stepped[it->second],
                            "the optimizer factory returned an optimizer "
                            "that lists parameter '",
                            bucket.names[it->second], "' twice (bucket ", b,
                            "); expected each of its ", bucket.optimizer_params.size(),
                            " parameters exactly once");
        stepped[it->second] = 1;
      }
    }
    for (size_t k = 0; k < stepped.size(); ++k) {
      DECENT_DP_CHECK_ARG(stepped[k],
                          "the optimizer factory returned an optimizer that omits "
                          "parameter '",
                          bucket.names[k], "' (bucket ", b, "); expected each of its ",
                          bucket.optimizer_params.size(), " parameters exactly once");
    }
    bucket.pre_mixing = dynamic_cast<PreMixingHook*>(bucket.optimizer.get());
    if (scheduler_fn) {
      bucket.scheduler = scheduler_fn(*bucket.optimizer);
      DECENT_DP_CHECK_ARG(bucket.scheduler != nullptr,
                          "the scheduler factory returned null for bucket ", b);
    }
  }
}

Bucket& BucketSet::at(size_t b) {
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return buckets_[b];
}

const Bucket& BucketSet::at(size_t b) const {
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return buckets_[b];
}

std::vector<size_t> BucketSet::sizes() const {
  std::vector<size_t> out;
  for (const auto& b : buckets_) {
    out.push_back(b.params.size());
  }
  return out;
}

void update_bucket(Bucket& bucket, const ParamBinding& binding, double grad_clip_norm) {
  if (grad_clip_norm > 0) {
    // The bucket's gradient norm: of the block, or (Note [gradients in place]) of the
    // tensors' norms. The factor is torch's clip_grad_norm_ arithmetic, in the norm's dtype:
    // min(1, 1 / (norm + 1e-6) * c); a factor of 1 leaves the gradients unchanged.
    std::vector<at::Tensor> grads;
    at::Tensor norm;
    if (binding.grads_in_block()) {
      grads.push_back(bucket.storage.grads);
      norm = bucket.storage.grads.norm();
    } else {
      for (const at::Tensor& p : bucket.params) {
        grads.push_back(p.grad());
      }
      norm = at::stack(at::_foreach_norm(grads, 2)).norm();
    }
    const at::Tensor coef = norm.add_(1e-6).reciprocal_().mul_(grad_clip_norm).clamp_max_(1.0);
    // On a GPU the factor stays on the device (no host sync per bucket).
    if (!coef.is_cpu() || coef.item<double>() < 1.0) {
      at::_foreach_mul_(grads, coef);
    }
  }
  bucket.optimizer->step();
  if (bucket.scheduler) {
    bucket.scheduler->step();
  }
  binding.after_update(bucket);
}

void record_versions(Bucket& bucket) {
  bucket.versions.resize(bucket.params.size());
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    bucket.versions[k] = bucket.params[k]._version();
  }
}

void check_untouched(const Bucket& bucket, const ParamBinding& binding, const char* who) {
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const at::Tensor& p = bucket.params[k];
    if (binding.as_view() && p.data_ptr() != bucket.storage.param_views[k].data_ptr()) {
      throw Error(detail::cat(
          who, ": parameter '", bucket.names[k],
          "' no longer lives in its bucket's memory (loaded with torch::load, moved with .to() "
          "or given new data with set_data() after the first backward?), so the wrapper would "
          "train memory the model no longer uses. Load checkpoints with the wrapper's load(), "
          "and move or replace parameters before wrapping the module"));
    }
    if (bucket.work && k < bucket.versions.size() && p._version() != bucket.versions[k]) {
      throw Error(detail::cat(
          who, ": parameter '", bucket.names[k], "' was written in place after update ",
          bucket.exchange_update,
          ", while that update's exchange is in flight: mixing its result in would undo the "
          "write (Note [writes between steps]). Change parameters inside the optimizer's step, "
          "or call global_avg(false) first (it settles the exchanges; every rank then holds "
          "the mean)"));
    }
  }
}

}  // namespace decent_dp
