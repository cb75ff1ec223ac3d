#include "decent_dp/routed_communicator.h"

#include <algorithm>

#include "decent_dp/backend.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

// CPU tensors are one route whatever their index says; other devices are told apart by index.
bool same_route(const c10::Device& a, const c10::Device& b) {
  return detail::route_device(a) == detail::route_device(b);
}

}  // namespace

RoutedCommunicator::RoutedCommunicator(std::shared_ptr<Communicator> control,
                                       std::vector<Route> routes)
    : control_(std::move(control)), routes_(std::move(routes)) {
  DECENT_DP_CHECK_ARG(control_ != nullptr, "RoutedCommunicator: control must not be null");
  DECENT_DP_CHECK_ARG(!routes_.empty(), "RoutedCommunicator: routes must name at least one device");
  for (size_t i = 0; i < routes_.size(); ++i) {
    const auto& [device, comm] = routes_[i];
    DECENT_DP_CHECK_ARG(comm != nullptr, "RoutedCommunicator: the communicator of route ", i, " (",
                        device.str(), ") must not be null");
    DECENT_DP_CHECK_ARG(!device.is_cuda() || device.has_index(), "RoutedCommunicator: route ", i,
                        " must name its CUDA device with an index (e.g. cuda:0), got ",
                        device.str());
    DECENT_DP_CHECK_ARG(comm->supports(device), "RoutedCommunicator: route ", i, " is for ",
                        device.str(), ", and its ", to_string(comm->backend()),
                        " communicator does not take tensors there");
    DECENT_DP_CHECK_ARG(comm->rank() == control_->rank() && comm->size() == control_->size(),
                        "RoutedCommunicator: route ", i, " (", device.str(), ") has rank ",
                        comm->rank(), " of ", comm->size(), ", the control communicator rank ",
                        control_->rank(), " of ", control_->size(),
                        "; every route must span the control communicator's ranks");
    for (size_t j = 0; j < i; ++j) {
      DECENT_DP_CHECK_ARG(!same_route(routes_[j].first, device), "RoutedCommunicator: routes ", j,
                          " and ", i, " are both for ", device.str(),
                          "; expected one route per device");
    }
  }
}

Communicator* RoutedCommunicator::find(const c10::Device& device) const {
  for (const auto& [d, comm] : routes_) {
    if (same_route(d, device)) {
      return comm.get();
    }
  }
  return nullptr;
}

std::string RoutedCommunicator::describe() const {
  std::string out;
  for (const auto& [device, comm] : routes_) {
    out += detail::cat(out.empty() ? "" : ", ", device.str(), ": ", to_string(comm->backend()));
  }
  return out;
}

Communicator& RoutedCommunicator::route(const c10::Device& device, const char* who,
                                        const char* name) const {
  Communicator* comm = find(device);
  DECENT_DP_CHECK_ARG(comm != nullptr, who, ": ", name, " is on ", device.str(),
                      "; this communicator routes tensors on ", describe(),
                      " (one of those devices was expected)");
  return *comm;
}

Communicator& RoutedCommunicator::route_of(const char* who, const char* name,
                                           const at::Tensor& input,
                                           const at::Tensor* output) const {
  DECENT_DP_CHECK_ARG(input.defined(), who, ": ", name, " must be defined");
  if (output != nullptr) {
    DECENT_DP_CHECK_ARG(output->defined(), who, ": output must be defined");
    DECENT_DP_CHECK_ARG(same_route(input.device(), output->device()), who, ": output is on ",
                        output->device().str(), " and the input on ", input.device().str(),
                        "; an operation's tensors must be on one device");
  }
  return route(input.device(), who, name);
}

void RoutedCommunicator::make_groups(const std::vector<std::vector<int>>& groups) {
  std::vector<Communicator*> done;
  for (const auto& route : routes_) {
    Communicator* comm = route.second.get();
    if (std::find(done.begin(), done.end(), comm) == done.end()) {
      comm->make_groups(groups);
      done.push_back(comm);
    }
  }
}

bool RoutedCommunicator::has_group(const std::vector<int>& ranks) const {
  return std::all_of(routes_.begin(), routes_.end(),
                     [&ranks](const Route& r) { return r.second->has_group(ranks); });
}

std::shared_ptr<Work> RoutedCommunicator::allreduce(const at::Tensor& input,
                                                    const at::Tensor& output,
                                                    const AllreduceOptions& options) {
  return route_of("allreduce", "input", input, &output).allreduce(input, output, options);
}

std::shared_ptr<Work> RoutedCommunicator::broadcast(const at::Tensor& tensor, int root) {
  return route_of("broadcast", "tensor", tensor).broadcast(tensor, root);
}

std::shared_ptr<Work> RoutedCommunicator::allgather(const at::Tensor& output,
                                                    const at::Tensor& input,
                                                    const AllgatherOptions& options) {
  return route_of("allgather", "input", input, &output).allgather(output, input, options);
}

std::shared_ptr<Work> RoutedCommunicator::allgather_varying(const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            const at::Tensor& lengths,
                                                            const AllgatherOptions& options) {
  // The lengths are the route's business (the MPI backend wants them on the CPU).
  return route_of("allgather_varying", "input", input, &output)
      .allgather_varying(output, input, lengths, options);
}

at::Tensor RoutedCommunicator::allocate(int64_t numel, const at::TensorOptions& options) {
  return route(options.device(), "allocate", "the tensor").allocate(numel, options);
}

}  // namespace decent_dp
