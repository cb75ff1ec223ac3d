// The exchange strategies of the wrappers: what happens to a bucket around its update.
//
//   gossip (DecentralizedDataParallel, DecentOptimWrapper; spec §2):
//     apply(bucket, u)   before update u: wait for exchange u - 1 and mix its result in
//     update u           (the bucket's optimizer and scheduler)
//     launch(bucket, u)  after update u: start exchange u on the group of slot u mod P
//   all-reduce (DistributedDataParallel; spec §9):
//     launch(bucket, u)  once the bucket's gradients are complete: start their mean
//     apply(bucket, u)   wait for it; the gradient block holds the mean
//     update u
//
// on_bucket_ready() runs that sequence for a bucket whose gradients are complete; the
// all-reduce exchange takes the update later, from progress(), once the reduction is done.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "decent_dp/bucket_set.h"
#include "decent_dp/communicator.h"
#include "decent_dp/exchange_stage.h"
#include "decent_dp/metrics.h"
#include "decent_dp/topology/topology.h"

namespace decent_dp {

class Exchange {
 public:
  using UpdateFn = std::function<void(Bucket&)>;
  virtual ~Exchange() = default;

  virtual void on_bucket_ready(Bucket& bucket, int64_t update, const UpdateFn& take_update) = 0;
  // Takes the updates that are due; with `block`, waits for all of them.
  virtual void progress(bool /*block*/, const UpdateFn& /*take_update*/) {}
  virtual void apply(Bucket& bucket, int64_t update) = 0;
  virtual void launch(Bucket& bucket, int64_t update) = 0;

  // Waits for the bucket's exchange in flight; its result is applied by the next update.
  virtual void wait(Bucket& bucket);
  // Waits for every bucket's exchange in flight, within one shared deadline of `timeout`;
  // logs instead of throwing (for destructors).
  static void drain(BucketSet& buckets, std::chrono::milliseconds timeout) noexcept;
  // Checkpoint (Note [checkpoint]): waits for the bucket's exchange in flight and returns
  // what its apply() will read (empty: none in flight). The exchange stays pending.
  virtual std::vector<at::Tensor> pending(Bucket& bucket);
  // Makes the exchange that `update` launched pending again, finished, with the tensors
  // pending() returned.
  virtual void restore_pending(Bucket& bucket, int64_t update,
                               const std::vector<at::Tensor>& saved);
  // The gossip exchange's codec (null: none, or not a gossip exchange).
  virtual Codec* codec() const { return nullptr; }
  // Seconds spent blocked in waits on exchanges that had not finished.
  double wait_seconds() const { return metrics_.timer("exchange.wait").seconds; }
  // The wrapper's registry (Note [metrics]); the exchange fills its exchange.* names.
  Metrics& metrics() { return metrics_; }
  const Metrics& metrics() const { return metrics_; }

 protected:
  void timed_wait(Work& work);
  // One collective over `group_size` ranks that sends (and receives) `bytes_each_way`.
  void count_exchange(uint64_t bytes_each_way);
  static uint64_t allreduce_bytes(uint64_t bytes, int64_t group_size) {
    return group_size > 1 ? 2 * static_cast<uint64_t>(group_size - 1) * bytes /
                                static_cast<uint64_t>(group_size)
                          : 0;
  }

 private:
  Metrics metrics_;
};

class AllReduceExchange final : public Exchange {
 public:
  explicit AllReduceExchange(std::shared_ptr<Communicator> comm);
  void on_bucket_ready(Bucket& bucket, int64_t update, const UpdateFn& take_update) override;
  void progress(bool block, const UpdateFn& take_update) override;
  void apply(Bucket& bucket, int64_t update) override;
  void launch(Bucket& bucket, int64_t update) override;

 private:
  std::shared_ptr<Communicator> comm_;
  std::deque<Bucket*> awaiting_;  // reduced (or reducing), not yet stepped
};

class GossipExchange final : public Exchange {
 public:
  GossipExchange(std::shared_ptr<Communicator> comm, const topology::Topology& topology,
                 ExchangeStages stages = {});
  void on_bucket_ready(Bucket& bucket, int64_t update, const UpdateFn& take_update) override;
  void apply(Bucket& bucket, int64_t update) override;
  void launch(Bucket& bucket, int64_t update) override;
  void wait(Bucket& bucket) override;
  std::vector<at::Tensor> pending(Bucket& bucket) override;
  void restore_pending(Bucket& bucket, int64_t update,
                       const std::vector<at::Tensor>& saved) override;

  void set_adaptive_factor(double a);
  double adaptive_factor() const { return adaptive_factor_; }
  const ExchangeStages& stages() const { return stages_; }
  Codec* codec() const override { return stages_.codec.get(); }

 private:
  void launch_gather(Bucket& bucket, const topology::Group& group, int64_t update);
  // Calls the bucket's pre-mixing hook, if any (Note [pre-mixing hook]): mixing will set
  // x <- x + coefficient (received - x); `received_views` may be empty (then made here).
  void call_pre_mixing(Bucket& bucket, int64_t update, const at::Tensor& received,
                       std::vector<at::Tensor> received_views, double coefficient,
                       const at::Tensor& rows);
  void apply_gather(Bucket& bucket, int64_t update);
  // After a varying all-gather completes: counts the bytes the other members sent.
  void count_arrivals(Bucket& bucket);

  std::shared_ptr<Communicator> comm_;
  const topology::Topology& topology_;
  ExchangeStages stages_;
  double adaptive_factor_ = 1.0;
};

}  // namespace decent_dp
