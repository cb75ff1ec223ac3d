#include "decent_dp/data_parallel.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <unordered_set>

#include "decent_dp/checkpoint.h"
#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/exchange.h"
#include "decent_dp/grad_ready.h"
#include "decent_dp/logging.h"
#include "decent_dp/model_sync.h"
#include "decent_dp/state_archive.h"

namespace decent_dp {

DataParallelCore::DataParallelCore(std::shared_ptr<torch::nn::Module> module,
                                   DataParallelOptions options, OptimFn optim_fn,
                                   LrSchedulerFn scheduler_fn, std::shared_ptr<Communicator> comm,
                                   ExchangeMode mode)
    : module_(std::move(module)),
      options_(std::move(options)),
      optim_fn_(std::move(optim_fn)),
      scheduler_fn_(std::move(scheduler_fn)),
      control_(comm ? std::move(comm) : default_communicator()),
      mode_(mode),
      who_(mode == ExchangeMode::kGossip ? "DecentralizedDataParallel"
                                         : "DistributedDataParallel") {
  const char* who = who_;
  DECENT_DP_CHECK_ARG(module_ != nullptr, who, ": module must not be null");
  DECENT_DP_CHECK_ARG(static_cast<bool>(optim_fn_), who,
                      ": an optimizer factory is required (e.g. decent_dp::optim::adamw())");
  DECENT_DP_CHECK_ARG(options_.bucket_cap_mb > 0, who, ": bucket_cap_mb must be > 0, got ",
                      options_.bucket_cap_mb);
  DECENT_DP_CHECK_ARG(options_.grad_clip_norm >= 0, who, ": grad_clip_norm must be >= 0, got ",
                      options_.grad_clip_norm);
  privacy::check(options_.privacy, who);
  DECENT_DP_CHECK_ARG(options_.local_world_size >= 0, who,
                      ": local_world_size must be >= 0 (0: found through MPI), got ",
                      options_.local_world_size);
  DECENT_DP_CHECK_ARG(mode_ == ExchangeMode::kGossip || (!options_.codec && !options_.aggregator),
                      who,
                      ": codec and aggregator apply to the gossip exchange only; leave them "
                      "null for all-reduce training");
  const int n = control_->size();
  const int lws =
      options_.local_world_size > 0 ? options_.local_world_size : control_->local_size();
  topology_ = topology::make_topology(
      mode_ == ExchangeMode::kGossip ? options_.topology : std::string("complete"), n, lws);

  // The wrapper exposes the wrapped module's parameters and buffers under the same names.
  for (const auto& child : module_->named_children()) {
    register_module(child.key(), child.value());
  }
  for (const auto& p : module_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : module_->named_buffers(/*recurse=*/false)) {
    register_buffer(b.key(), b.value());
  }
  // A tensor registered under several names (tied weights) is one parameter, known by its
  // first name, as torch's named_parameters() gives it in Python: one gradient (autograd
  // accumulates every use into it), one hook, one place in one bucket.
  std::unordered_set<const c10::TensorImpl*> seen_params;
  for (const auto& p : module_->named_parameters()) {
    if (seen_params.insert(p.value().unsafeGetTensorImpl()).second) {
      names_.push_back(p.key());
      params_.push_back(p.value());
    }
  }
  DECENT_DP_CHECK_ARG(!params_.empty(), who, ": the module has no parameters");
  warned_missing_.assign(params_.size(), 0);
  NamedTensors items;
  for (size_t i = 0; i < params_.size(); ++i) {
    items.emplace_back(names_[i], params_[i]);
  }
  std::vector<at::Tensor> state = params_;
  for (const auto& b : module_->named_buffers()) {
    items.emplace_back("buffer " + b.key(), b.value());
    state.push_back(b.value());
  }
  // Buckets group by (dtype, device); a model on several devices exchanges each bucket on
  // its device's communicator (Note [routed communicator]).
  const std::vector<c10::Device> devices = detail::distinct_devices(state);
  for (size_t i = 0; i < params_.size(); ++i) {
    DECENT_DP_CHECK_ARG(params_[i].device().is_cpu() || (!options_.codec && !options_.aggregator),
                        who, ": codecs and aggregators run on CPU buckets, and parameter '",
                        names_[i], "' is on ", params_[i].device().str(),
                        "; leave both null on a GPU (the mean is the all-reduce fast path)");
  }
  check_same_model(*control_, items);
  data_ = communicator_for_devices(devices, control_);
  broadcast_from_rank0(*data_, state);

  // Note [gradients in place]: only the all-reduce and the Gaussian mechanism need the
  // gradients in one block.
  binding_ =
      make_param_binding(options_.param_as_bucket_view, !options_.param_as_bucket_view ||
                                                            mode_ == ExchangeMode::kAllReduce ||
                                                            options_.privacy.enabled());
  if (mode_ == ExchangeMode::kGossip) {
    data_->make_groups(topology_->distinct_groups());
    auto gossip = std::make_unique<GossipExchange>(
        data_, *topology_, ExchangeStages{options_.codec, options_.aggregator});
    gossip_ = gossip.get();
    exchange_ = std::move(gossip);
  } else {
    exchange_ = std::make_unique<AllReduceExchange>(data_);
  }

  std::vector<size_t> hooked;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) {
      hooked.push_back(i);
    }
  }
  DECENT_DP_CHECK_ARG(!hooked.empty(), who, ": the module has no parameter that requires grad");
  GradReady::Handlers handlers;
  handlers.build = [this] { build_buckets(); };
  handlers.on_param = [this](size_t b, size_t k) { binding_->on_grad_ready(buckets_[b], k); };
  handlers.on_bucket = [this](size_t b) { on_bucket(b); };
  handlers.on_missing = [this](size_t i) { on_missing_gradient(i); };
  handlers.progress = [this](bool block) {
    exchange_->progress(block, [this](Bucket& bucket) { take_update(bucket); });
    if (block) {
      ++updates_;
    }
  };
  handlers.discard_gradients = [this] {
    at::NoGradGuard no_grad;
    if (buckets_.empty()) {
      for (auto& p : params_) {
        p.mutable_grad() = at::Tensor();
      }
      return;
    }
    for (Bucket& b : buckets_) {
      binding_->discard_grads(b);
    }
  };
  handlers.stray_backward_is_error = [this] { return !accumulate_ && is_training(); };
  ready_ = std::make_unique<GradReady>(params_, hooked, names_, who, std::move(handlers));
  if (control_->rank() == 0) {
    DECENT_DP_LOG_INFO(detail::cat(
        who, ": ", n, " ranks, topology ", topology_->name(), " (period ", topology_->period(),
        ", local world size ", lws, "), bucket_cap_mb ", options_.bucket_cap_mb,
        ", param_as_bucket_view ", options_.param_as_bucket_view, ", grad_clip_norm ",
        options_.grad_clip_norm, ", sync_buffers_in_global_avg ",
        options_.sync_buffers_in_global_avg, ", exchange ",
        options_.aggregator ? options_.aggregator->name() : std::string("mean"),
        options_.codec ? " of " + options_.codec->name() : std::string(), ", ", params_.size(),
        " parameters"));
  }
}

