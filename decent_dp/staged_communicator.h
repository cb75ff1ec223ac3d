// Note [host staging]
// A communicator for tensors its inner (CPU) communicator cannot take: every operation
// copies its inputs to host buffers, runs the inner communicator's operation on them, and
// copies the results back when the caller waits for the Work. This is how CUDA buckets are
// exchanged when NCCL cannot serve them: ranks sharing one GPU (NCCL needs a device per
// rank), or a build without NCCL.
//
// Ordering: the copy to the host is made on the caller's current stream and completes before
// the inner operation starts (the inputs are ready); the copy back runs on the caller's
// current stream in wait() or synchronize(), so later work on that stream reads the result.
// is_completed() stays false until the caller has waited: the copy back is part of the
// operation. Host buffers are kept per caller tensor (address, length, dtype, role) and
// reused by its next operation once the previous one has been waited for: the wrappers'
// blocks stage through the same shared-memory buffers every step.
//
// `serves`: the device type of the tensors it takes, kCUDA for the wrappers; kCPU stages
// CPU tensors through separate host copies, which exercises the same code on machines
// without a GPU (tests/mpi/test_staged_comm.cpp).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "decent_dp/communicator.h"

namespace decent_dp {

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(std::shared_ptr<Communicator> inner, c10::DeviceType serves);

  Backend backend() const override { return inner_->backend(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int local_rank() const override { return inner_->local_rank(); }
  int local_size() const override { return inner_->local_size(); }
  void make_groups(const std::vector<std::vector<int>>& groups) override {
    inner_->make_groups(groups);
  }
  bool has_group(const std::vector<int>& ranks) const override { return inner_->has_group(ranks); }

  using Communicator::allgather;
  using Communicator::allreduce;
  std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                  const AllreduceOptions& options) override;
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) override;
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                  const AllgatherOptions& options) override;
  std::shared_ptr<Work> allgather_varying(const at::Tensor& output, const at::Tensor& input,
                                          const at::Tensor& lengths,
                                          const AllgatherOptions& options) override;
  void barrier() override { inner_->barrier(); }

  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  bool supports(const c10::Device& device) const override { return device.type() == serves_; }

  const std::shared_ptr<Communicator>& inner() const { return inner_; }

 private:
  void check(const at::Tensor& t, const char* who, const char* name) const;
  // A host buffer of `numel` elements of t's dtype for `t` in `role` (0: input or in-place,
  // 1: output, 2: lengths), from the inner communicator's allocate (shared memory on MPI):
  // the cached one unless an operation not yet waited for still uses it (then its key is
  // added to `used`).
  using Key = std::tuple<const void*, int64_t, int, int>;  // address, numel, dtype, role
  at::Tensor host_buffer(const at::Tensor& t, int64_t numel, int role, std::vector<Key>& used);
  // Marks the cached buffers `used` as taken by `work` until it has been waited for.
  void claim(const std::vector<Key>& used, const std::shared_ptr<Work>& work);

  struct Cached {
    at::Tensor host;
    std::weak_ptr<Work> user;
  };
  std::shared_ptr<Communicator> inner_;
  c10::DeviceType serves_;
  std::mutex mutex_;
  std::map<Key, Cached> cache_;
};

}  // namespace decent_dp
