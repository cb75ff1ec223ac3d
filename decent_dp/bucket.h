// Note [bucket plan]
// Parameters are grouped into buckets (spec §4): only parameters that receive gradients,
// grouped by (dtype, device) — a bucket never mixes them — walked in the order their
// gradients became ready in iteration 1. Each parameter takes align(numel) * element_size
// bytes, align rounding up to a multiple of kBucketAlignment elements; a bucket closes when
// its running total reaches the cap (the parameter that crosses the cap stays in it) or at
// the end. Buckets are numbered in the order they close, then the still-open ones in the
// order of their first parameter: gradients of the last layers arrive first, so those
// buckets communicate first.
//
// Each bucket owns three flat blocks of its dtype and device: parameters (every parameter
// becomes a view into it, dense layouts such as channels-last keep their strides),
// gradients (every .grad is a view into it) and communication. Padding stays zero.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {

constexpr int64_t kBucketAlignment = 32;  // elements

struct BucketEntry {
  size_t index;  // parameter index in the model's named_parameters() order
  int64_t numel;
  c10::ScalarType dtype;
  c10::Device device;
};

struct BucketSpec {
  std::vector<size_t> params;    // parameter indices, in gradient-ready order
  std::vector<int64_t> offsets;  // element offset of each parameter in the blocks
  int64_t numel = 0;             // elements of each block, padding included
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t bytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
};

int64_t align_numel(int64_t numel);

// The buckets of `entries` (in gradient-ready order) under `cap_bytes` (> 0).
std::vector<BucketSpec> plan_buckets(const std::vector<BucketEntry>& entries, int64_t cap_bytes);

// The three flat blocks of one bucket and the views of its parameters.
struct BucketStorage {
  at::Tensor params;  // flat parameter block
  at::Tensor grads;   // flat gradient block
  at::Tensor comm;    // flat communication block
  std::vector<at::Tensor> param_views;
  std::vector<at::Tensor> grad_views;
  std::vector<at::Tensor> comm_views;  // laid out like param_views
};

// Note [block padding]
// Parameters start at aligned offsets, so a block has gaps. The blocks are allocated zeroed
// and the gaps must stay zero: a codec encodes, and an aggregator reads, the whole block,
// so a gap holding a stale value changes the quantization range of its chunk, and a resumed
// run (fresh, zeroed blocks) would no longer match the run it resumes. The optimizers keep
// a zero gap zero (zero gradient there, decay of zero); the gather exchange zeroes x's gaps
// after mixing, since decoded rows need not be zero there.
void zero_padding(const BucketSpec& spec, const BucketStorage& storage, const at::Tensor& block);

// Allocates the blocks of `spec` and lays out views shaped and strided like `params`
// (the bucket's parameters, in spec order). With `as_view`, each parameter's data becomes
// its view (set_data) and its gradient the gradient view (an existing gradient is copied
// in); otherwise the parameters keep their storage and the caller copies in and out.
// With `bind_grads` false there is no gradient block and the gradients are left alone (the
// caller only needs the parameter and communication blocks).
// `allocate` (optional) makes the zero-filled blocks, e.g. Communicator::allocate so that
// they can be exchanged through shared memory.
using BlockAllocator = std::function<at::Tensor(int64_t numel, const at::TensorOptions& options)>;
BucketStorage make_bucket_storage(const BucketSpec& spec, const std::vector<at::Tensor>& params,
                                  bool as_view, bool bind_grads = true,
                                  const BlockAllocator& allocate = nullptr);

// Note [block swap]
// In decentralized mode the mixed parameters are x + c (A - x), A the group mean that the
// exchange wrote into the communication block. With c = 1 (adaptive factor 1 and uniform
// group weights) they are A itself, so instead of copying A over x the two blocks trade
// roles: the parameters' data are re-pointed at the communication block (set_data keeps
// each parameter's TensorImpl, so the module, autograd's accumulators and optimizer state
// keyed by the tensor are unaffected), and the old parameter block receives the next
// exchange. The fused optimizers keep their flat state across the swap (FlatCache).
//
// Exchanges the roles of the parameter and communication blocks, views included, and points
// the data of every tensor in `rebind` (the tensors whose data are the parameter views, in
// spec order) at the new parameter views. For when the new parameters are exactly the
// communication block's contents: no element is copied. Tensors that share a TensorImpl with
// `rebind` (the module's parameters, an optimizer's references) follow; gradients stay.
void swap_param_and_comm_blocks(BucketStorage& storage, const std::vector<at::Tensor>& rebind);

// Every mixing is one step x <- x + c (target - x): with c within 1e-12 of 1, x becomes the
// target exactly (kTarget); with c = 0 it stays (kKeep); otherwise one lerp (kLerp).
enum class MixKind { kKeep, kTarget, kLerp };
MixKind mix_kind(double coefficient);

// The coefficient c of mix_group_mean (below): a (1 - w) k / (k - 1), 0 for k = 1.
double group_mean_coefficient(const topology::Group& group, double adaptive_factor);

// Applies a finished gossip exchange (spec §2): the communication block holds the mean A of
// the k members of `group`, the parameter block this rank's x. With self weight w,
// mix(x) = w x + (1-w)/(k-1) (k A - x), and x <- (1-a) x + a mix(x), which is one pass
// x <- x + a (1-w) k/(k-1) (A - x). When that coefficient is 1 (a = 1 and w = 1/k: every
// built-in topology) the blocks trade roles instead (Note [block swap]; `rebind` as for
// swap_param_and_comm_blocks). Shared by both gossip APIs, so they train identically.
void mix_group_mean(BucketStorage& storage, const std::vector<at::Tensor>& rebind,
                    const topology::Group& group, double adaptive_factor);

// Summary for logs: "bucket 0: 3 params, 1.25 MiB (fc2.weight fc2.bias fc1.bias)".
std::string describe_bucket(size_t index, const BucketSpec& spec,
                            const std::vector<std::string>& names);

}  // namespace decent_dp