DataParallelCore::~DataParallelCore() {
  ready_.reset();
  // Exchanges still in flight hold their blocks alive; let them finish so no peer waits,
  // within one deadline for all of them.
  Exchange::drain(buckets_, std::chrono::milliseconds(env::shutdown_timeout_ms()));
}

void DataParallelCore::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void DataParallelCore::set_accumulate_grad(bool on) {
  accumulate_ = on;
}

void DataParallelCore::before_forward() {
  if (!is_training() || accumulate_ || !torch::autograd::GradMode::is_enabled()) {
    return;
  }
  for (const Bucket& b : buckets_) {
    check_untouched(b, *binding_, who_);  // Note [writes between steps]
  }
  if (join_enabled_) {
    ready_->check_not_failed();
    agree_active(true);  // Note [join]: matches a joined rank's shadow step
  }
  ready_->arm();
  ++steps_;
  exchange_->metrics().count("steps");
}

void DataParallelCore::build_buckets() {
  std::vector<size_t> order = ready_->first_order();
  // Every rank holds the same model (checked at construction), so all refuse alike here,
  // before the collective below.
  for (size_t i : order) {
    const at::Tensor& g = params_[i].grad();
    DECENT_DP_CHECK_ARG(!g.defined() || g.layout() == at::kStrided, who_, ": parameter '",
                        names_[i], "' received a gradient of layout ",
                        g.defined() ? c10::str(g.layout()) : std::string(),
                        "; the wrappers bucket, average and step dense (strided) "
                        "gradients (an Embedding or EmbeddingBag built with sparse(true)? build "
                        "it with sparse(false))");
  }
  const std::vector<size_t> agreed = agree_first_order(*control_, order, names_);
  if (agreed != order) {
    DECENT_DP_LOG_INFO(detail::cat(
        who_, ": rank ", control_->rank(),
        "'s gradients became ready in another order than rank 0's in the first iteration; "
        "the buckets follow rank 0's (Note [gradient order across ranks])"));
    order = agreed;
    ready_->restore_first_order(order);
  }
  // Parameters that never received a gradient are left out, with one warning each.
  std::vector<char> seen(params_.size(), 0);
  for (size_t i : order) {
    seen[i] = 1;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen[i] && params_[i].requires_grad()) {
      unused_.push_back(names_[i]);
      if (control_->rank() == 0) {
        DECENT_DP_LOG_WARN(detail::cat(
            "parameter '", names_[i],
            "' received no gradient in the first iteration; it is excluded from the buckets "
            "and keeps its initial value"));
      }
    }
  }
  BucketSetOptions o;
  o.bucket_cap_mb = options_.bucket_cap_mb;
  o.bind_grads = binding_->grads_in_block();
  o.layout_key = options_.bucket_layout_key;
  Communicator* data = data_.get();
  o.allocate = [data](int64_t numel, const at::TensorOptions& t) {
    return data->allocate(numel, t);
  };
  buckets_.build(order, params_, names_, *binding_, o);
  buckets_.attach_optimizers(optim_fn_, scheduler_fn_);
  std::vector<size_t> bucket_of(params_.size()), position_of(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    bucket_of[i] = buckets_.bucket_of(i);
    position_of[i] = buckets_.position_of(i);
  }
  if (control_->rank() == 0) {
    for (const Bucket& b : buckets_) {
      DECENT_DP_LOG_DEBUG(describe_bucket(b.index, b.spec, names_));
    }
    DECENT_DP_LOG_INFO(detail::cat(buckets_.size(), " bucket(s) over ", order.size(),
                                   " parameters, ", unused_.size(), " excluded"));
  }
  ready_->set_buckets(std::move(bucket_of), std::move(position_of), buckets_.sizes());
}

