#include "decent_dp/staged_communicator.h"

#include <exception>
#include <utility>

#include "decent_dp/errors.h"

namespace decent_dp {

namespace {

// The inner operation on host buffers, then the copies back into the caller's tensors.
class StagedWork final : public Work {
 public:
  StagedWork(std::shared_ptr<Work> inner, std::vector<std::pair<at::Tensor, at::Tensor>> back,
             std::vector<at::Tensor> keep)
      : Work(inner->description() + " (host-staged)", std::move(keep), inner->default_timeout()),
        inner_(std::move(inner)),
        back_(std::move(back)) {}

  void synchronize() override { wait(); }

 protected:
  // Runs on the waiting thread: the inner wait, then the copies back on the current stream.
  bool drive_progress() override {
    if (is_completed()) {
      return true;
    }
    std::exception_ptr error;
    try {
      inner_->wait();
      for (auto& [host, target] : back_) {
        target.copy_(host.view_as(target));
      }
    } catch (...) {
      error = std::current_exception();
    }
    back_.clear();
    finish(error);
    return true;
  }

 private:
  std::shared_ptr<Work> inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (host result, caller's tensor)
};

}  // namespace

HostStagedCommunicator::HostStagedCommunicator(std::shared_ptr<Communicator> inner,
                                               c10::DeviceType serves)
    : inner_(std::move(inner)), serves_(serves) {
  DECENT_DP_CHECK_ARG(inner_ != nullptr, "HostStagedCommunicator: inner must not be null");
  DECENT_DP_CHECK_ARG(inner_->supports(c10::Device(c10::kCPU)),
                      "HostStagedCommunicator: inner must take CPU tensors; the ",
                      to_string(inner_->backend()), " communicator does not");
}

void HostStagedCommunicator::check(const at::Tensor& t, const char* who, const char* name) const {
  DECENT_DP_CHECK_ARG(t.defined(), who, ": ", name, " must be defined");
  DECENT_DP_CHECK_ARG(t.device().type() == serves_, who, ": ", name, " is on ", t.device().str(),
                      "; this host-staged communicator takes ", c10::DeviceTypeName(serves_),
                      " tensors");
}

at::Tensor HostStagedCommunicator::host_buffer(const at::Tensor& t, int64_t numel, int role,
                                               std::vector<Key>& used) {
  constexpr size_t kMaxCached = 4096;
  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{t.data_ptr(), numel, static_cast<int>(t.scalar_type()), role};
  auto it = cache_.find(key);
  if (it != cache_.end()) {
    auto user = it->second.user.lock();
    if (!user || user->is_completed()) {
      used.push_back(key);
      return it->second.host;
    }
    // Still in use by an operation nobody has waited for: a buffer of its own.
    return inner_->allocate(numel, t.options().device(c10::kCPU));
  }
  if (cache_.size() >= kMaxCached) {
    cache_.clear();  // tensors come and go; the wrappers' blocks are back at the next step
  }
  at::Tensor host = inner_->allocate(numel, t.options().device(c10::kCPU));
  cache_.emplace(key, Cached{host, {}});
  used.push_back(key);
  return host;
}

void HostStagedCommunicator::claim(const std::vector<Key>& used,
                                   const std::shared_ptr<Work>& work) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Key& k : used) {
    auto it = cache_.find(k);
    if (it != cache_.end()) {
      it->second.user = work;
    }
  }
}

std::shared_ptr<Work> HostStagedCommunicator::allreduce(const at::Tensor& input,
                                                        const at::Tensor& output,
                                                        const AllreduceOptions& options) {
  check(input, "allreduce", "input");
  check(output, "allreduce", "output");
  DECENT_DP_CHECK_ARG(
      input.scalar_type() == output.scalar_type() && input.numel() == output.numel(),
      "allreduce: output must match input (", input.numel(), " x ", input.scalar_type(), "), got ",
      output.numel(), " x ", output.scalar_type());
  std::vector<Key> used;
  at::Tensor host = host_buffer(input, input.numel(), 0, used);
  host.copy_(input.reshape({-1}));  // waits for the caller's stream: the input is ready
  auto work =
      std::make_shared<StagedWork>(inner_->allreduce(host, host, options),
                                   std::vector<std::pair<at::Tensor, at::Tensor>>{{host, output}},
                                   std::vector<at::Tensor>{input, output});
  claim(used, work);
  return work;
}

std::shared_ptr<Work> HostStagedCommunicator::broadcast(const at::Tensor& tensor, int root) {
  check(tensor, "broadcast", "tensor");
  std::vector<Key> used;
  at::Tensor host = host_buffer(tensor, tensor.numel(), 0, used);
  host.copy_(tensor.reshape({-1}));
  auto work = std::make_shared<StagedWork>(
      inner_->broadcast(host, root), std::vector<std::pair<at::Tensor, at::Tensor>>{{host, tensor}},
      std::vector<at::Tensor>{tensor});
  claim(used, work);
  return work;
}

std::shared_ptr<Work> HostStagedCommunicator::allgather(const at::Tensor& output,
                                                        const at::Tensor& input,
                                                        const AllgatherOptions& options) {
  check(input, "allgather", "input");
  check(output, "allgather", "output");
  std::vector<Key> used;
  at::Tensor in = host_buffer(input, input.numel(), 0, used);
  in.copy_(input.reshape({-1}));
  at::Tensor out = host_buffer(output, output.numel(), 1, used);
  auto work =
      std::make_shared<StagedWork>(inner_->allgather(out, in, options),
                                   std::vector<std::pair<at::Tensor, at::Tensor>>{{out, output}},
                                   std::vector<at::Tensor>{input, output, in});
  claim(used, work);
  return work;
}

std::shared_ptr<Work> HostStagedCommunicator::allgather_varying(const at::Tensor& output,
                                                                const at::Tensor& input,
                                                                const at::Tensor& lengths,
                                                                const AllgatherOptions& options) {
  check(input, "allgather_varying", "input");
  check(output, "allgather_varying", "output");
  DECENT_DP_CHECK_ARG(lengths.defined(), "allgather_varying: lengths must be defined");
  std::vector<Key> used;
  at::Tensor in = host_buffer(input, input.numel(), 0, used);
  in.copy_(input.reshape({-1}));
  at::Tensor out = host_buffer(output, output.numel(), 1, used);
  at::Tensor len = lengths.is_cpu() ? lengths : host_buffer(lengths, lengths.numel(), 2, used);
  std::vector<std::pair<at::Tensor, at::Tensor>> back{{out, output}};
  if (!lengths.is_cpu()) {
    back.emplace_back(len, lengths);
  }
  auto work = std::make_shared<StagedWork>(inner_->allgather_varying(out, in, len, options),
                                           std::move(back),
                                           std::vector<at::Tensor>{input, output, lengths, in});
  claim(used, work);
  return work;
}

}  // namespace decent_dp
