// Note [pre-mixing hook]
// An optimizer that needs its neighbours' values (spec §6) opts in by also deriving from
// PreMixingHook:
//
//   class MyOptimizer : public torch::optim::Optimizer, public decent_dp::PreMixingHook {
//     void pre_mixing(const decent_dp::MixingContext& context) override { ... }
//   };
//
// DecentralizedDataParallel (a bucket's optimizer from the factory) and DecentOptimWrapper
// (the wrapped optimizer, once per bucket) then call pre_mixing() in every bucket just before
// the result of the bucket's exchange is mixed into its parameters: before updates 2, 3, ...,
// when the world has more than one rank (update 1 mixes nothing, and neither does training
// alone). The context describes that exchange (the one launched after update
// `context.update - 1`) and gives read access to its result. Mixing then sets
//
//   x <- x + coefficient * (received - x)
//
// where x is this rank's parameter block. mixed() computes that value exactly as the wrapper
// will (bit for bit). Everything in the context is read-only: writing to its tensors changes
// what the wrapper mixes and trains. The tensors stay valid only during the call; clone what
// must outlive it. DistributedDataParallel never calls the hook (it mixes nothing).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {

struct MixingContext {
  size_t bucket = 0;
  // The update about to be taken (>= 2); the exchange was launched after update - 1.
  int64_t update = 0;
  int rank = 0;  // this rank
  // The exchange's group: the members' ranks (this one included) and this rank's self
  // weight w; every other member weighs (1 - w) / (k - 1).
  const topology::Group* group = nullptr;
  double adaptive_factor = 1.0;
  // Mixing sets x <- x + coefficient * (received - x). With the default exchange (the group
  // all-reduce) `received` is the plain mean of the k members' blocks and coefficient is
  // a (1 - w) k / (k - 1); with a codec or an aggregator it is the aggregate (the weighted
  // mean, the median, ...) and coefficient is a.
  double coefficient = 1.0;
  // This rank's flat parameter block before mixing, padding included (zero).
  at::Tensor params;
  // The exchange's result, flat and laid out like `params`.
  at::Tensor received;
  // With a codec or an aggregator: every member's block as received (decoded), row m from
  // group->ranks[m], this rank's own row its exact block; undefined otherwise.
  at::Tensor rows;
  // The tensors the bucket's optimizer steps (the model's parameters, or the wrapped
  // optimizer's), in bucket order, and `received` viewed like each of them.
  const std::vector<at::Tensor>* tensors = nullptr;
  std::vector<at::Tensor> received_views;

  // The parameter block after mixing, as a new tensor.
  at::Tensor mixed() const;
  // `flat` (laid out like `params`, e.g. mixed()) viewed like each of `tensors`.
  std::vector<at::Tensor> views(const at::Tensor& flat) const;
};

class PreMixingHook {
 public:
  virtual ~PreMixingHook() = default;
  // Called in every bucket just before mixing (Note [pre-mixing hook]), on the thread that
  // runs backward (DecentralizedDataParallel) or step() (DecentOptimWrapper). An exception
  // propagates as one from the optimizer's step would.
  virtual void pre_mixing(const MixingContext& context) = 0;
};

}  // namespace decent_dp