void DataParallelCore::on_missing_gradient(size_t i) {
  exchange_->metrics().count("missing_gradients");
  if (!warned_missing_[i]) {
    warned_missing_[i] = 1;
    DECENT_DP_LOG_WARN(detail::cat(
        who_, ": parameter '", names_[i], "' received no gradient in step ", steps_,
        " (it took no part in the loss, or no longer requires grad); its bucket updates with "
        "zero in its place, which still moves it under momentum or weight decay",
        mode_ == ExchangeMode::kGossip ? ", and mixes it with its peers" : "",
        " (spec section 7). Said once per parameter; the metric missing_gradients counts "
        "every time"));
  }
}

void DataParallelCore::on_bucket(size_t b) {
  at::NoGradGuard no_grad;
  Bucket& bucket = buckets_[b];
  binding_->before_update(bucket);
  if (options_.privacy.enabled()) {
    if (bucketed_numel_ == 0) {
      for (const Bucket& x : buckets_) {
        for (const at::Tensor& v : x.storage.param_views) {
          bucketed_numel_ += v.numel();
        }
      }
    }
    Metrics::Scope timed(&exchange_->metrics(), "privacy");
    privacy::privatize(bucket, options_.privacy, control_->rank(), updates_ + 1, bucketed_numel_);
  }
  exchange_->on_bucket_ready(bucket, updates_ + 1, [this](Bucket& x) { take_update(x); });
}

