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
// (names, shapes, dtypes, requires_grad, device types) in the same order, with the same
// entries sharing a device (device indices may differ: cuda:<local rank>); the message
// shows rank 0's and the first differing rank's values, e.g. "entry 2: rank 0 has
// 'fc.weight' [4, 8] Float requires_grad on cpu (its device #0), rank 2 has 'fc.weight'
// [5, 8] Float requires_grad on cpu (its device #0)".
void check_same_model(Communicator& control, const NamedTensors& items);

// Collective over `comm`: every tensor takes rank 0's values (any layout).
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors);

// Collective. The first-iteration order of parameter indices (`order`, into `names`) that
// every rank's buckets follow: rank 0's. Throws Error unless every rank's order holds the
// same parameters, naming the first difference. The orders themselves may differ (Note
// [gradient order across ranks] in model_sync.cpp).
std::vector<size_t> agree_first_order(Communicator& control, const std::vector<size_t>& order,
                                      const std::vector<std::string>& names);

}  // namespace decent_dp
