#include "decent_dp/work.h"

#include <algorithm>

#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {

Work::Work(std::string description, std::vector<at::Tensor> tensors,
           std::chrono::milliseconds timeout)
    : description_(std::move(description)),
      tensors_(std::move(tensors)),
      timeout_(timeout),
      start_(std::chrono::steady_clock::now()) {}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

bool Work::has_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ && error_ != nullptr;
}

void Work::wait() {
  wait(timeout_);
}

void Work::wait(std::chrono::milliseconds timeout) {
  DECENT_DP_CHECK_ARG(timeout.count() > 0, "Work::wait: timeout must be > 0 ms, got ",
                      timeout.count(), " ms");
  const auto deadline = std::chrono::steady_clock::now() +
                        std::min(timeout, std::chrono::milliseconds(env::kMaxTimeoutMs));
  std::unique_lock<std::mutex> lock(mutex_);
  if (done_) {
    if (error_) {
      std::rethrow_exception(error_);
    }
    return;
  }
  lock.unlock();
  on_wait_begin();
  struct EndWait {
    Work* work;
    ~EndWait() { work->on_wait_end(); }
  } end_wait{this};
  // Note [stall watchdog]: a wait that takes much longer than a step says so, naming the
  // operation (its group, bucket and update), long before the hard timeout ends the job.
  const auto warn_every = std::chrono::milliseconds(env::stall_warn_ms());
  auto next_warning = std::chrono::steady_clock::now() + warn_every;
  lock.lock();
  while (!done_) {
    const auto now = std::chrono::steady_clock::now();
    if (warn_every.count() > 0 && now >= next_warning && now < deadline) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start_);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      DECENT_DP_LOG_WARN(detail::cat(
          "still waiting for ", description_, " ", waited.count(),
          " ms after its launch (a member of the group may have stopped, left the training "
          "loop or fallen far behind); it times out in ",
          left.count(), " ms (DECENT_DP_STALL_WARN_MS, DECENT_DP_TIMEOUT_MS)"));
      next_warning = now + warn_every;
    }
    if (now >= deadline) {
      const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(now - start_);
      throw TimeoutError(
          detail::cat(description_, " did not complete within the timeout of ", timeout.count(),
                      " ms (elapsed since launch: ", elapsed.count(),
                      " ms); a member of the group has not joined this collective, or joined a "
                      "different one"));
    }
    lock.unlock();
    const bool progressed = drive_progress();
    lock.lock();
    if (!progressed && !done_) {
      // Someone else advances the operation; finish() wakes us.
      cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(5)));
    }
  }
  if (error_) {
    std::rethrow_exception(error_);
  }
}

void Work::synchronize() {
  wait();
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) {
      return;
    }
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

}  // namespace decent_dp
