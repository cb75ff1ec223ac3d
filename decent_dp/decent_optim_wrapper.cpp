#include "decent_dp/decent_optim_wrapper.h"

#include <torch/csrc/autograd/grad_mode.h>

#include "decent_dp/data_parallel.h"
#include "decent_dp/logging.h"
#include "topology/errors.h"

namespace decent_dp {
namespace {

// The wrapper's own parameter groups mirror the inner optimizer's (same tensors); their
// options are clones, kept in step by sync_learning_rates().
std::vector<torch::optim::OptimizerParamGroup> mirror_groups(torch::optim::Optimizer& inner) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& g : inner.param_groups()) {
    groups.emplace_back(g.params(), g.options().clone());
  }
  return groups;
}

}  // namespace

DecentOptimWrapper::DecentOptimWrapper(std::shared_ptr<torch::optim::Optimizer> optimizer, int rank,
                                       int world_size, int local_world_size,
                                       const std::string& topology, double bucket_cap_mb,
                                       std::shared_ptr<Communicator> comm)
    : Optimizer(mirror_groups(*optimizer), optimizer->param_groups().empty()
                                               ? nullptr
                                               : optimizer->param_groups()[0].options().clone()),
      inner_(std::move(optimizer)),
      comm_(comm ? std::move(comm) : default_communicator()) {
  DECENT_DP_CHECK_ARG(inner_ != nullptr, "DecentOptimWrapper: optimizer must not be null");
  size_t count = 0;
  for (const auto& g : inner_->param_groups())
    count += g.params().size();
  DECENT_DP_CHECK_ARG(count > 0,
                      "DecentOptimWrapper: the optimizer has no parameters; expected at least "
                      "one parameter group with parameters");
  DECENT_DP_CHECK_ARG(rank == comm_->rank() && world_size == comm_->size(),
                      "DecentOptimWrapper: rank ", rank, " / world_size ", world_size,
                      " do not match the communicator's ", comm_->rank(), " / ", comm_->size());
  DECENT_DP_CHECK_ARG(local_world_size >= 1 && local_world_size <= world_size,
                      "DecentOptimWrapper: local_world_size must be in [1, ", world_size, "], got ",
                      local_world_size);
  DECENT_DP_CHECK_ARG(bucket_cap_mb > 0, "DecentOptimWrapper: bucket_cap_mb must be > 0, got ",
                      bucket_cap_mb);
  topology_ = topology::make_topology(topology, world_size, local_world_size);
  for (int r = 0; r < world_size; ++r)
    all_ranks_.push_back(r);

  // Buckets in parameter-group order.
  std::vector<at::Tensor> params;
  std::vector<BucketEntry> entries;
  for (const auto& g : inner_->param_groups()) {
    for (const auto& p : g.params()) {
      DECENT_DP_CHECK_ARG(p.device().is_cpu(), "DecentOptimWrapper: parameter ", params.size(),
                          " is on ", p.device().str(),
                          "; this build communicates CPU tensors over MPI");
      entries.push_back({params.size(), p.numel(), p.scalar_type(), p.device()});
      params.push_back(p);
    }
  }
  torch::NoGradGuard no_grad;
  const auto specs =
      plan_buckets(entries, std::max<int64_t>(1, static_cast<int64_t>(bucket_cap_mb * (1 << 20))));
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& spec : specs) {
    std::vector<at::Tensor> members;
    for (size_t i : spec.params)
      members.push_back(params[i]);
    Bucket b;
    b.spec = spec;
    b.storage = make_bucket_storage(
        spec, members, /*as_view=*/true, /*bind_grads=*/false,
        [this](int64_t numel, const at::TensorOptions& o) { return comm_->allocate(numel, o); });
    b.params = std::move(members);
    buckets_.push_back(std::move(b));
  }
  for (auto& b : buckets_)
    works.push_back(comm_->broadcast(b.storage.params, 0));
  for (auto& w : works)
    w->wait();
  comm_->make_groups(topology_->distinct_groups());
  for (auto& g : param_groups_)
    last_lrs_.push_back(g.options().get_lr());
}

DecentOptimWrapper::~DecentOptimWrapper() {
  for (auto& b : buckets_) {
    wait_in_destructor(b.work);
  }
}

void DecentOptimWrapper::sync_learning_rates() {
  auto& inner_groups = inner_->param_groups();
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    const double mine = param_groups_[i].options().get_lr();
    const double theirs = inner_groups[i].options().get_lr();
    if (mine != last_lrs_[i]) {
      inner_groups[i].options().set_lr(mine);  // a scheduler on the wrapper
    } else if (theirs != last_lrs_[i]) {
      param_groups_[i].options().set_lr(theirs);  // a scheduler on the inner optimizer
    }
    last_lrs_[i] = inner_groups[i].options().get_lr();
  }
}

at::Tensor DecentOptimWrapper::step(LossClosure closure) {
  DECENT_DP_CHECK_ARG(!closure,
                      "DecentOptimWrapper::step: closures are not supported (the exchange must "
                      "run exactly once per step); call backward() yourself, then step()");
  torch::NoGradGuard no_grad;
  sync_learning_rates();
  // Exchanges in flight were launched after update steps_, on that update's slot.
  const auto& previous = topology_->group_of(comm_->rank(), steps_);
  for (auto& b : buckets_) {
    if (b.work) {
      b.work->wait();
      mix_group_mean(b.storage, b.params, previous, /*adaptive_factor=*/1.0);
      b.work.reset();
    }
  }
  inner_->step();
  if (comm_->size() > 1) {
    // Exchange u after update u, on slot u mod P (spec §2, §10).
    const auto& group = topology_->group_of(comm_->rank(), steps_ + 1);
    for (auto& b : buckets_) {
      b.work = comm_->allreduce(b.storage.params, b.storage.comm, group.ranks, ReduceOp::kAvg);
    }
  }
  ++steps_;
  return {};
}

void DecentOptimWrapper::zero_grad(bool set_to_none) {
  inner_->zero_grad(set_to_none);
}

void DecentOptimWrapper::global_avg(bool may_revert) {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    if (b.work)
      b.work->wait();
  }
  backup_.clear();
  has_backup_ = may_revert;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& b : buckets_) {
    if (may_revert)
      backup_.push_back(b.storage.params.clone());
    works.push_back(comm_->allreduce(b.storage.params, all_ranks_, ReduceOp::kAvg));
  }
  for (auto& w : works)
    w->wait();
  if (!may_revert) {
    for (auto& b : buckets_)
      b.work.reset();  // continue from the mean
  }
}

void DecentOptimWrapper::revert_global_avg() {
  DECENT_DP_CHECK_ARG(has_backup_,
                      "revert_global_avg: there is no backup to restore; call "
                      "global_avg(may_revert = true) first");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < buckets_.size(); ++i)
    buckets_[i].storage.params.copy_(backup_[i]);
  backup_.clear();
  has_backup_ = false;
}

}  // namespace decent_dp
