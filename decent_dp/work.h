// Note [Work handles]
// Every asynchronous operation returns a std::shared_ptr<Work>. The handle keeps the
// operation's tensors alive until the operation is done, wait() blocks until completion
// and rethrows the backend's error, and a wait that outlives its timeout throws
// TimeoutError naming the operation, the group and the elapsed time instead of hanging.
// On CUDA, synchronize() orders the current stream after the communication without
// blocking the host; on CPU it is wait().
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace decent_dp {

class Work {
 public:
  // `description` names the operation and its group, e.g.
  // "allreduce(avg, 1024 x float32) on group [0,1]"; `timeout` is the default of wait().
  Work(std::string description, std::vector<at::Tensor> tensors, std::chrono::milliseconds timeout);
  virtual ~Work() = default;

  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // True once the operation finished, successfully or not. Never blocks.
  bool is_completed() const;
  // True once the operation finished with an error.
  bool has_error() const;
  // Blocks until done and rethrows the operation's error; throws TimeoutError after the
  // handle's default timeout.
  void wait();
  // As wait(), with an explicit timeout (> 0).
  void wait(std::chrono::milliseconds timeout);
  // CPU backends: wait(). CUDA backends: the current stream waits for the operation.
  virtual void synchronize();

  const std::string& description() const { return description_; }
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  std::chrono::milliseconds default_timeout() const { return timeout_; }

  // Marks the operation done; `error` is rethrown by wait(). Called by the backend once.
  void finish(std::exception_ptr error = nullptr);

 protected:
  // Called repeatedly by a blocked wait(): a backend that can advance its operations from
  // the waiting thread does so once and returns true; otherwise wait() sleeps until finish().
  virtual bool drive_progress() { return false; }
  // Called when a blocked wait() starts and stops driving progress.
  virtual void on_wait_begin() {}
  virtual void on_wait_end() {}

 private:
  const std::string description_;
  std::vector<at::Tensor> tensors_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace decent_dp
