// Communicator over NCCL for CUDA tensors (Note [NCCL backend] in nccl_communicator.cpp).
//
// Built when the configuration found NCCL >= 2.18 and a CUDA LibTorch
// (DECENT_DP_WITH_NCCL=AUTO|ON); decent_dp/config.h says whether it is in this build
// (DECENT_DP_HAVE_NCCL). The wrappers choose it themselves for CUDA parameters
// (communicator_for_device in backend.h); constructing one directly is for programs that
// issue collectives of their own.
//
// Ordering: every operation runs on the communicator's own stream, which first waits for
// the work the caller's current stream has queued (an event), so the inputs are ready;
// Work::synchronize() makes the caller's current stream wait for the operation's end event
// without blocking the host; Work::wait() blocks the host until the device has finished.
// Tensors in flight are recorded on the communication stream with the caching allocator,
// so memory freed by the caller is not reused before the collective is done.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "decent_dp/communicator.h"

namespace decent_dp {

struct NcclOptions {
  // CUDA device of this rank; -1: the local rank modulo the node's device count.
  int device = -1;
  // Default timeout of the Work handles, enforced by the watchdog, which aborts the
  // communicators when it passes; <= 0 takes the control communicator's.
  std::chrono::milliseconds timeout{0};
  // Pause between two watchdog polls of the operations in flight.
  std::chrono::microseconds poll_interval{100};
  // Non-blocking NCCL communicators (ncclConfig_t::blocking = 0), which the watchdog can
  // abort while a collective is stuck. Must agree across ranks.
  bool nonblocking = true;
};

// What the communicator's operations did so far (over more than one rank).
struct NcclStats {
  uint64_t allreduces = 0;
  uint64_t allgathers = 0;
  uint64_t broadcasts = 0;
  uint64_t bytes_sent = 0;  // payload this rank sent, as the MPI backend counts it
};

class NcclCommunicator final : public Communicator {
 public:
  // Collective over every rank of `control` (a CPU communicator, e.g. the process's MPI
  // one): rank 0 makes the NCCL unique id and broadcasts it over `control`. Every rank must
  // name a device of its own (NCCL refuses two ranks on one GPU; ranks sharing a GPU
  // exchange CUDA tensors through the MPI backend with host staging instead).
  explicit NcclCommunicator(std::shared_ptr<Communicator> control, NcclOptions options = {});
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  Backend backend() const override { return Backend::kNccl; }
  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;

  // Collective over all ranks: one NCCL communicator per group, split from the world's
  // (ncclCommSplit); groups that overlap take separate splits.
  void make_groups(const std::vector<std::vector<int>>& groups) override;
  bool has_group(const std::vector<int>& ranks) const override;

  using Communicator::allgather;
  using Communicator::allreduce;
  std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                  const AllreduceOptions& options) override;
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) override;
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                  const AllgatherOptions& options) override;
  // A one-element all-reduce over every rank, waited for on the host.
  void barrier() override;
  // at::zeros on this communicator's device.
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options) override;

  std::chrono::milliseconds timeout() const override;
  // CUDA tensors on this communicator's device.
  bool supports(const c10::Device& device) const override;

  // The CUDA device index this rank uses.
  int device_index() const;
  // The NCCL library's version code at run time (ncclGetVersion), e.g. 22809.
  static int runtime_version();
  NcclStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace decent_dp
