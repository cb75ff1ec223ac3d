#include "decent_dp/bucket.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "decent_dp/errors.h"
#include "decent_dp/optim/flat_layout.h"

namespace decent_dp {

int64_t align_numel(int64_t numel) {
  return (numel + kBucketAlignment - 1) / kBucketAlignment * kBucketAlignment;
}

std::vector<BucketSpec> plan_buckets(const std::vector<BucketEntry>& entries, int64_t cap_bytes) {
  DECENT_DP_CHECK_ARG(cap_bytes > 0, "bucket cap must be > 0 bytes, got ", cap_bytes);
  struct Open {
    BucketSpec spec;
    size_t first_position;
  };
  std::vector<BucketSpec> closed;
  std::map<std::pair<int, std::string>, Open> open;  // by (dtype, device)
  for (size_t pos = 0; pos < entries.size(); ++pos) {
    const BucketEntry& e = entries[pos];
    const auto key = std::make_pair(static_cast<int>(e.dtype), e.device.str());
    auto it = open.find(key);
    if (it == open.end()) {
      Open o;
      o.spec.dtype = e.dtype;
      o.spec.device = e.device;
      o.first_position = pos;
      it = open.emplace(key, std::move(o)).first;
    }
    BucketSpec& b = it->second.spec;
    b.params.push_back(e.index);
    b.offsets.push_back(b.numel);
    b.numel += align_numel(e.numel);
    if (b.bytes() >= cap_bytes) {
      closed.push_back(std::move(b));
      open.erase(it);
    }
  }
  std::vector<Open> rest;
  for (auto& kv : open) {
    rest.push_back(std::move(kv.second));
  }
  std::sort(rest.begin(), rest.end(),
            [](const Open& a, const Open& b) { return a.first_position < b.first_position; });
  for (auto& o : rest) {
    closed.push_back(std::move(o.spec));
  }
  return closed;
}

void zero_padding(const BucketSpec& spec, const BucketStorage& storage, const at::Tensor& block) {
  int64_t end = 0;
  for (size_t k = 0; k < storage.param_views.size(); ++k) {
    const int64_t offset = spec.offsets[k];
    if (offset > end) {
      block.narrow(0, end, offset - end).zero_();
    }
    end = std::max(end, offset + storage.param_views[k].numel());
  }
  if (end < block.numel()) {
    block.narrow(0, end, block.numel() - end).zero_();
  }
}

BucketStorage make_bucket_storage(const BucketSpec& spec, const std::vector<at::Tensor>& params,
                                  bool as_view, bool bind_grads, const BlockAllocator& allocate) {
  BucketStorage s;
  const auto options = at::TensorOptions().dtype(spec.dtype).device(spec.device);
  auto block = [&] {
    if (!allocate) {
      return at::zeros({spec.numel}, options);
    }
    at::Tensor t = allocate(spec.numel, options);
    DECENT_DP_CHECK_ARG(
        t.defined() && t.numel() == spec.numel && t.dim() == 1 && t.is_contiguous() &&
            t.scalar_type() == spec.dtype && t.device() == spec.device,
        "make_bucket_storage: the block allocator must return a contiguous 1-D "
        "tensor of ",
        spec.numel, " elements of ", c10::toString(spec.dtype), " on ", spec.device.str());
    t.zero_();  // Note [block padding]
    return t;
  };
  s.params = block();
  if (bind_grads) {
    s.grads = block();
  }
  s.comm = block();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const int64_t offset = spec.offsets[i];
    // Dense layouts (contiguous, channels-last, ...) keep their strides inside the block.
    auto view_of = [&](const at::Tensor& block) {
      if (p.is_non_overlapping_and_dense()) {
        return optim::view_like(block, p, offset);
      }
      return block.narrow(0, offset, p.numel()).view(p.sizes());
    };
    at::Tensor pv = view_of(s.params);
    at::Tensor gv = bind_grads ? view_of(s.grads) : at::Tensor();
    pv.copy_(p.detach());
    if (as_view) {
      const at::Tensor& g = p.grad();
      if (g.defined() && bind_grads) {
        gv.copy_(g);
      }
      at::Tensor mutable_p = p;
      mutable_p.set_data(pv);
      if (bind_grads) {
        mutable_p.mutable_grad() = gv;
      }
    }
    s.param_views.push_back(pv);
    s.grad_views.push_back(gv);
    s.comm_views.push_back(view_of(s.comm));
  }
  return s;
}

void swap_param_and_comm_blocks(BucketStorage& storage, const std::vector<at::Tensor>& rebind) {
  DECENT_DP_CHECK_ARG(rebind.size() == storage.param_views.size(),
                      "swap_param_and_comm_blocks: expected ", storage.param_views.size(),
                      " tensors to rebind, got ", rebind.size());
  std::swap(storage.params, storage.comm);
  std::swap(storage.param_views, storage.comm_views);
  for (size_t k = 0; k < rebind.size(); ++k) {
    at::Tensor t = rebind[k];
    t.set_data(storage.param_views[k]);
  }
}

std::string describe_bucket(size_t index, const BucketSpec& spec,
                            const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "bucket " << index << ": " << spec.params.size() << " params, "
     << static_cast<double>(spec.bytes()) / (1 << 20) << " MiB " << c10::toString(spec.dtype)
     << " on " << spec.device.str() << " (";
  for (size_t i = 0; i < spec.params.size(); ++i) {
    os << (i ? " " : "") << names[spec.params[i]];
  }
  os << ")";
  return os.str();
}

MixKind mix_kind(double coefficient) {
  if (std::abs(coefficient - 1.0) <= 1e-12) {
    return MixKind::kTarget;
  }
  return coefficient == 0.0 ? MixKind::kKeep : MixKind::kLerp;
}

double group_mean_coefficient(const topology::Group& group, double adaptive_factor) {
  const double k = group.size();
  return k > 1 ? adaptive_factor * ((1 - group.self_weight) * k / (k - 1)) : 0.0;
}

void mix_group_mean(BucketStorage& storage, const std::vector<at::Tensor>& rebind,
                    const topology::Group& group, double adaptive_factor) {
  const double coef = group_mean_coefficient(group, adaptive_factor);
  switch (mix_kind(coef)) {
    case MixKind::kTarget:
      swap_param_and_comm_blocks(storage, rebind);
      break;
    case MixKind::kLerp:
      storage.params.lerp_(storage.comm, coef);
      break;
    case MixKind::kKeep:
      break;
  }
}

}  // namespace decent_dp
