#include "decent_dp/decent_optim_wrapper.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <unordered_map>

#include "decent_dp/backend.h"
#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/exchange.h"
#include "decent_dp/model_sync.h"
#include "decent_dp/state_archive.h"

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

torch::optim::Optimizer& checked(const std::shared_ptr<torch::optim::Optimizer>& optimizer) {
  DECENT_DP_CHECK_ARG(optimizer != nullptr,
                      "DecentOptimWrapper: optimizer must not be null; pass the "
                      "torch::optim::Optimizer to wrap");
  return *optimizer;
}

std::unique_ptr<torch::optim::OptimizerOptions> default_options(
    const std::shared_ptr<torch::optim::Optimizer>& optimizer) {
  torch::optim::Optimizer& inner = checked(optimizer);
  return inner.param_groups().empty() ? nullptr : inner.param_groups()[0].options().clone();
}

}  // namespace

DecentOptimWrapper::DecentOptimWrapper(std::shared_ptr<torch::optim::Optimizer> optimizer, int rank,
                                       int world_size, int local_world_size,
                                       const std::string& topology, double bucket_cap_mb,
                                       std::shared_ptr<Communicator> comm)
    : Optimizer(mirror_groups(checked(optimizer)), default_options(optimizer)),
      inner_(std::move(optimizer)),
      control_(comm ? std::move(comm) : default_communicator()) {
  size_t count = 0;
  for (const auto& g : inner_->param_groups()) {
    count += g.params().size();
  }
  DECENT_DP_CHECK_ARG(count > 0,
                      "DecentOptimWrapper: the optimizer has no parameters; expected at least "
                      "one parameter group with parameters");
  DECENT_DP_CHECK_ARG(rank == control_->rank() && world_size == control_->size(),
                      "DecentOptimWrapper: rank ", rank, " / world_size ", world_size,
                      " do not match the communicator's ", control_->rank(), " / ",
                      control_->size());
  DECENT_DP_CHECK_ARG(local_world_size >= 1 && local_world_size <= world_size,
                      "DecentOptimWrapper: local_world_size must be in [1, ", world_size, "], got ",
                      local_world_size);
  DECENT_DP_CHECK_ARG(bucket_cap_mb > 0, "DecentOptimWrapper: bucket_cap_mb must be > 0, got ",
                      bucket_cap_mb);
  topology_ = topology::make_topology(topology, world_size, local_world_size);

  // Buckets in parameter-group order.
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<size_t> order;
  NamedTensors items;
  std::unordered_map<const c10::TensorImpl*, size_t> first_listed;
  for (size_t g = 0; g < inner_->param_groups().size(); ++g) {
    const auto& group = inner_->param_groups()[g];
    for (size_t j = 0; j < group.params().size(); ++j) {
      const std::string name = detail::cat("group ", g, " parameter ", j);
      // torch::optim does not notice a tensor listed twice (tied weights passed as
      // module->parameters(), which lists them under each name) and steps it twice.
      const auto [it, fresh] =
          first_listed.emplace(group.params()[j].unsafeGetTensorImpl(), params.size());
      DECENT_DP_CHECK_ARG(fresh, "DecentOptimWrapper: the optimizer lists one tensor twice (",
                          names[it->second], " and ", name,
                          "), so its step would update it twice; expected each tensor once "
                          "(with tied weights, pass each shared tensor once)");
      order.push_back(params.size());
      params.push_back(group.params()[j]);
      names.push_back(name);
      items.emplace_back(names.back(), params.back());
    }
  }
  // Buckets group by (dtype, device); parameters on several devices exchange each bucket on
  // its device's communicator (Note [routed communicator]).
  check_same_model(*control_, items);
  data_ = communicator_for_devices(detail::distinct_devices(params), control_);
  at::NoGradGuard no_grad;
  // The inner optimizer steps the gradients where they are (Note [gradients in place]).
  binding_ = make_param_binding(/*as_view=*/true, /*grads_in_block=*/false);
  BucketSetOptions o;
  o.bucket_cap_mb = bucket_cap_mb;
  o.bind_grads = binding_->grads_in_block();
  Communicator* data = data_.get();
  o.allocate = [data](int64_t numel, const at::TensorOptions& t) {
    return data->allocate(numel, t);
  };
  buckets_.build(order, params, names, *binding_, o);
  std::vector<at::Tensor> blocks;
  for (Bucket& b : buckets_) {
    b.pre_mixing = dynamic_cast<PreMixingHook*>(inner_.get());  // Note [pre-mixing hook]
    blocks.push_back(b.storage.params);
  }
  broadcast_from_rank0(*data_, blocks);
  data_->make_groups(topology_->distinct_groups());
  gossip_ = std::make_unique<GossipExchange>(data_, *topology_);
  for (auto& g : param_groups_) {
    last_lrs_.push_back(g.options().get_lr());
  }
}

