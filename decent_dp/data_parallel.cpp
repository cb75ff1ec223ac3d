#include "decent_dp/data_parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "decent_dp/grad_hooks.h"
#include "decent_dp/logging.h"
#include "decent_dp/mpi_communicator.h"
#include "topology/errors.h"

namespace decent_dp {
namespace {

constexpr size_t kNotBucketed = std::numeric_limits<size_t>::max();

std::string shape_string(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << c10::toString(t.scalar_type());
  return os.str();
}

int64_t signature_of(const std::string& name, const at::Tensor& t) {
  uint64_t h = std::hash<std::string>{}(name);
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t s : t.sizes())
    mix(static_cast<uint64_t>(s));
  mix(static_cast<uint64_t>(t.scalar_type()));
  mix(static_cast<uint64_t>(t.requires_grad()));
  return static_cast<int64_t>(h);
}

// All-gathers one int64 per rank.
std::vector<int64_t> allgather_scalar(Communicator& comm, int64_t v) {
  auto in = at::full({1}, v, at::kLong);
  auto out = at::empty({comm.size()}, at::kLong);
  comm.allgather(out, in)->wait();
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + comm.size());
}

// All-gathers `values` (same length on every rank, checked by the caller) into rows.
std::vector<std::vector<int64_t>> allgather_vector(Communicator& comm,
                                                   const std::vector<int64_t>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  auto in = at::empty({n}, at::kLong);
  std::copy(values.begin(), values.end(), in.data_ptr<int64_t>());
  auto out = at::empty({n * comm.size()}, at::kLong);
  comm.allgather(out, in)->wait();
  std::vector<std::vector<int64_t>> rows(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    rows[r].assign(out.data_ptr<int64_t>() + r * n, out.data_ptr<int64_t>() + (r + 1) * n);
  }
  return rows;
}

}  // namespace

std::shared_ptr<Communicator> default_communicator() {
  // Constructed in the initializer, so its destructor runs before the MPI finalization that
  // its constructor registers with atexit.
  static std::shared_ptr<Communicator> instance = std::make_shared<MpiCommunicator>();
  return instance;
}

struct DataParallelCore::Bucket {
  BucketSpec spec;
  BucketStorage storage;
  std::vector<at::Tensor> params;            // the model's parameters in this bucket
  std::vector<at::Tensor> optimizer_params;  // what the optimizer steps (== params in view mode)
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<torch::optim::LRScheduler> scheduler;
  std::shared_ptr<Work> work;              // exchange in flight (or done, not yet applied)
  const topology::Group* group = nullptr;  // the group of that exchange
};

