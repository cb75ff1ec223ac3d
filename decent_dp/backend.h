// Which communicator serves which tensors. Control traffic (model checks, bucket metadata)
// runs on a CPU communicator; each bucket's data traffic on the communicator of its device:
// MPI for CPU tensors; for CUDA tensors NCCL (Backend::kNccl) when this build has it and
// every rank has a GPU of its own, and otherwise the MPI communicator with host staging
// (Note [host staging]). A model on several devices gets one communicator per device behind
// a RoutedCommunicator (Note [routed communicator]). The choice is made here, collectively,
// never by the wrappers.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "decent_dp/communicator.h"

namespace decent_dp {

// The process-wide MPI communicator (CPU): the wrappers' control communicator, and their
// data communicator for CPU tensors, unless they are given one.
std::shared_ptr<Communicator> default_communicator();

// The communicator for tensors on `device`: `control` itself when it supports the device.
// For CUDA devices, collective over `control` the first time per device (every rank must
// call it): an NcclCommunicator when the build has NCCL and no two ranks of a host use the
// same GPU, a HostStagedCommunicator over `control` otherwise; the same object is returned
// while it is in use. Throws InvalidArgument naming the device for other device types.
std::shared_ptr<Communicator> communicator_for_device(const c10::Device& device,
                                                      const std::shared_ptr<Communicator>& control);

// The data communicator for tensors on `devices` (distinct, as detail::distinct_devices
// gives them; every rank passes the same device types in the same order, which
// check_same_model verifies): communicator_for_device() of the only device, or a
// RoutedCommunicator over communicator_for_device() of each, made in the given order
// (collective). Throws InvalidArgument for an empty list or a device without a backend.
std::shared_ptr<Communicator> communicator_for_devices(
    const std::vector<c10::Device>& devices, const std::shared_ptr<Communicator>& control);

// The device a rank trains on by default: cuda:<local rank modulo the node's GPU count>
// when this process sees a GPU, the CPU otherwise.
c10::Device local_device(const Communicator& comm);

// True when this build has the NCCL backend (decent_dp/config.h: DECENT_DP_HAVE_NCCL).
bool has_nccl_backend();

namespace detail {

// The device a communicator route stands for: the CPU whatever its index, other devices as
// they are (cuda:0 and cuda:1 are two routes).
c10::Device route_device(const c10::Device& device);
// The route devices of `tensors`, each once, in order of first appearance.
std::vector<c10::Device> distinct_devices(const std::vector<at::Tensor>& tensors);

// "<host>#<device index>" of every rank, gathered over `control` (collective).
std::vector<std::string> rank_devices(Communicator& control, int device_index);
// The first two ranks whose entries are equal (they share a GPU), or (-1, -1).
std::pair<int, int> first_shared_device(const std::vector<std::string>& rank_devices);

}  // namespace detail
}  // namespace decent_dp
