// Note [NCCL watchdog]
// A GPU collective is launched on a stream and finishes on the device; nothing on the host
// learns of it unless someone asks. The watchdog is a thread that asks: it polls every
// operation in flight (on NCCL: the operation's end event) and finishes its Work handle
// when the device is done, polls the backend's asynchronous error (ncclCommGetAsyncError),
// and enforces each operation's deadline. On an asynchronous error or a deadline missed it
// aborts the backend once (ncclCommAbort, which makes every kernel stuck in a collective
// return), fails every pending operation with a CommError, or TimeoutError for the one whose
// deadline passed, naming the operation, and refuses new ones naming the first failure:
// a stuck or failed collective raises a named error on every rank that waits for it,
// instead of hanging the job.
//
// The watchdog knows nothing about CUDA: the backend hands it, per operation, a
// non-blocking `done` query, and once per communicator the error query and the abort.
// Tested with fakes on the CPU (tests/unit/test_watchdog.cpp).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "decent_dp/work.h"

namespace decent_dp {
namespace detail {

class Watchdog {
 public:
  struct Hooks {
    // "" while the backend is healthy; otherwise its error, e.g. "ncclRemoteError: ...".
    std::function<std::string()> async_error;
    // Ends every operation of the backend (called once, from the watchdog thread).
    std::function<void()> abort;
  };

  // `name` prefixes the errors, e.g. "NCCL communicator of rank 3 (host n7, cuda:1)";
  // `interval` is the pause between polls.
  Watchdog(std::string name, Hooks hooks, std::chrono::microseconds interval);
  // Stops the thread; operations still pending finish with a CommError.
  ~Watchdog();

  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Follows `work` until `done()` returns true (then work->finish()) or `timeout` passes.
  // Throws the failure as CommError when the watchdog has already failed.
  void track(std::shared_ptr<Work> work, std::function<bool()> done,
             std::chrono::milliseconds timeout);
  // Throws CommError naming the first failure when there was one.
  void check() const;
  // "" or the message of the first failure.
  std::string failure() const;
  size_t pending() const;
  // Polls once from the caller's thread (the thread does the same every interval).
  void poll();

 private:
  struct Entry {
    std::shared_ptr<Work> work;
    std::function<bool()> done;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };
  void fail(const std::string& message, const Entry* timed_out);
  void run();

  const std::string name_;
  const Hooks hooks_;
  const std::chrono::microseconds interval_;
  mutable std::mutex mutex_;
  std::mutex poll_mutex_;  // one poll at a time (thread and callers)
  std::condition_variable cv_;
  std::deque<Entry> pending_;
  std::string failure_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace detail
}  // namespace decent_dp