DataParallelCore::DataParallelCore(std::shared_ptr<torch::nn::Module> module,
                                   DataParallelOptions options, OptimFn optim_fn,
                                   LrSchedulerFn scheduler_fn, std::shared_ptr<Communicator> comm,
                                   ExchangeMode mode)
    : module_(std::move(module)),
      options_(std::move(options)),
      optim_fn_(std::move(optim_fn)),
      scheduler_fn_(std::move(scheduler_fn)),
      comm_(comm ? std::move(comm) : default_communicator()),
      mode_(mode) {
  const char* who =
      mode_ == ExchangeMode::kGossip ? "DecentralizedDataParallel" : "DistributedDataParallel";
  DECENT_DP_CHECK_ARG(module_ != nullptr, who, ": module must not be null");
  DECENT_DP_CHECK_ARG(static_cast<bool>(optim_fn_), who,
                      ": an optimizer factory is required (e.g. decent_dp::optim::adamw())");
  DECENT_DP_CHECK_ARG(options_.bucket_cap_mb > 0, who, ": bucket_cap_mb must be > 0, got ",
                      options_.bucket_cap_mb);
  DECENT_DP_CHECK_ARG(options_.grad_clip_norm >= 0, who, ": grad_clip_norm must be >= 0, got ",
                      options_.grad_clip_norm);
  DECENT_DP_CHECK_ARG(options_.local_world_size >= 0, who,
                      ": local_world_size must be >= 0 (0: found through MPI), got ",
                      options_.local_world_size);
  const int n = comm_->size();
  for (int r = 0; r < n; ++r)
    all_ranks_.push_back(r);
  const int lws = options_.local_world_size > 0 ? options_.local_world_size : comm_->local_size();
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
  for (const auto& p : module_->named_parameters()) {
    DECENT_DP_CHECK_ARG(p.value().device().is_cpu(), who, ": parameter '", p.key(), "' is on ",
                        p.value().device().str(),
                        "; this build communicates CPU tensors over MPI (CUDA tensors need the "
                        "NCCL backend)");
    names_.push_back(p.key());
    params_.push_back(p.value());
  }
  check_same_model();
  broadcast_initial_state();
  if (mode_ == ExchangeMode::kGossip) {
    comm_->make_groups(topology_->distinct_groups());
  }
  std::vector<at::Tensor> hooked;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) {
      hooked_.push_back(i);
      hooked.push_back(params_[i]);
    }
  }
  DECENT_DP_CHECK_ARG(!hooked.empty(), who, ": the module has no parameter that requires grad");
  hooks_ =
      std::make_unique<GradReadyHooks>(hooked, [this](size_t k) { on_grad_ready(hooked_[k]); });
  ready_.assign(params_.size(), 0);
  bucket_of_.assign(params_.size(), kNotBucketed);
  if (comm_->rank() == 0) {
    DECENT_DP_LOG_INFO(detail::cat(
        who, ": ", n, " ranks, topology ", topology_->name(), " (period ", topology_->period(),
        ", local world size ", lws, "), bucket_cap_mb ", options_.bucket_cap_mb,
        ", param_as_bucket_view ", options_.param_as_bucket_view, ", grad_clip_norm ",
        options_.grad_clip_norm, ", sync_buffers_in_global_avg ",
        options_.sync_buffers_in_global_avg, ", ", params_.size(), " parameters"));
  }
}

DataParallelCore::~DataParallelCore() {
  hooks_.reset();
  // Exchanges still in flight hold their blocks alive; let them finish so no peer waits.
  for (auto& b : buckets_) {
    wait_in_destructor(b.work);
  }
}

void DataParallelCore::check_same_model() {
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (size_t i = 0; i < params_.size(); ++i)
    items.emplace_back(names_[i], params_[i]);
  for (const auto& b : module_->named_buffers())
    items.emplace_back("buffer " + b.key(), b.value());
  const auto counts = allgather_scalar(*comm_, static_cast<int64_t>(items.size()));
  for (int r = 0; r < comm_->size(); ++r) {
    if (counts[r] != counts[0]) {
      throw InvalidArgument(detail::cat("the model differs across ranks: rank 0 has ", counts[0],
                                        " parameters and buffers, rank ", r, " has ", counts[r]));
    }
  }
  std::vector<int64_t> sig;
  for (const auto& [name, t] : items)
    sig.push_back(signature_of(name, t));
  const auto rows = allgather_vector(*comm_, sig);
  for (size_t k = 0; k < items.size(); ++k) {
    for (int r = 1; r < comm_->size(); ++r) {
      if (rows[r][k] != rows[0][k]) {
        throw InvalidArgument(detail::cat("the model differs across ranks: entry ", k, " ('",
                                          items[k].first, "', ", shape_string(items[k].second),
                                          " on rank ", comm_->rank(),
                                          ") does not match between rank 0 and rank ", r,
                                          " (names, shapes, dtypes and order must be identical)"));
      }
    }
  }
}

void DataParallelCore::broadcast_initial_state() {
  if (comm_->size() == 1)
    return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors = params_;
  for (const auto& b : module_->named_buffers())
    tensors.push_back(b.value());
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (original, contiguous copy)
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& t : tensors) {
    at::Tensor c = t.detach().is_contiguous() ? t.detach() : t.detach().contiguous();
    staged.emplace_back(t, c);
    works.push_back(comm_->broadcast(c, 0));
  }
  for (auto& w : works)
    w->wait();
  for (auto& [orig, c] : staged) {
    if (!c.is_same(orig) && c.data_ptr() != orig.data_ptr())
      orig.detach().copy_(c);
  }
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
  ++steps_;
  armed_ = true;
  backward_done_ = false;
}

