#include "decent_dp/communicator.h"

#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <climits>

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

namespace detail {

uint64_t check_groups(const std::vector<std::vector<int>>& groups, int world_size) {
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the lists
  auto mix = [&hash](uint64_t v) {
    hash ^= v;
    hash *= 1099511628211ULL;
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& g = groups[i];
    DECENT_DP_CHECK_ARG(!g.empty(), "make_groups: group ", i, " is empty");
    for (size_t j = 0; j < g.size(); ++j) {
      DECENT_DP_CHECK_ARG(g[j] >= 0 && g[j] < world_size, "make_groups: group ", i, " ",
                          ranks_to_string(g), " names rank ", g[j], ", expected ranks in [0, ",
                          world_size - 1, "]");
      DECENT_DP_CHECK_ARG(j == 0 || g[j] > g[j - 1], "make_groups: group ", i, " ",
                          ranks_to_string(g), " must list distinct ranks in ascending order");
      mix(static_cast<uint64_t>(g[j]));
    }
    mix(0xFFFFFFFFULL);
  }
  mix(groups.size());
  return hash;
}

std::string host_name() {
  char buffer[HOST_NAME_MAX + 1] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) {
    return "unknown host";
  }
  return buffer;
}

}  // namespace detail
}  // namespace decent_dp
