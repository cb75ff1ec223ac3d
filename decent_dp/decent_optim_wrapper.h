// DecentOptimWrapper: decentralized training behind a wrapped torch::optim::Optimizer, for
// trainers that keep their own `zero_grad(); backward(); step();` loop (spec §10).
//
//   auto inner = std::make_shared<torch::optim::SGD>(net->parameters(),
//   torch::optim::SGDOptions(0.1)); decent_dp::DecentOptimWrapper opt(inner, comm->rank(),
//   comm->size(), comm->local_size(), "ring"); torch::optim::StepLR sched(opt, /*step_size=*/30,
//   0.1);  // or attached to *inner for (...) { opt.zero_grad(); loss(...).backward(); opt.step();
//   }
//
// step(): waits for the exchange launched by the previous step() and mixes it in as
// DecentralizedDataParallel does (spec §2: the slot's self weight honoured; with uniform
// weights the parameters become the group mean); runs the inner optimizer's step; counts
// (this was update u); launches exchange u on the topology's group of slot u mod P.
#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

#include "decent_dp/bucket_set.h"
#include "decent_dp/checkpoint.h"
#include "decent_dp/communicator.h"
#include "decent_dp/global_averager.h"
#include "decent_dp/metrics.h"
#include "decent_dp/model_sync.h"
#include "decent_dp/topology/topology.h"

namespace decent_dp {

class GossipExchange;

class DecentOptimWrapper : public torch::optim::Optimizer {
 public:
  // Collective. `rank`, `world_size` and `local_world_size` must describe this process
  // (checked against the communicator; local_world_size sizes the topology). Parameters are
  // flattened into buckets (param-group order, `bucket_cap_mb` cap) and broadcast from rank 0.
  DecentOptimWrapper(std::shared_ptr<torch::optim::Optimizer> optimizer, int rank, int world_size,
                     int local_world_size, const std::string& topology, double bucket_cap_mb = 25,
                     std::shared_ptr<Communicator> comm = nullptr);
  ~DecentOptimWrapper() override;

  // Closures are rejected: the exchange must happen exactly once per step.
  at::Tensor step(LossClosure closure = nullptr) override;
  void zero_grad(bool set_to_none = true);

  // Averages the parameters over all ranks (waiting for exchanges in flight). With
  // may_revert, revert_global_avg() restores the exact local state; without it, exchanges
  // in flight are dropped and training continues from the mean. Collective.
  void global_avg(bool may_revert = true);
  void revert_global_avg();

  // Checkpoint (Note [checkpoint] in checkpoint.h, docs/checkpoint.md). Collective, between
  // steps, the same folder on every rank. Saves the parameters, the inner optimizer's state,
  // both sides' learning rates, the step count, the exchange in flight (waited for; the next
  // step() applies it) and `user_state`. A torch::optim scheduler keeps its step count to
  // itself: make it again and call its step() step_count() times before load().
  void save(const std::string& dir, const NamedTensors& user_state = {});
  // Collective. Refuses a checkpoint of another wrapper, world size, ranks per node,
  // topology or bucket plan and a missing, torn or truncated file (CheckpointError on every
  // rank); otherwise restores what save() wrote and returns its user_state.
  NamedTensors load(const std::string& dir);
  using torch::optim::Optimizer::load;
  using torch::optim::Optimizer::save;

  int64_t step_count() const { return steps_; }
  torch::optim::Optimizer& inner() { return *inner_; }
  const topology::Topology& topology() const { return *topology_; }
  size_t bucket_count() const { return buckets_.size(); }
  // This rank's counters and timers (Note [metrics] in decent_dp/metrics.h); "optimizer"
  // times the inner optimizer's step, "updates" counts buckets stepped.
  Metrics& metrics();
  const Metrics& metrics() const;
  double exchange_wait_seconds() const;

 private:
  void sync_learning_rates();
  CheckpointManifest manifest() const;
  std::vector<at::Tensor> all_params() const;

  std::shared_ptr<torch::optim::Optimizer> inner_;
  std::shared_ptr<Communicator> control_;
  std::shared_ptr<Communicator> data_;
  std::unique_ptr<topology::Topology> topology_;
  std::unique_ptr<ParamBinding> binding_;
  BucketSet buckets_;
  std::unique_ptr<GossipExchange> gossip_;
  GlobalAverager averager_;
  std::vector<double> last_lrs_;  // per group, to see which side a scheduler changed
  int64_t steps_ = 0;
};

}  // namespace decent_dp
