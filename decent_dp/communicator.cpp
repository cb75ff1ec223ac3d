#include "decent_dp/communicator.h"

#include <ATen/ops/zeros.h>

#include "decent_dp/errors.h"

namespace decent_dp {

at::Tensor Communicator::allocate(int64_t numel, const at::TensorOptions& options) {
  DECENT_DP_CHECK_ARG(numel >= 0, "allocate: numel must be >= 0, got ", numel);
  return at::zeros({numel}, options);
}

std::shared_ptr<Work> Communicator::allgather(const at::Tensor& /*output*/,
                                              const at::Tensor& /*input*/,
                                              const AllgatherOptions& /*options*/) {
  throw InvalidArgument(detail::cat("allgather: the ", to_string(backend()),
                                    " backend does not implement all-gather"));
}

std::shared_ptr<Work> Communicator::allgather_varying(const at::Tensor& /*output*/,
                                                      const at::Tensor& /*input*/,
                                                      const at::Tensor& /*lengths*/,
                                                      const AllgatherOptions& /*options*/) {
  throw InvalidArgument(detail::cat("allgather_varying: the ", to_string(backend()),
                                    " backend does not implement the varying all-gather"));
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "?";
}

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kMpi:
      return "mpi";
    case Backend::kNccl:
      return "nccl";
  }
  return "?";
}

std::string ranks_to_string(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) {
      out += ',';
    }
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

}  // namespace decent_dp
