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
// operation.
//
// `serves`: the device type of the tensors it takes, kCUDA for the wrappers; kCPU stages
// CPU tensors through separate host copies, which exercises the same code on machines
// without a GPU (tests/mpi/test_staged_comm.cpp).
#pragma once

#include <memory>

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
  // A host buffer for `t` (from the inner communicator's allocate: shared memory on MPI).
  at::Tensor host_buffer(const at::Tensor& t, int64_t numel);

  std::shared_ptr<Communicator> inner_;
  c10::DeviceType serves_;
};

}  // namespace decent_dp