void DataParallelCore::take_update(Bucket& bucket) {
  at::NoGradGuard no_grad;
  Metrics::Scope timed(&exchange_->metrics(), "optimizer");
  exchange_->metrics().count("updates");
  update_bucket(bucket, *binding_, options_.grad_clip_norm);
  record_versions(bucket);
}

void DataParallelCore::synchronize() {
  ready_->check_not_failed();
  for (Bucket& b : buckets_) {
    exchange_->wait(b);
  }
}

double DataParallelCore::exchange_wait_seconds() const {
  return exchange_->wait_seconds();
}

Metrics& DataParallelCore::metrics() {
  return exchange_->metrics();
}

const Metrics& DataParallelCore::metrics() const {
  return exchange_->metrics();
}

double DataParallelCore::get_lr() const {
  DECENT_DP_CHECK_ARG(!buckets_.empty(),
                      "get_lr: no optimizer yet; buckets and their optimizers are built at the "
                      "end of the first backward");
  return buckets_[0].optimizer->param_groups()[0].options().get_lr();
}

size_t DataParallelCore::bucket_count() const {
  return buckets_.size();
}

const BucketSpec& DataParallelCore::bucket_spec(size_t b) const {
  return buckets_.at(b).spec;
}

const BucketStorage& DataParallelCore::bucket_storage(size_t b) const {
  return buckets_.at(b).storage;
}

torch::optim::Optimizer& DataParallelCore::optimizer(size_t b) {
  return *buckets_.at(b).optimizer;
}

torch::optim::LRScheduler* DataParallelCore::scheduler(size_t b) {
  return buckets_.at(b).scheduler.get();
}

void DataParallelCore::set_adaptive_factor_impl(double a) {
  gossip_->set_adaptive_factor(a);
}

double DataParallelCore::adaptive_factor_impl() const {
  return gossip_ != nullptr ? gossip_->adaptive_factor() : 1.0;
}

std::vector<at::Tensor> DataParallelCore::averaged_buffers() {
  std::vector<at::Tensor> out;
  if (options_.sync_buffers_in_global_avg) {
    for (const auto& buf : module_->named_buffers()) {
      if (buf.value().is_floating_point()) {
        out.push_back(buf.value());
      }
    }
  }
  return out;
}

double DataParallelCore::global_avg_impl(bool will_revert, bool return_d2c) {
  synchronize();  // pending results stay in the communication blocks
  const double d = averager_.global_avg(buckets_, *binding_, *data_, averaged_buffers(),
                                        will_revert, return_d2c);
  for (Bucket& b : buckets_) {
    record_versions(b);
  }
  return d;
}

void DataParallelCore::revert_global_avg_impl() {
  averager_.revert(buckets_, *binding_, averaged_buffers());
  for (Bucket& b : buckets_) {
    record_versions(b);
  }
}

double DataParallelCore::consensus_distance_impl() {
  ready_->check_not_failed();
  return GlobalAverager::consensus_distance(buckets_, *binding_, *data_);
}