void DataParallelCore::on_grad_ready(size_t i) {
  if (!armed_) {
    if (backward_done_ && !accumulate_ && is_training()) {
      throw Error(
          "a second backward within one step: call forward() before each backward() (use "
          "no_sync() / set_accumulate_grad(true) to accumulate gradients over several "
          "backwards)");
    }
    return;  // accumulating, or not a training step
  }
  if (!callback_queued_) {
    callback_queued_ = true;
    GradReadyHooks::queue_end_of_backward([this] { end_of_backward(); });
  }
  if (ready_[i]) {
    throw Error(detail::cat("the gradient of parameter '", names_[i],
                            "' became ready twice in one backward; a second backward within one "
                            "step is not supported"));
  }
  ready_[i] = 1;
  if (buckets_.empty()) {
    ready_order_.push_back(i);  // iteration 1: record the order
    return;
  }
  const size_t b = bucket_of_[i];
  if (b == kNotBucketed)
    return;
  Bucket& bucket = buckets_[b];
  // The gradient must live in the bucket's gradient block; an optimizer's or module's
  // zero_grad(set_to_none) makes autograd allocate a fresh one: move it in.
  if (options_.param_as_bucket_view) {
    const size_t k =
        static_cast<size_t>(std::find(bucket.spec.params.begin(), bucket.spec.params.end(), i) -
                            bucket.spec.params.begin());
    const at::Tensor& view = bucket.storage.grad_views[k];
    at::Tensor p = params_[i];
    if (!p.grad().is_same(view)) {
      if (p.grad().defined())
        view.copy_(p.grad());
      p.mutable_grad() = view;
    }
  }
  if (--pending_[b] == 0) {
    while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
      process_bucket(next_bucket_++);
    }
  }
  if (mode_ == ExchangeMode::kAllReduce) {
    step_reduced_buckets(/*block=*/false);
  }
}

void DataParallelCore::end_of_backward() {
  callback_queued_ = false;
  armed_ = false;
  backward_done_ = true;
  if (buckets_.empty()) {
    build_buckets();
  }
  // Buckets whose gradients did not all arrive (spec §7): the missing ones count as zero;
  // every bucket takes its update and exchange so no group member waits forever.
  while (next_bucket_ < buckets_.size()) {
    process_bucket(next_bucket_++);
  }
  if (mode_ == ExchangeMode::kAllReduce) {
    step_reduced_buckets(/*block=*/true);
  }
  ++updates_;
  reset_counting();
}

void DataParallelCore::reset_counting() {
  std::fill(ready_.begin(), ready_.end(), 0);
  pending_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = buckets_[b].spec.params.size();
  }
  next_bucket_ = 0;
}

