// Communicator over MPI for CPU tensors.
//
// Note [MPI progress thread]
// Non-blocking MPI collectives progress only inside MPI calls. Every MPI call of a
// communicator is therefore made by one progress thread it owns: callers enqueue
// operations, the thread starts them (MPI_Iallreduce, ...) in submission order — which is
// the program order, identical on every rank, as MPI requires — and polls MPI_Testsome
// until they complete. While a caller blocks in Work::wait() the thread polls without
// pausing; otherwise it sleeps `progress_interval` between polls so it leaves the core to
// the computation it overlaps with. MPI is initialised with MPI_THREAD_MULTIPLE (checked).
#pragma once

#include <chrono>
#include <memory>

#include "decent_dp/communicator.h"

namespace decent_dp {

struct MpiOptions {
  // Default timeout of Work::wait(); <= 0 takes DECENT_DP_TIMEOUT_MS (default 10 min).
  std::chrono::milliseconds timeout{0};
  // Pause between two polls while nobody waits; < 0 takes DECENT_DP_PROGRESS_INTERVAL_US
  // (default 50 us). 0 polls continuously.
  std::chrono::microseconds progress_interval{-1};
};

class MpiCommunicator final : public Communicator {
 public:
  // Initialises MPI on first use (MPI_THREAD_MULTIPLE) unless the program already did, in
  // which case the provided thread level must be MPI_THREAD_MULTIPLE. Collective over
  // MPI_COMM_WORLD, which it duplicates.
  explicit MpiCommunicator(MpiOptions options = {});
  ~MpiCommunicator() override;

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  Backend backend() const override { return Backend::kMpi; }
  int rank() const override;
  int size() const override;
  int local_rank() const override;
  int local_size() const override;

  void make_groups(const std::vector<std::vector<int>>& groups) override;
  bool has_group(const std::vector<int>& ranks) const override;

  std::shared_ptr<Work> allreduce(const at::Tensor& tensor, const std::vector<int>& ranks,
                                  ReduceOp op) override;
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) override;
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input) override;
  void barrier() override;

  std::chrono::milliseconds timeout() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace decent_dp
