#include "decent_dp/backend.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "decent_dp/config.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"
#include "decent_dp/mpi_communicator.h"
#include "decent_dp/routed_communicator.h"
#include "decent_dp/staged_communicator.h"
#if DECENT_DP_HAVE_NCCL
#include "decent_dp/nccl_communicator.h"
#endif

namespace decent_dp {

std::shared_ptr<Communicator> default_communicator() {
  // Constructed in the initializer, so its destructor runs before the MPI finalization that
  // its constructor registers with atexit.
  static std::shared_ptr<Communicator> instance = std::make_shared<MpiCommunicator>();
  return instance;
}

bool has_nccl_backend() {
  return DECENT_DP_HAVE_NCCL != 0;
}

c10::Device local_device(const Communicator& comm) {
  const int count = at::detail::getCUDAHooks().getNumGPUs();
  if (count <= 0) {
    return c10::Device(c10::kCPU);
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(comm.local_rank() % count));
}

namespace detail {

c10::Device route_device(const c10::Device& device) {
  return device.is_cpu() ? c10::Device(c10::kCPU) : device;
}

std::vector<c10::Device> distinct_devices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> out;
  for (const auto& t : tensors) {
    const c10::Device d = route_device(t.device());
    if (std::find(out.begin(), out.end(), d) == out.end()) {
      out.push_back(d);
    }
  }
  return out;
}

std::vector<std::string> rank_devices(Communicator& control, int device_index) {
  constexpr int64_t kWidth = 256;
  const std::string me = cat(host_name(), "#", device_index);
  auto in = at::empty({kWidth}, at::TensorOptions().dtype(at::kChar));
  std::memset(in.data_ptr(), 0, kWidth);
  std::memcpy(in.data_ptr(), me.data(), std::min<size_t>(me.size(), kWidth - 1));
  auto out = at::empty({kWidth * control.size()}, in.options());
  control.allgather(out, in, AllgatherOptions{{}, {}, "device of every rank"})->wait();
  std::vector<std::string> result;
  const char* all = static_cast<const char*>(out.data_ptr());
  for (int r = 0; r < control.size(); ++r) {
    result.emplace_back(all + kWidth * r, strnlen(all + kWidth * r, kWidth));
  }
  return result;
}

std::pair<int, int> first_shared_device(const std::vector<std::string>& rank_devices) {
  for (size_t j = 1; j < rank_devices.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      if (rank_devices[i] == rank_devices[j]) {
        return {static_cast<int>(i), static_cast<int>(j)};
      }
    }
  }
  return {-1, -1};
}

}  // namespace detail

std::shared_ptr<Communicator> communicator_for_device(
    const c10::Device& device, const std::shared_ptr<Communicator>& control) {
  DECENT_DP_CHECK_ARG(control != nullptr, "communicator_for_device: control must not be null");
  if (control->supports(device)) {
    return control;
  }
  if (!device.is_cuda()) {
    throw InvalidArgument(detail::cat("no communication backend for tensors on ", device.str(),
                                      "; the ", to_string(control->backend()),
                                      " communicator does not take them (CPU and CUDA tensors "
                                      "are supported)"));
  }
  DECENT_DP_CHECK_ARG(device.has_index(),
                      "communicator_for_device: name the CUDA device "
                      "(e.g. cuda:0), got ",
                      device.str());
  const int count = at::detail::getCUDAHooks().getNumGPUs();
  DECENT_DP_CHECK_ARG(device.index() < count, device.str(), " was asked for, but rank ",
                      control->rank(), " sees ", count, " CUDA devices");
  DECENT_DP_CHECK_ARG(control->supports(c10::Device(c10::kCPU)),
                      "communicator_for_device: the control communicator must take CPU tensors");
  // One communicator per (control, device) while someone holds it: making one is collective.
  static std::mutex mutex;
  static std::map<std::pair<const Communicator*, int>, std::weak_ptr<Communicator>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(control.get(), static_cast<int>(device.index()));
  if (auto hit = cache[key].lock()) {
    return hit;
  }
  const auto devices = detail::rank_devices(*control, device.index());
  const auto shared = detail::first_shared_device(devices);
  std::shared_ptr<Communicator> made;
  std::string why;
#if DECENT_DP_HAVE_NCCL
  if (shared.first < 0) {
    NcclOptions options;
    options.device = device.index();
    made = std::make_shared<NcclCommunicator>(control, options);
  } else {
    why = detail::cat("ranks ", shared.first, " and ", shared.second, " share ",
                      devices[shared.first], " (host#device), and NCCL needs a GPU per rank");
  }
#else
  why = "this build has no NCCL backend (configure with -DDECENT_DP_WITH_NCCL=ON)";
#endif
  if (!made) {
    made = std::make_shared<HostStagedCommunicator>(control, c10::kCUDA);
    if (control->rank() == 0) {
      DECENT_DP_LOG_WARN(detail::cat("CUDA tensors are exchanged through the ",
                                     to_string(control->backend()),
                                     " backend with host staging: ", why));
    }
  }
  cache[key] = made;
  return made;
}

std::shared_ptr<Communicator> communicator_for_devices(
    const std::vector<c10::Device>& devices, const std::shared_ptr<Communicator>& control) {
  DECENT_DP_CHECK_ARG(!devices.empty(), "communicator_for_devices: devices must not be empty");
  std::vector<RoutedCommunicator::Route> routes;
  for (const auto& device : devices) {
    routes.emplace_back(detail::route_device(device), communicator_for_device(device, control));
  }
  if (routes.size() == 1) {
    return routes[0].second;
  }
  auto routed = std::make_shared<RoutedCommunicator>(control, std::move(routes));
  if (control->rank() == 0) {
    DECENT_DP_LOG_INFO(detail::cat("tensors on ", devices.size(),
                                   " devices; each exchanges through its own communicator (",
                                   routed->describe(), ")"));
  }
  return routed;
}

}  // namespace decent_dp
