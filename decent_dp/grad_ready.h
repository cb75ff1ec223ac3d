// Note [gradient-ready bookkeeping]
// The per-backward state machine of both wrappers, after torch DDP's Reducer: hooks on the
// gradient accumulators (Note [gradient-ready hooks]) count the arrivals per bucket; a
// bucket whose count reaches zero is handed on, strictly in bucket order; the end of the
// backward (the autograd engine's final callback) hands on the buckets whose gradients did
// not all arrive. In iteration 1 there are no buckets yet: the hooks record the order in
// which gradients became ready, and the end of that backward builds the buckets from it.
//
// Threads: the autograd engine runs CPU nodes on the thread that called backward() and each
// GPU's nodes on a worker of its own, so the hooks of a model on several devices fire from
// several threads at once. One mutex serialises the hooks and the end of backward: buckets
// are still handed on one at a time, strictly in bucket order, whichever thread completes
// them.
//
// Failure: an exception raised while a bucket is handed on (a timed-out exchange, a
// throwing optimizer) propagates out of backward and is remembered: every later arm()
// rethrows it ("an earlier backward failed: <original message>"), since the buckets'
// exchanges no longer agree with the peers'. An exception raised elsewhere in the backward
// before any bucket was handed on leaves nothing inconsistent: the next arm() starts a
// clean count and training continues.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace decent_dp {

class GradReadyHooks;

class GradReady {
 public:
  struct Handlers {
    // Iteration 1's backward ended: build the buckets and call set_buckets().
    std::function<void()> build;
    // A bucketed parameter's gradient arrived (index into the parameter list).
    std::function<void(size_t bucket, size_t position)> on_param;
    // A bucketed parameter's gradient did not arrive by the end of a training backward
    // (index into the parameter list); it counts as zero (spec §7). Optional.
    std::function<void(size_t param)> on_missing;
    // A bucket's gradients are complete (in bucket order).
    std::function<void(size_t bucket)> on_bucket;
    // After every hook, and after the last bucket at the end of backward (block = true).
    std::function<void(bool block)> progress;
    // A backward that raised before any bucket's update is abandoned: drop the gradients
    // it accumulated.
    std::function<void()> discard_gradients;
    // A gradient arrived while not armed: true when that is an error (a second backward
    // in one step) rather than gradient accumulation.
    std::function<bool()> stray_backward_is_error;
  };

  // Hooks `params[i]` for every i in `hooked`; `names` for messages; `who` names the
  // wrapper in them.
  GradReady(const std::vector<at::Tensor>& params, const std::vector<size_t>& hooked,
            std::vector<std::string> names, std::string who, Handlers handlers);
  ~GradReady();

  GradReady(const GradReady&) = delete;
  GradReady& operator=(const GradReady&) = delete;

  // Arms the hooks for the next backward (a training forward). Rethrows an earlier failure.
  void arm();
  bool armed() const { return armed_; }
  // After the build handler: bucket of every parameter (or kNone) and its position there,
  // and the number of parameters per bucket.
  void set_buckets(std::vector<size_t> bucket_of, std::vector<size_t> position_of,
                   std::vector<size_t> sizes);
  // The order of iteration 1 (parameter indices).
  const std::vector<size_t>& first_order() const { return first_order_; }
  // Before the buckets exist: iteration 1's order as agreed across ranks, or as a checkpoint
  // recorded it (the caller builds the buckets from it and calls set_buckets()).
  void restore_first_order(std::vector<size_t> order);
  // Throws the stored failure, if any.
  void check_not_failed() const;

 private:
  void on_ready(size_t i);
  void end_of_backward();
  void reset_counting();
  template <typename F>
  void guarded(F&& f);

  std::vector<std::string> names_;
  std::string who_;
  Handlers handlers_;
  std::unique_ptr<GradReadyHooks> hooks_;

  std::vector<size_t> first_order_;
  std::vector<size_t> bucket_of_;
  std::vector<size_t> position_of_;
  std::vector<size_t> sizes_;
  bool have_buckets_ = false;

  std::mutex mutex_;  // held by on_ready() and end_of_backward()
  std::vector<char> ready_;
  std::vector<size_t> pending_;
  size_t next_bucket_ = 0;
  bool armed_ = false;
  bool callback_queued_ = false;
  bool backward_done_ = false;
  std::string failure_;  // non-empty once a bucket's processing threw
};

}  // namespace decent_dp
