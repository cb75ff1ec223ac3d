#include "decent_dp/exchange.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {
namespace {

// The receive buffers of the gather path, per group size, and what the bucket sent.
struct GatherState final : ExchangeState {
  at::Tensor payload;                      // the encoded block (codec only)
  std::map<int64_t, at::Tensor> received;  // k * payload elements
  std::map<int64_t, at::Tensor> decoded;   // k x n (codec only)
  std::map<int64_t, at::Tensor> lengths;   // k int64: elements each member sent (varying)
  bool count_received = false;             // varying: count what arrived when applied
  at::Tensor mixed;                        // n
  int64_t launched_update = 0;
};

}  // namespace

// ---- Exchange ----

// synchronize(): on CPU a wait; on a CUDA backend the current stream waits for the
// exchange instead of the host.
void Exchange::timed_wait(Work& work) {
  if (work.is_completed()) {
    work.synchronize();  // rethrows a stored error
    return;
  }
  Metrics::Scope timed(&metrics_, "exchange.wait");
  work.synchronize();
}

void Exchange::count_exchange(uint64_t bytes_each_way) {
  metrics_.count("exchanges");
  metrics_.count("exchange.bytes_sent", bytes_each_way);
  metrics_.count("exchange.bytes_received", bytes_each_way);
}

void Exchange::wait(Bucket& bucket) {
  if (bucket.work) {
    timed_wait(*bucket.work);
  }
}

void Exchange::drain(BucketSet& buckets, std::chrono::milliseconds timeout) noexcept {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::min(timeout, std::chrono::milliseconds(env::kMaxTimeoutMs));
  size_t abandoned = 0;
  for (Bucket& b : buckets) {
    if (!b.work || b.work->is_completed()) {
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ++abandoned;
      continue;
    }
    try {
      b.work->wait(left);
    } catch (const std::exception& e) {
      DECENT_DP_LOG_WARN(detail::cat(b.work->description(), " failed during shutdown: ", e.what()));
    }
  }
  if (abandoned > 0) {
    DECENT_DP_LOG_WARN(detail::cat(abandoned,
                                   " more exchange(s) still in flight after the shutdown "
                                   "deadline of ",
                                   timeout.count(), " ms (DECENT_DP_SHUTDOWN_TIMEOUT_MS)"));
  }
}

std::vector<at::Tensor> Exchange::pending(Bucket& bucket) {
  wait(bucket);
  return {};
}

void Exchange::restore_pending(Bucket& /*bucket*/, int64_t update,
                               const std::vector<at::Tensor>& saved) {
  DECENT_DP_CHECK_ARG(saved.empty(),
                      "restore_pending: this exchange keeps nothing between "
                      "steps, got ",
                      saved.size(), " tensor(s) for update ", update);
}

// ---- all-reduce of gradients ----

AllReduceExchange::AllReduceExchange(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}

void AllReduceExchange::on_bucket_ready(Bucket& bucket, int64_t update,
                                        const UpdateFn& /*take_update*/) {
  launch(bucket, update);
}

void AllReduceExchange::launch(Bucket& bucket, int64_t update) {
  bucket.work = comm_->allreduce(
      bucket.storage.grads, bucket.storage.grads,
      AllreduceOptions{ReduceOp::kAvg,
                       {},
                       {},
                       detail::cat("bucket ", bucket.index, ", gradients of update ", update)});
  count_exchange(allreduce_bytes(bucket.storage.grads.nbytes(), comm_->size()));
  awaiting_.push_back(&bucket);
}

void AllReduceExchange::apply(Bucket& bucket, int64_t /*update*/) {
  wait(bucket);
  bucket.work.reset();
}

void AllReduceExchange::progress(bool block, const UpdateFn& take_update) {
  at::NoGradGuard no_grad;
  while (!awaiting_.empty()) {
    Bucket& bucket = *awaiting_.front();
    if (!block && !bucket.work->is_completed()) {
      break;
    }
    apply(bucket, 0);
    awaiting_.pop_front();
    take_update(bucket);
  }
}

// ---- gossip ----

GossipExchange::GossipExchange(std::shared_ptr<Communicator> comm,
                               const topology::Topology& topology, ExchangeStages stages)
    : comm_(std::move(comm)), topology_(topology), stages_(std::move(stages)) {
  if (stages_.codec && !stages_.aggregator) {
    stages_.aggregator = std::make_shared<MeanAggregator>();
  }
  if (stages_.aggregator) {
    stages_.aggregator->check(topology_);
  }
}

void GossipExchange::set_adaptive_factor(double a) {
  DECENT_DP_CHECK_ARG(a >= 0.0 && a <= 1.0, "set_adaptive_factor: a must be in [0, 1], got ", a);
  adaptive_factor_ = a;
}

void GossipExchange::on_bucket_ready(Bucket& bucket, int64_t update, const UpdateFn& take_update) {
  apply(bucket, update);
  take_update(bucket);
  launch(bucket, update);
}

