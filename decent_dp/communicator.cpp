#include "decent_dp/communicator.h"

#include "decent_dp/errors.h"

namespace decent_dp {

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
