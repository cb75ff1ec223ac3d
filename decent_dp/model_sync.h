// The collective checks and copies that make every rank start from the same model: run on
// the control communicator (CPU) except the broadcast of the tensors themselves.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "decent_dp/communicator.h"
#include "decent_dp/exchange_stage.h"  // NamedTensors

namespace decent_dp {

// Collective. Throws InvalidArgument on every rank unless all ranks hold the same entries
// (names, shapes, dtypes, requires_grad) in the same order; the message shows rank 0's and
// the first differing rank's values, e.g. "entry 2: rank 0 has 'fc.weight' [4, 8] Float,
// rank 2 has 'fc.weight' [5, 8] Float".
void check_same_model(Communicator& control, const NamedTensors& items);

// Collective over `comm`: every tensor takes rank 0's values (any layout).
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors);

// Collective. Throws Error unless every rank recorded the same first-iteration order of
// parameter indices (`order`, into `params` / `names`).
void check_same_order(Communicator& control, const std::vector<size_t>& order,
                      const std::vector<at::Tensor>& params, const std::vector<std::string>& names);

}  // namespace decent_dp