void GossipExchange::apply(Bucket& bucket, int64_t update) {
  if (!bucket.work) {
    return;
  }
  timed_wait(*bucket.work);
  count_arrivals(bucket);
  if (stages_.gathers()) {
    apply_gather(bucket, update);
  } else {
    // The communication block holds the group mean (Note [block swap]).
    if (bucket.pre_mixing) {
      call_pre_mixing(bucket, update, bucket.storage.comm, bucket.storage.comm_views,
                      group_mean_coefficient(*bucket.group, adaptive_factor_), {});
    }
    mix_group_mean(bucket.storage, bucket.optimizer_params, *bucket.group, adaptive_factor_);
  }
  bucket.work.reset();
}

void GossipExchange::call_pre_mixing(Bucket& bucket, int64_t update, const at::Tensor& received,
                                     std::vector<at::Tensor> received_views, double coefficient,
                                     const at::Tensor& rows) {
  MixingContext context;
  context.bucket = bucket.index;
  context.update = update;
  context.rank = comm_->rank();
  context.group = bucket.group;
  context.adaptive_factor = adaptive_factor_;
  context.coefficient = coefficient;
  context.params = bucket.storage.params;
  context.received = received;
  context.rows = rows;
  context.tensors = &bucket.optimizer_params;
  context.received_views =
      received_views.empty() ? context.views(received) : std::move(received_views);
  bucket.pre_mixing->pre_mixing(context);
}

void GossipExchange::wait(Bucket& bucket) {
  Exchange::wait(bucket);
  if (bucket.work) {
    count_arrivals(bucket);
  }
}

void GossipExchange::launch(Bucket& bucket, int64_t update) {
  if (comm_->size() == 1) {
    return;
  }
  const topology::Group& group = topology_.group_of(comm_->rank(), update);
  bucket.group = &group;
  bucket.exchange_update = update;
  if (stages_.gathers()) {
    launch_gather(bucket, group, update);
    return;
  }
  // Out of place: the parameter block is the input (it does not change until this bucket's
  // next update, which first waits for the exchange), the communication block the output.
  bucket.work = comm_->allreduce(
      bucket.storage.params, bucket.storage.comm,
      AllreduceOptions{ReduceOp::kAvg,
                       group.ranks,
                       {},
                       detail::cat("bucket ", bucket.index, ", exchange of update ", update)});
  count_exchange(allreduce_bytes(bucket.storage.params.nbytes(), group.size()));
}

// Between steps the exchange of the last update is the only state in flight: the fast path
// reads the group mean in the communication block, the gather path every member's payload.
std::vector<at::Tensor> GossipExchange::pending(Bucket& bucket) {
  if (!bucket.work) {
    return {};
  }
  timed_wait(*bucket.work);
  count_arrivals(bucket);
  if (stages_.gathers()) {
    auto& state = static_cast<GatherState&>(*bucket.exchange_state);
    return {state.received.at(bucket.group->size())};
  }
  return {bucket.storage.comm};
}

void GossipExchange::restore_pending(Bucket& bucket, int64_t update,
                                     const std::vector<at::Tensor>& saved) {
  DECENT_DP_CHECK_ARG(saved.size() == 1, "restore_pending: expected 1 tensor for bucket ",
                      bucket.index, ", got ", saved.size());
  const topology::Group& group = topology_.group_of(comm_->rank(), update);
  at::Tensor target;
  if (stages_.gathers()) {
    if (!bucket.exchange_state) {
      bucket.exchange_state = std::make_unique<GatherState>();
    }
    auto& state = static_cast<GatherState&>(*bucket.exchange_state);
    at::Tensor& received = state.received[group.size()];
    if (!received.defined()) {
      received = comm_->allocate(saved[0].numel(), saved[0].options().device(bucket.spec.device));
    }
    state.launched_update = update;
    state.count_received = false;  // what arrived was counted by the run that saved it
    target = received;
  } else {
    target = bucket.storage.comm;
  }
  DECENT_DP_CHECK_ARG(
      target.numel() == saved[0].numel() && target.scalar_type() == saved[0].scalar_type(),
      "restore_pending: bucket ", bucket.index, " expects ", target.numel(), " x ",
      target.scalar_type(), ", got ", saved[0].numel(), " x ", saved[0].scalar_type());
  target.copy_(saved[0]);
  bucket.group = &group;
  bucket.exchange_update = update;
  bucket.work = std::make_shared<Work>(
      detail::cat("exchange of bucket ", bucket.index, " restored from a checkpoint"),
      std::vector<at::Tensor>{}, std::chrono::milliseconds(1));
  bucket.work->finish();
}

