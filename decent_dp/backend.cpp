#include "decent_dp/backend.h"

#include "decent_dp/errors.h"
#include "decent_dp/mpi_communicator.h"

namespace decent_dp {

std::shared_ptr<Communicator> default_communicator() {
  // Constructed in the initializer, so its destructor runs before the MPI finalization that
  // its constructor registers with atexit.
  static std::shared_ptr<Communicator> instance = std::make_shared<MpiCommunicator>();
  return instance;
}

std::shared_ptr<Communicator> communicator_for_device(
    const c10::Device& device, const std::shared_ptr<Communicator>& control) {
  DECENT_DP_CHECK_ARG(control != nullptr, "communicator_for_device: control must not be null");
  if (control->supports(device)) {
    return control;
  }
  if (device.is_cuda()) {
    throw InvalidArgument(detail::cat(
        "tensors on ", device.str(), " need the NCCL backend (Backend::", to_string(Backend::kNccl),
        "), which this build does not provide; the ", to_string(control->backend()),
        " communicator takes CPU tensors: keep the model on the CPU"));
  }
  throw InvalidArgument(detail::cat("no communication backend for tensors on ", device.str(),
                                    "; the ", to_string(control->backend()),
                                    " communicator does not take them"));
}

}  // namespace decent_dp
