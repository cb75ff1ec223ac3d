#include "decent_dp/detail/watchdog.h"

#include <exception>
#include <utility>
#include <vector>

#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {
namespace detail {

Watchdog::Watchdog(std::string name, Hooks hooks, std::chrono::microseconds interval)
    : name_(std::move(name)), hooks_(std::move(hooks)), interval_(interval) {
  DECENT_DP_CHECK_ARG(interval_.count() > 0, "Watchdog: interval must be > 0 us, got ",
                      interval_.count());
  DECENT_DP_CHECK_ARG(static_cast<bool>(hooks_.async_error) && static_cast<bool>(hooks_.abort),
                      "Watchdog: both hooks (async_error, abort) are required");
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  std::deque<Entry> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    left.swap(pending_);
  }
  for (auto& e : left) {
    e.work->finish(std::make_exception_ptr(CommError(
        cat(e.work->description(), " was still in flight when the ", name_, " was destroyed"))));
  }
}

void Watchdog::track(std::shared_ptr<Work> work, std::function<bool()> done,
                     std::chrono::milliseconds timeout) {
  DECENT_DP_CHECK_ARG(work != nullptr, "Watchdog::track: work must not be null");
  DECENT_DP_CHECK_ARG(timeout.count() > 0, "Watchdog::track: timeout must be > 0 ms, got ",
                      timeout.count());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) {
      pending_.push_back(Entry{std::move(work), std::move(done),
                               std::chrono::steady_clock::now() + timeout, timeout});
    }
  }
  cv_.notify_one();  // the thread polls at the busy pace from now on
  check();
}

void Watchdog::check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_.empty()) {
    throw CommError(cat("the ", name_, " was aborted after an earlier failure (", failure_,
                        "); it takes no new operations"));
  }
}

std::string Watchdog::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

size_t Watchdog::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.size();
}

void Watchdog::fail(const std::string& message, const Entry* timed_out) {
  std::deque<Entry> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) {
      return;
    }
    failure_ = message;
    left.swap(pending_);
  }
  DECENT_DP_LOG_ERROR(cat(name_, ": ", message, "; aborting it and failing ", left.size(),
                          " operation(s) in flight"));
  try {
    hooks_.abort();
  } catch (const std::exception& e) {
    DECENT_DP_LOG_ERROR(cat(name_, ": abort failed: ", e.what()));
  }
  for (auto& e : left) {
    if (timed_out != nullptr && e.work == timed_out->work) {
      e.work->finish(std::make_exception_ptr(TimeoutError(message)));
    } else {
      e.work->finish(std::make_exception_ptr(CommError(
          cat(e.work->description(), " failed: the ", name_, " was aborted because ", message))));
    }
  }
}

void Watchdog::poll() {
  std::lock_guard<std::mutex> poll_lock(poll_mutex_);
  std::string error;
  try {
    error = hooks_.async_error();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    fail(cat("the backend reported an asynchronous error: ", error), nullptr);
    return;
  }
  // Operations finish in launch order on one stream, but groups differ in speed: every
  // entry is queried, not only the oldest.
  std::vector<std::shared_ptr<Work>> finished;
  const auto now = std::chrono::steady_clock::now();
  Entry late{};
  bool is_late = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = false;
      std::string query_error;
      try {
        done = it->done();
      } catch (const std::exception& e) {
        query_error = e.what();
      }
      if (!query_error.empty()) {
        it->work->finish(std::make_exception_ptr(
            CommError(cat(it->work->description(), " failed on the device: ", query_error))));
        it = pending_.erase(it);
      } else if (done) {
        finished.push_back(std::move(it->work));
        it = pending_.erase(it);
      } else {
        if (!is_late && now >= it->deadline) {
          late = *it;
          is_late = true;
        }
        ++it;
      }
    }
  }
  for (auto& w : finished) {
    w->finish();
  }
  if (is_late) {
    const auto elapsed =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - (late.deadline - late.timeout));
    fail(cat(late.work->description(), " did not complete within the timeout of ",
             late.timeout.count(), " ms (elapsed since launch: ", elapsed.count(),
             " ms); a member of the group has not joined this collective, or joined a "
             "different one"),
         &late);
  }
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const bool idle = pending_.empty();
    // Idle, the backend's error is still polled, at a slower pace.
    cv_.wait_for(lock, idle ? interval_ * 50 : interval_);
    if (stop_) {
      break;
    }
    lock.unlock();
    poll();
    lock.lock();
  }
}

}  // namespace detail
}  // namespace decent_dp