void GossipExchange::launch_gather(Bucket& bucket, const topology::Group& group, int64_t update) {
  if (!bucket.exchange_state) {
    bucket.exchange_state = std::make_unique<GatherState>();
  }
  auto& state = static_cast<GatherState&>(*bucket.exchange_state);
  const int64_t k = group.size();
  const int64_t n = bucket.spec.numel;
  const auto dtype = bucket.spec.dtype;
  at::Tensor payload = bucket.storage.params;
  int64_t used = 0;
  if (stages_.codec) {
    const int64_t np = stages_.codec->payload_numel(n, dtype);
    const auto pdtype = stages_.codec->payload_dtype(dtype);
    if (!state.payload.defined()) {
      state.payload =
          comm_->allocate(np, at::TensorOptions().dtype(pdtype).device(bucket.spec.device));
    }
    Metrics::Scope timed(&metrics(), "exchange.encode");
    used = stages_.codec->encode_prefix(
        bucket.storage.params, state.payload,
        CodecContext{bucket.index, update, comm_->rank(), topology_.slot_index(update)});
    payload = state.payload;
  }
  at::Tensor& received = state.received[k];
  if (!received.defined()) {
    received = comm_->allocate(
        k * payload.numel(),
        at::TensorOptions().dtype(payload.scalar_type()).device(bucket.spec.device));
  }
  state.launched_update = update;
  AllgatherOptions options{
      group.ranks, {}, detail::cat("bucket ", bucket.index, ", exchange of update ", update)};
  if (stages_.codec && stages_.codec->varying_size()) {
    // Only the prefix the codec used crosses the wire (Note [varying all-gather]).
    at::Tensor& lengths = state.lengths[k];
    if (!lengths.defined()) {
      lengths = at::empty({k}, at::TensorOptions().dtype(at::kLong));
    }
    const at::Tensor sent = payload.narrow(0, 0, used);
    bucket.work = comm_->allgather_varying(received, sent, lengths, options);
    state.count_received = true;
    metrics().count("exchanges");
    metrics().count("exchange.bytes_sent", static_cast<uint64_t>(k - 1) * sent.nbytes());
    return;
  }
  state.count_received = false;
  bucket.work = comm_->allgather(received, payload, options);
  count_exchange(static_cast<uint64_t>(k - 1) * payload.nbytes());
}

void GossipExchange::count_arrivals(Bucket& bucket) {
  if (!bucket.exchange_state) {
    return;
  }
  auto& state = static_cast<GatherState&>(*bucket.exchange_state);
  if (!state.count_received) {
    return;
  }
  state.count_received = false;
  const int64_t k = bucket.group->size();
  const int64_t* len = state.lengths.at(k).data_ptr<int64_t>();
  const int rank = comm_->rank();
  uint64_t got = 0;
  for (int64_t m = 0; m < k; ++m) {
    if (bucket.group->ranks[m] != rank) {
      got += static_cast<uint64_t>(len[m]) * state.received.at(k).element_size();
    }
  }
  metrics().count("exchange.bytes_received", got);
}

void GossipExchange::apply_gather(Bucket& bucket, int64_t update) {
  auto& state = static_cast<GatherState&>(*bucket.exchange_state);
  const topology::Group& group = *bucket.group;
  const int64_t k = group.size();
  const int64_t n = bucket.spec.numel;
  const int rank = comm_->rank();
  int64_t self = 0;
  while (group.ranks[self] != rank) {
    ++self;
  }
  const at::Tensor x = bucket.storage.params;
  at::Tensor received = state.received.at(k);
  at::Tensor rows;
  if (stages_.codec) {
    at::Tensor& decoded = state.decoded[k];
    if (!decoded.defined()) {
      decoded = at::empty({k, n}, x.options());
    }
    const at::Tensor payloads = received.view({k, -1});
    Metrics::Scope timed(&metrics(), "exchange.decode");
    for (int64_t m = 0; m < k; ++m) {
      if (m == self) {
        decoded.select(0, m).copy_(x);  // this rank's own exact block
      } else {
        stages_.codec->decode(payloads.select(0, m), decoded.select(0, m),
                              CodecContext{bucket.index, state.launched_update, group.ranks[m],
                                           topology_.slot_index(state.launched_update)});
      }
    }
    rows = decoded;
  } else {
    rows = received.view({k, n});  // row `self` is x itself (unchanged since the launch)
  }
  if (!state.mixed.defined()) {
    state.mixed = at::empty({n}, x.options());
  }
  {
    Metrics::Scope timed(&metrics(), "exchange.aggregate");
    stages_.aggregator->aggregate(rows, self, group, state.mixed);
  }
  if (bucket.pre_mixing) {
    call_pre_mixing(bucket, update, state.mixed, {}, adaptive_factor_, rows);
  }
  switch (mix_kind(adaptive_factor_)) {
    case MixKind::kTarget:
      x.copy_(state.mixed);
      break;
    case MixKind::kLerp:
      x.lerp_(state.mixed, adaptive_factor_);
      break;
    case MixKind::kKeep:
      break;
  }
  zero_padding(bucket.spec, bucket.storage, x);  // Note [block padding]
}

}  // namespace decent_dp
