// Which communicator serves which tensors. Control traffic (model checks, bucket metadata)
// runs on a CPU communicator; each bucket's data traffic on the communicator of its device:
// MPI for CPU tensors; CUDA tensors need the NCCL backend (Backend::kNccl), which is chosen
// here once it exists, and never named by the wrappers.
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "decent_dp/communicator.h"

namespace decent_dp {

// The process-wide MPI communicator (CPU): the wrappers' control communicator, and their
// data communicator for CPU tensors, unless they are given one.
std::shared_ptr<Communicator> default_communicator();

// The communicator for tensors on `device`: `control` itself when it supports the device.
// Throws InvalidArgument naming the device and the backend it needs otherwise.
std::shared_ptr<Communicator> communicator_for_device(const c10::Device& device,
                                                      const std::shared_ptr<Communicator>& control);

}  // namespace decent_dp