void DataParallelCore::check_between_steps(const char* what) const {
  ready_->check_not_failed();
  DECENT_DP_CHECK_ARG(!ready_->armed(), who_, "::", what,
                      ": called between forward() and backward(); call it between steps");
  DECENT_DP_CHECK_ARG(!accumulate_, who_, "::", what,
                      ": called while gradients accumulate (no_sync / set_accumulate_grad); "
                      "call it after the step that uses them");
  DECENT_DP_CHECK_ARG(!averager_.has_backup(), who_, "::", what,
                      ": called between global_avg(will_revert = true) and "
                      "revert_global_avg(); call it before global_avg or after the revert");
}

// Note [checkpoint] for the format. Parameters and buffers are saved one by one (so the
// same file loads with either parameter binding); the bucket plan is iteration 1's order,
// rebuilt on load without a backward.
void DataParallelCore::save(const std::string& dir, const NamedTensors& user_state) {
  check_between_steps("save");
  torch::serialize::OutputArchive ar;
  std::vector<at::Tensor> buffers;
  for (const auto& b : module_->named_buffers()) {
    buffers.push_back(b.value());
  }
  {
    at::NoGradGuard no_grad;
    const auto& order = ready_->first_order();
    at::Tensor order64 = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
    for (size_t k = 0; k < order.size(); ++k) {
      order64.data_ptr<int64_t>()[k] = static_cast<int64_t>(order[k]);
    }
    state_archive::write_int(ar, "has_buckets", buckets_.empty() ? 0 : 1);
    state_archive::write_tensor(ar, "first_order", order64);
    state_archive::write_int(ar, "steps", steps_);
    state_archive::write_int(ar, "updates", updates_);
    state_archive::write_double(ar, "adaptive_factor", adaptive_factor_impl());
    state_archive::write_tensors(ar, "param_", params_);
    state_archive::write_tensors(ar, "buffer_", buffers);
    state_archive::write_buckets(ar, buckets_, *exchange_, updates_);
    state_archive::write_user_state(ar, user_state);
  }
  CheckpointManifest m;
  m.wrapper = who_;
  m.world_size = control_->size();
  m.local_world_size = topology_->local_world_size();
  m.topology = topology_->name();
  m.period = topology_->period();
  m.steps = steps_;
  m.updates = updates_;
  m.buckets = state_archive::describe(buckets_);
  checkpoint::save(*control_, dir, m, ar);
}

