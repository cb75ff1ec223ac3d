#include "decent_dp/work.h"

#include <algorithm>

#include "decent_dp/env.h"
#include "decent_dp/errors.h"

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
  lock.lock();
  while (!done_) {
    const auto now = std::chrono::steady_clock::now();
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
