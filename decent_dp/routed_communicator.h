// Note [routed communicator]
// A model whose parameters live on several devices (an embedding table on the CPU and the
// rest on a GPU, or layers spread over two GPUs) has buckets on each of them, and each
// bucket's exchange belongs on the communicator of its device: NCCL for CUDA buckets, MPI
// for CPU ones. RoutedCommunicator is that choice behind the one Communicator interface the
// wrappers use, so exchanges, the rank-0 broadcast, the global average and the consensus
// distance need no per-device code:
//
//   - every tensor operation goes to the route of its tensors' device (all its tensors must
//     be on that device); allocate() to the route of the options' device;
//   - make_groups() goes to every route (each distinct communicator once, in route order),
//     has_group() holds when every route has the group;
//   - rank, size, barrier and timeout are the control communicator's.
//
// Ordering: each route keeps its own call order, and every rank issues the same operations
// in the same order, so each route sees the same sequence on every rank; operations of
// different routes are independent (an NCCL all-reduce of a CUDA bucket and an MPI
// all-reduce of a CPU bucket may be in flight together).
//
// Routes are keyed by device: type and index for CUDA (cuda:0 and cuda:1 are two routes, and
// a CUDA route must name its index), type alone for the CPU (detail::route_device).
// communicator_for_devices() in backend.h builds one for the wrappers.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "decent_dp/communicator.h"

namespace decent_dp {

class RoutedCommunicator final : public Communicator {
 public:
  using Route = std::pair<c10::Device, std::shared_ptr<Communicator>>;

  // `control`: rank, size, barrier and timeout; it need not be one of the routes. Each route's
  // communicator must take its device's tensors and have control's rank and size; devices
  // must be distinct routes. Throws InvalidArgument naming the route otherwise.
  RoutedCommunicator(std::shared_ptr<Communicator> control, std::vector<Route> routes);

  // The first route's backend (messages name each route's backend through describe()).
  Backend backend() const override { return routes_.front().second->backend(); }
  int rank() const override { return control_->rank(); }
  int size() const override { return control_->size(); }
  int local_rank() const override { return control_->local_rank(); }
  int local_size() const override { return control_->local_size(); }
  void make_groups(const std::vector<std::vector<int>>& groups) override;
  bool has_group(const std::vector<int>& ranks) const override;

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
  void barrier() override { control_->barrier(); }
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options) override;

  std::chrono::milliseconds timeout() const override { return control_->timeout(); }
  bool supports(const c10::Device& device) const override { return find(device) != nullptr; }

  // The communicator serving `device` (null: none).
  Communicator* find(const c10::Device& device) const;
  const std::vector<Route>& routes() const { return routes_; }
  // "cpu: mpi, cuda:0: nccl"
  std::string describe() const;

 private:
  // The route of `device`; InvalidArgument naming `who`, `name` and the routed devices when
  // there is none.
  Communicator& route(const c10::Device& device, const char* who, const char* name) const;
  // The route of operation `who` on `input` (called `name` in messages), whose `output`, if
  // given, must be defined and on the same device.
  Communicator& route_of(const char* who, const char* name, const at::Tensor& input,
                         const at::Tensor* output = nullptr) const;

  std::shared_ptr<Communicator> control_;
  std::vector<Route> routes_;
};

}  // namespace decent_dp