NamedTensors DataParallelCore::load(const std::string& dir) {
  check_between_steps("load");
  synchronize();  // exchanges in flight finish; their results are replaced below
  CheckpointManifest expected;
  expected.wrapper = who_;
  expected.world_size = control_->size();
  expected.local_world_size = topology_->local_world_size();
  expected.topology = topology_->name();
  torch::serialize::InputArchive ar;
  const CheckpointManifest saved = checkpoint::load(*control_, dir, expected, ar);
  const std::string mfile = checkpoint::manifest_file(dir);
  const std::string what = detail::cat("checkpoint load from ", dir);

  // The bucket plan: rebuilt from iteration 1's order, or checked against the existing one.
  std::vector<size_t> order;
  bool build = false;
  std::string error;
  try {
    const bool had = state_archive::read_int(ar, "has_buckets") != 0;
    const at::Tensor t = state_archive::read_tensor(ar, "first_order");
    for (int64_t k = 0; k < t.numel(); ++k) {
      order.push_back(static_cast<size_t>(t.data_ptr<int64_t>()[k]));
    }
    if (buckets_.empty() && had) {
      ready_->restore_first_order(order);
      build = true;
    } else if (!buckets_.empty() && !had) {
      throw CheckpointError(
          detail::cat(mfile,
                      ": field 'buckets' is empty (saved before the first backward), this wrapper "
                      "has trained; load it into a freshly made wrapper"));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  checkpoint::agree(*control_, what, error);
  if (build) {
    build_buckets();  // collective, like iteration 1's
  }
  NamedTensors user;
  error.clear();
  try {
    state_archive::check_plan(saved.buckets, state_archive::describe(buckets_), mfile);
    std::vector<std::string> buffer_names;
    std::vector<at::Tensor> buffers;
    for (const auto& b : module_->named_buffers()) {
      buffer_names.push_back("buffer " + b.key());
      buffers.push_back(b.value());
    }
    state_archive::read_tensors_into(ar, "param_", params_, names_);
    state_archive::read_tensors_into(ar, "buffer_", buffers, buffer_names);
    at::NoGradGuard no_grad;
    for (Bucket& b : buckets_) {
      binding_->load_block(b);
    }
    state_archive::read_buckets(ar, buckets_, *exchange_);
    steps_ = state_archive::read_int(ar, "steps");
    updates_ = state_archive::read_int(ar, "updates");
    for (Bucket& b : buckets_) {
      record_versions(b);
    }
    if (gossip_ != nullptr) {
      gossip_->set_adaptive_factor(state_archive::read_double(ar, "adaptive_factor"));
    }
    user = state_archive::read_user_state(ar);
  } catch (const std::exception& e) {
    error = e.what();
  }
  checkpoint::agree(*control_, what, error);
  return user;
}

// Note [join]
// Ranks with different numbers of batches. While join is enabled every step begins with an
// all-reduce (sum) of one flag over all ranks: 1 from a rank that trains the step, 0 from a
// rank that has joined. A joined rank loops: agree; if nobody trains, stop; otherwise
// shadow the step, taking part in every bucket's exchange in bucket order exactly as a
// training rank's backward does (the same slot, the same groups, the same order of
// operations on every communicator). What it contributes:
//   gossip      its parameters as they are; it mixes the group's result in (spec §2) but
//               takes no optimizer step, so joined ranks keep receiving their peers' progress
//   all-reduce  zero gradients (a backward in which no gradient arrived, spec §7); it takes
//               the averaged update like everyone else, so all ranks stay identical
// The agreement costs one small collective per step, only while join is enabled.
void DataParallelCore::enable_join() {
  check_between_steps("enable_join");
  join_enabled_ = true;
}

int64_t DataParallelCore::agree_active(bool active) {
  at::Tensor flag = at::empty({1}, at::kLong);
  flag.data_ptr<int64_t>()[0] = active ? 1 : 0;
  if (control_->size() > 1) {
    control_->allreduce(flag, flag, AllreduceOptions{ReduceOp::kSum, {}, {}, "join agreement"})
        ->wait();
  }
  return flag.data_ptr<int64_t>()[0];
}

void DataParallelCore::shadow_step() {
  at::NoGradGuard no_grad;
  const int64_t u = updates_ + 1;
  for (Bucket& b : buckets_) {
    if (mode_ == ExchangeMode::kGossip) {
      binding_->load_block(b);
      exchange_->apply(b, u);
      binding_->store_block(b);
      exchange_->launch(b, u);
      record_versions(b);
    } else {
      on_bucket(b.index);  // no gradient arrived: zeros, the all-reduce, the update
    }
  }
  exchange_->progress(/*block=*/true, [this](Bucket& x) { take_update(x); });
  ++updates_;
}

void DataParallelCore::join() {
  DECENT_DP_CHECK_ARG(join_enabled_, who_,
                      "::join: join is not enabled; call enable_join() on every rank before "
                      "the training loop");
  check_between_steps("join");
  DECENT_DP_CHECK_ARG(!buckets_.empty(), who_,
                      "::join: this rank has not trained a single step; every rank needs at "
                      "least one batch (the first step builds the buckets on all ranks)");
  shadowed_steps_ = 0;
  while (agree_active(false) > 0) {
    shadow_step();
    ++shadowed_steps_;
  }
  join_enabled_ = false;
  if (shadowed_steps_ > 0) {
    DECENT_DP_LOG_INFO(detail::cat(who_, ": joined after update ", updates_ - shadowed_steps_,
                                   "; shadowed ", shadowed_steps_, " step(s) of the other ranks"));
  }
}

}  // namespace decent_dp