DecentOptimWrapper::~DecentOptimWrapper() {
  Exchange::drain(buckets_, std::chrono::milliseconds(env::shutdown_timeout_ms()));
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
  at::NoGradGuard no_grad;
  for (const Bucket& b : buckets_) {
    check_untouched(b, *binding_, "DecentOptimWrapper");  // Note [writes between steps]
  }
  sync_learning_rates();
  const int64_t u = steps_ + 1;  // this update's number
  for (Bucket& b : buckets_) {
    gossip_->apply(b, u);  // exchange u - 1, on slot (u - 1) mod P
  }
  {
    Metrics::Scope timed(&gossip_->metrics(), "optimizer");
    inner_->step();
  }
  gossip_->metrics().count("steps");
  gossip_->metrics().count("updates", buckets_.size());
  for (Bucket& b : buckets_) {
    record_versions(b);
    gossip_->launch(b, u);  // exchange u after update u, on slot u mod P (spec §2, §10)
  }
  ++steps_;
  return {};
}

Metrics& DecentOptimWrapper::metrics() {
  return gossip_->metrics();
}

const Metrics& DecentOptimWrapper::metrics() const {
  return gossip_->metrics();
}

double DecentOptimWrapper::exchange_wait_seconds() const {
  return gossip_->wait_seconds();
}

void DecentOptimWrapper::zero_grad(bool set_to_none) {
  inner_->zero_grad(set_to_none);
}

void DecentOptimWrapper::global_avg(bool may_revert) {
  for (Bucket& b : buckets_) {
    gossip_->wait(b);
  }
  averager_.global_avg(buckets_, *binding_, *data_, {}, may_revert, /*return_d2c=*/false);
  for (Bucket& b : buckets_) {
    record_versions(b);
  }
}

void DecentOptimWrapper::revert_global_avg() {
  averager_.revert(buckets_, *binding_, {});
  for (Bucket& b : buckets_) {
    record_versions(b);
  }
}

CheckpointManifest DecentOptimWrapper::manifest() const {
  CheckpointManifest m;
  m.wrapper = "DecentOptimWrapper";
  m.world_size = control_->size();
  m.local_world_size = topology_->local_world_size();
  m.topology = topology_->name();
  m.period = topology_->period();
  m.steps = steps_;
  m.updates = steps_;
  m.buckets = state_archive::describe(buckets_);
  return m;
}

std::vector<at::Tensor> DecentOptimWrapper::all_params() const {
  std::vector<at::Tensor> out;
  for (const auto& g : inner_->param_groups()) {
    for (const auto& p : g.params()) {
      out.push_back(p);
    }
  }
  return out;
}

void DecentOptimWrapper::save(const std::string& dir, const NamedTensors& user_state) {
  DECENT_DP_CHECK_ARG(!averager_.has_backup(),
                      "DecentOptimWrapper::save: called between global_avg(may_revert = true) "
                      "and revert_global_avg(); call it before global_avg or after the revert");
  torch::serialize::OutputArchive ar;
  {
    at::NoGradGuard no_grad;
    state_archive::write_int(ar, "steps", steps_);
    state_archive::write_tensors(ar, "param_", all_params());
    torch::serialize::OutputArchive inner;
    inner_->save(inner);
    ar.write("inner", inner);
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      state_archive::write_double(ar, detail::cat("lr_", g), param_groups_[g].options().get_lr());
      state_archive::write_double(ar, detail::cat("last_lr_", g), last_lrs_[g]);
    }
    state_archive::write_buckets(ar, buckets_, *gossip_, steps_);
    state_archive::write_user_state(ar, user_state);
  }
  checkpoint::save(*control_, dir, manifest(), ar);
}

NamedTensors DecentOptimWrapper::load(const std::string& dir) {
  DECENT_DP_CHECK_ARG(!averager_.has_backup(),
                      "DecentOptimWrapper::load: called between global_avg(may_revert = true) "
                      "and revert_global_avg(); call it before global_avg or after the revert");
  for (Bucket& b : buckets_) {
    gossip_->wait(b);
  }
  torch::serialize::InputArchive ar;
  const CheckpointManifest saved = checkpoint::load(*control_, dir, manifest(), ar);
  NamedTensors user;
  std::string error;
  try {
    state_archive::check_plan(saved.buckets, state_archive::describe(buckets_),
                              checkpoint::manifest_file(dir));
    const std::vector<at::Tensor> params = all_params();
    std::vector<std::string> names;
    for (size_t g = 0; g < inner_->param_groups().size(); ++g) {
      for (size_t j = 0; j < inner_->param_groups()[g].params().size(); ++j) {
        names.push_back(detail::cat("group ", g, " parameter ", j));
      }
    }
    state_archive::read_tensors_into(ar, "param_", params, names);
    torch::serialize::InputArchive inner;
    if (!ar.try_read("inner", inner)) {
      throw CheckpointError("checkpoint payload: field 'inner' is missing");
    }
    inner_->load(inner);
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      param_groups_[g].options().set_lr(state_archive::read_double(ar, detail::cat("lr_", g)));
      last_lrs_[g] = state_archive::read_double(ar, detail::cat("last_lr_", g));
    }
    state_archive::read_buckets(ar, buckets_, *gossip_);
    steps_ = state_archive::read_int(ar, "steps");
    for (Bucket& b : buckets_) {
      record_versions(b);
    }
    user = state_archive::read_user_state(ar);
  } catch (const std::exception& e) {
    error = e.what();
  }
  checkpoint::agree(*control_, detail::cat("checkpoint load from ", dir), error);
  return user;
}

}  // namespace decent_dp