void DataParallelCore::build_buckets() {
  // Every rank must have recorded the same order and sizes (a full comparison).
  const auto counts = allgather_scalar(*comm_, static_cast<int64_t>(ready_order_.size()));
  for (int r = 0; r < comm_->size(); ++r) {
    if (counts[r] != counts[0]) {
      throw Error(
          detail::cat("ranks disagree on the parameters that received gradients in the "
                      "first iteration: rank 0 saw ",
                      counts[0], ", rank ", r, " saw ", counts[r],
                      "; the first iteration must use every parameter the same way on "
                      "every rank"));
    }
  }
  std::vector<int64_t> order;
  for (size_t i : ready_order_) {
    order.push_back(static_cast<int64_t>(i));
    order.push_back(params_[i].numel());
  }
  const auto rows = allgather_vector(*comm_, order);
  for (int r = 1; r < comm_->size(); ++r) {
    for (size_t k = 0; k < order.size(); ++k) {
      if (rows[r][k] != rows[0][k]) {
        const size_t pos = k / 2;
        throw Error(detail::cat("gradients became ready in a different order on rank ", r,
                                " than on rank 0: position ", pos, " is parameter #",
                                rows[r][2 * pos], " on rank ", r, " and #", rows[0][2 * pos], " ('",
                                names_[rows[0][2 * pos]], "') on rank 0"));
      }
    }
  }
  // Parameters that never received a gradient are left out, with one warning each.
  std::vector<char> seen(params_.size(), 0);
  for (size_t i : ready_order_)
    seen[i] = 1;
  for (size_t i : hooked_) {
    if (!seen[i]) {
      unused_.push_back(names_[i]);
      if (comm_->rank() == 0) {
        DECENT_DP_LOG_WARN(detail::cat(
            "parameter '", names_[i],
            "' received no gradient in the first iteration; it is excluded from the buckets "
            "and keeps its initial value"));
      }
    }
  }
  std::vector<BucketEntry> entries;
  for (size_t i : ready_order_) {
    entries.push_back({i, params_[i].numel(), params_[i].scalar_type(), params_[i].device()});
  }
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * (1 << 20));
  const auto specs = plan_buckets(entries, std::max<int64_t>(cap, 1));
  torch::NoGradGuard no_grad;
  buckets_.resize(specs.size());
  for (size_t b = 0; b < specs.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.spec = specs[b];
    for (size_t i : bucket.spec.params) {
      bucket.params.push_back(params_[i]);
      bucket_of_[i] = b;
    }
    bucket.storage = make_bucket_storage(
        bucket.spec, bucket.params, options_.param_as_bucket_view, /*bind_grads=*/true,
        [this](int64_t numel, const at::TensorOptions& o) { return comm_->allocate(numel, o); });
    NamedParams named;
    if (options_.param_as_bucket_view) {
      bucket.optimizer_params = bucket.params;
    } else {
      // The optimizer steps leaf aliases of the block; the model's tensors are copied in
      // before each update and out after it.
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        at::Tensor shadow = bucket.storage.param_views[k].detach();
        shadow.requires_grad_(true);
        shadow.mutable_grad() = bucket.storage.grad_views[k];
        bucket.optimizer_params.push_back(shadow);
        const at::Tensor& g = bucket.params[k].grad();
        if (g.defined())
          bucket.storage.grad_views[k].copy_(g);
      }
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      named.emplace_back(names_[bucket.spec.params[k]], bucket.optimizer_params[k]);
    }
    bucket.optimizer = optim_fn_(named);
    DECENT_DP_CHECK_ARG(bucket.optimizer != nullptr,
                        "the optimizer factory returned null for bucket ", b);
    // The optimizer must step exactly this bucket's tensors.
    size_t covered = 0;
    for (const auto& group : bucket.optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        const bool ours =
            std::any_of(bucket.optimizer_params.begin(), bucket.optimizer_params.end(),
                        [&](const at::Tensor& q) { return q.is_same(p); });
        DECENT_DP_CHECK_ARG(ours,
                            "the optimizer factory returned an optimizer over tensors "
                            "that are not the parameters it was given (bucket ",
                            b, ")");
        ++covered;
      }
    }
    DECENT_DP_CHECK_ARG(covered == bucket.optimizer_params.size(),
                        "the optimizer factory returned an optimizer over ", covered,
                        " tensors for bucket ", b, ", expected its ",
                        bucket.optimizer_params.size(), " parameters");
    if (scheduler_fn_) {
      bucket.scheduler = scheduler_fn_(*bucket.optimizer);
      DECENT_DP_CHECK_ARG(bucket.scheduler != nullptr,
                          "the scheduler factory returned null for bucket ", b);
    }
    if (comm_->rank() == 0) {
      DECENT_DP_LOG_DEBUG(describe_bucket(b, bucket.spec, names_));
    }
  }
  if (comm_->rank() == 0) {
    DECENT_DP_LOG_INFO(detail::cat(buckets_.size(), " bucket(s) over ", ready_order_.size(),
                                   " parameters, ", unused_.size(), " excluded"));
  }
  reset_counting();
}

void DataParallelCore::step_bucket(Bucket& bucket) {
  if (options_.grad_clip_norm > 0) {
    const double norm = bucket.storage.grads.norm().item<double>();
    const double coef = options_.grad_clip_norm / (norm + 1e-6);
    if (coef < 1.0)
      bucket.storage.grads.mul_(coef);
  }
  bucket.optimizer->step();
  if (options_.param_as_bucket_view) {
    // Note [releasing gradients]: the gradients are dropped (set to none) instead of zeroed.
    // The next backward's AccumulateGrad then takes over the gradient it computed instead of
    // adding it into a zeroed view, and on_grad_ready copies it into the view: one pass over
    // the block instead of three (zero, read-add-write), no allocation either way.
    for (auto& p : bucket.params)
      p.mutable_grad() = at::Tensor();
  } else {
    bucket.storage.grads.zero_();
  }
  if (bucket.scheduler)
    bucket.scheduler->step();
  if (!options_.param_as_bucket_view) {
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.params[k].detach().copy_(bucket.storage.param_views[k]);
      if (bucket.params[k].grad().defined())
        bucket.params[k].mutable_grad().zero_();
    }
  }
}

