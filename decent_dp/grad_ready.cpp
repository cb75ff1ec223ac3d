#include "decent_dp/grad_ready.h"

#include <algorithm>

#include "decent_dp/errors.h"
#include "decent_dp/grad_hooks.h"
#include "decent_dp/logging.h"

namespace decent_dp {

GradReady::GradReady(const std::vector<at::Tensor>& params, const std::vector<size_t>& hooked,
                     std::vector<std::string> names, std::string who, Handlers handlers)
    : names_(std::move(names)), who_(std::move(who)), handlers_(std::move(handlers)) {
  std::vector<at::Tensor> tensors;
  for (size_t i : hooked) {
    tensors.push_back(params[i]);
  }
  ready_.assign(params.size(), 0);
  hooks_ =
      std::make_unique<GradReadyHooks>(tensors, [this, hooked](size_t k) { on_ready(hooked[k]); });
}

GradReady::~GradReady() = default;

void GradReady::check_not_failed() const {
  if (!failure_.empty()) {
    throw Error(detail::cat(who_,
                            ": an earlier backward failed, so this rank's exchanges no "
                            "longer match its peers' and training cannot continue: ",
                            failure_));
  }
}

template <typename F>
void GradReady::guarded(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if (failure_.empty()) {
      failure_ = e.what();
    }
    throw;
  }
}

void GradReady::arm() {
  check_not_failed();
  if (callback_queued_) {
    // The previous backward raised before its end (the engine runs no final callback then).
    if (next_bucket_ > 0) {
      failure_ = detail::cat("the backward of the previous step raised an exception after ",
                             next_bucket_, " of ", sizes_.size(),
                             " buckets had taken their update and started their exchange");
      check_not_failed();
    }
    DECENT_DP_LOG_WARN(detail::cat(who_,
                                   ": the previous backward raised before any bucket was "
                                   "updated; its gradients are discarded"));
    if (!have_buckets_) {
      first_order_.clear();
    }
    handlers_.discard_gradients();
    callback_queued_ = false;
    reset_counting();
  }
  armed_ = true;
  backward_done_ = false;
}

void GradReady::set_buckets(std::vector<size_t> bucket_of, std::vector<size_t> position_of,
                            std::vector<size_t> sizes) {
  bucket_of_ = std::move(bucket_of);
  position_of_ = std::move(position_of);
  sizes_ = std::move(sizes);
  have_buckets_ = true;
  reset_counting();
}

void GradReady::restore_first_order(std::vector<size_t> order) {
  DECENT_DP_CHECK_ARG(!have_buckets_ && !armed_,
                      "restore_first_order: the buckets exist already (after the first backward)");
  for (size_t i : order) {
    DECENT_DP_CHECK_ARG(i < ready_.size(), "restore_first_order: parameter index ", i,
                        " out of range; the module has ", ready_.size(), " parameters");
  }
  first_order_ = std::move(order);
}

void GradReady::reset_counting() {
  std::fill(ready_.begin(), ready_.end(), 0);
  pending_ = sizes_;
  next_bucket_ = 0;
}

void GradReady::on_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) {
    if (handlers_.stray_backward_is_error()) {
      throw Error(
          detail::cat(who_, ": the gradient of '", names_[i],
                      "' arrived with no forward() of the wrapper "
                      "before this backward: ",
                      backward_done_ ? "a second backward within one step, or a backward through "
                                       "the wrapped module's own forward()? "
                                     : "a backward through the wrapped module's own forward()? ",
                      "Call the wrapper's forward() (not the module's) before each backward(); use "
                      "no_sync() / set_accumulate_grad(true) to accumulate gradients over several "
                      "backwards"));
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
  if (!have_buckets_) {
    first_order_.push_back(i);  // iteration 1: record the order
    return;
  }
  const size_t b = bucket_of_[i];
  if (b >= sizes_.size()) {
    return;  // excluded in iteration 1
  }
  guarded([&] {
    handlers_.on_param(b, position_of_[i]);
    if (--pending_[b] == 0) {
      while (next_bucket_ < pending_.size() && pending_[next_bucket_] == 0) {
        handlers_.on_bucket(next_bucket_++);
      }
    }
    handlers_.progress(/*block=*/false);
  });
}

void GradReady::end_of_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  callback_queued_ = false;
  armed_ = false;
  backward_done_ = true;
  guarded([&] {
    // Iteration 1 builds the buckets now, from the gradients that arrived; they all go on
    // below.
    const bool built_now = !have_buckets_;
    if (built_now) {
      handlers_.build();
    }
    // Buckets whose gradients did not all arrive (spec §7): the missing ones count as zero;
    // every bucket takes its update and exchange so no group member waits forever.
    if (handlers_.on_missing && !built_now && next_bucket_ < pending_.size()) {
      for (size_t i = 0; i < ready_.size(); ++i) {
        if (!ready_[i] && bucket_of_[i] < sizes_.size()) {
          handlers_.on_missing(i);
        }
      }
    }
    while (next_bucket_ < pending_.size()) {
      handlers_.on_bucket(next_bucket_++);
    }
    handlers_.progress(/*block=*/true);
  });
  reset_counting();
}

}  // namespace decent_dp