void DataParallelCore::process_bucket(size_t b) {
  torch::NoGradGuard no_grad;
  Bucket& bucket = buckets_[b];
  if (!options_.param_as_bucket_view) {
    // Copy in: parameters and their gradients.
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket.storage.param_views[k].copy_(bucket.params[k].detach());
      const at::Tensor& g = bucket.params[k].grad();
      if (g.defined())
        bucket.storage.grad_views[k].copy_(g);
    }
  } else {
    // A gradient that did not arrive in this backward counts as zero (spec §7).
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      at::Tensor& p = bucket.params[k];
      const at::Tensor& view = bucket.storage.grad_views[k];
      if (!p.grad().is_same(view)) {
        if (p.grad().defined())
          view.copy_(p.grad());  // accumulated without this backward (no_sync)
        else
          view.zero_();
        p.mutable_grad() = view;
      }
    }
  }
  if (mode_ == ExchangeMode::kAllReduce) {
    bucket.work = comm_->allreduce(bucket.storage.grads, all_ranks_, ReduceOp::kAvg);
    awaiting_step_.push_back(b);
    return;
  }
  // Gossip (spec §2, §3): apply the exchange launched after the previous update.
  if (bucket.work) {
    wait_for_exchange(*bucket.work);
    const topology::Group& g = *bucket.group;
    if (auto* hook = dynamic_cast<PreMixingHook*>(bucket.optimizer.get())) {
      hook->pre_mix(g, g.self_weight, bucket.storage.comm);
    }
    mix_group_mean(bucket.storage, bucket.optimizer_params, g, adaptive_factor_);
    bucket.work.reset();
  }
  step_bucket(bucket);
  if (comm_->size() > 1) {
    const int64_t u = updates_ + 1;  // this update's number
    bucket.group = &topology_->group_of(comm_->rank(), u);
    // Out of place: the parameter block is the input (it does not change until this bucket's
    // next update, which first waits for the exchange), the communication block the output.
    bucket.work = comm_->allreduce(bucket.storage.params, bucket.storage.comm, bucket.group->ranks,
                                   ReduceOp::kAvg);
  }
}

void DataParallelCore::step_reduced_buckets(bool block) {
  torch::NoGradGuard no_grad;
  size_t done = 0;
  for (; done < awaiting_step_.size(); ++done) {
    Bucket& bucket = buckets_[awaiting_step_[done]];
    if (!block && !bucket.work->is_completed())
      break;
    wait_for_exchange(*bucket.work);
    bucket.work.reset();
    step_bucket(bucket);
  }
  awaiting_step_.erase(awaiting_step_.begin(), awaiting_step_.begin() + done);
}

void DataParallelCore::wait_for_exchange(Work& work) {
  if (work.is_completed()) {
    work.wait();  // rethrows a stored error
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  work.wait();
  exchange_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void DataParallelCore::synchronize() {
  for (auto& b : buckets_) {
    if (b.work)
      wait_for_exchange(*b.work);
  }
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
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return buckets_[b].spec;
}

const BucketStorage& DataParallelCore::bucket_storage(size_t b) const {
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return buckets_[b].storage;
}

torch::optim::Optimizer& DataParallelCore::optimizer(size_t b) {
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return *buckets_[b].optimizer;
}

torch::optim::LRScheduler* DataParallelCore::scheduler(size_t b) {
  DECENT_DP_CHECK_ARG(b < buckets_.size(), "bucket index must be < ", buckets_.size(), ", got ", b);
  return buckets_[b].scheduler.get();
}

void DataParallelCore::set_adaptive_factor_impl(double a) {
  DECENT_DP_CHECK_ARG(a >= 0.0 && a <= 1.0, "set_adaptive_factor: a must be in [0, 1], got ", a);
  adaptive_factor_ = a;
}

double DataParallelCore::global_avg_impl(bool will_revert, bool return_d2c) {
  torch::NoGradGuard no_grad;
  synchronize();  // pending results stay in the communication blocks
  std::vector<at::Tensor> blocks;
  for (auto& b : buckets_) {
    if (!options_.param_as_bucket_view) {
      for (size_t k = 0; k < b.params.size(); ++k)
        b.storage.param_views[k].copy_(b.params[k].detach());
    }
    blocks.push_back(b.storage.params);
  }
  std::vector<at::Tensor> float_buffers;
  if (options_.sync_buffers_in_global_avg) {
    for (const auto& buf : module_->named_buffers()) {
      if (buf.value().is_floating_point())
        float_buffers.push_back(buf.value());
    }
  }
  backup_params_.clear();
  backup_buffers_.clear();
  std::vector<at::Tensor> local;
  if (will_revert || return_d2c) {
    for (auto& x : blocks)
      local.push_back(x.clone());
  }
  has_backup_ = will_revert;
  if (will_revert) {
    backup_params_ = local;
    for (auto& buf : float_buffers)
      backup_buffers_.push_back(buf.clone());
  }
  std::vector<std::shared_ptr<Work>> works;
  for (auto& x : blocks)
    works.push_back(comm_->allreduce(x, all_ranks_, ReduceOp::kAvg));
  std::vector<at::Tensor> staged;
  for (auto& buf : float_buffers) {
    staged.push_back(buf.contiguous());
    works.push_back(comm_->allreduce(staged.back(), all_ranks_, ReduceOp::kAvg));
  }
  for (auto& w : works)
    w->wait();
  for (size_t i = 0; i < float_buffers.size(); ++i) {
    if (!staged[i].is_same(float_buffers[i]))
      float_buffers[i].copy_(staged[i]);
  }
  for (auto& b : buckets_) {
    if (!options_.param_as_bucket_view) {
      for (size_t k = 0; k < b.params.size(); ++k)
        b.params[k].detach().copy_(b.storage.param_views[k]);
    }
    if (!will_revert) {
      b.work.reset();  // training continues from the mean: pending exchanges are dropped
    }
  }
  double d2 = 0.0;
  if (return_d2c) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      d2 += local[i].sub(blocks[i]).pow(2).sum().item<double>();
    }
  }
  return std::sqrt(d2);
}

void DataParallelCore::revert_global_avg_impl() {
  DECENT_DP_CHECK_ARG(has_backup_,
                      "revert_global_avg: there is no backup to restore; call "
                      "global_avg(will_revert = true) first");
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].storage.params.copy_(backup_params_[b]);
    if (!options_.param_as_bucket_view) {
      for (size_t k = 0; k < buckets_[b].params.size(); ++k) {
        buckets_[b].params[k].detach().copy_(buckets_[b].storage.param_views[k]);
      }
    }
  }
  if (options_.sync_buffers_in_global_avg) {
    size_t i = 0;
    for (const auto& buf : module_->named_buffers()) {
      if (buf.value().is_floating_point())
        buf.value().copy_(backup_buffers_[i++]);
    }
  }
  backup_params_.clear();
  backup_buffers_.clear();
  has_backup_ = false;
}

double DataParallelCore::consensus_distance_impl() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> locals, means;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& b : buckets_) {
    at::Tensor x = b.storage.params;
    if (!options_.param_as_bucket_view) {
      for (size_t k = 0; k < b.params.size(); ++k)
        b.storage.param_views[k].copy_(b.params[k].detach());
    }
    locals.push_back(x);
    means.push_back(x.clone());
    works.push_back(comm_->allreduce(means.back(), all_ranks_, ReduceOp::kAvg));
  }
  for (auto& w : works)
    w->wait();
  double d2 = 0.0;
  for (size_t i = 0; i < locals.size(); ++i) {
    d2 += locals[i].to(at::kDouble).sub(means[i].to(at::kDouble)).pow(2).sum().item<double>();
  }
  auto total = at::full({1}, d2, at::kDouble);
  comm_->allreduce(total, all_ranks_, ReduceOp::kAvg)->wait();
  return total.data_ptr<double>()[0];
}

}  // namespace decent_dp
