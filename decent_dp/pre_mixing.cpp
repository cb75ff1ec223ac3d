#include "decent_dp/pre_mixing.h"

#include "decent_dp/bucket.h"
#include "decent_dp/errors.h"
#include "decent_dp/optim/flat_layout.h"

namespace decent_dp {

at::Tensor MixingContext::mixed() const {
  // The same arithmetic as the wrapper's mixing (mix_group_mean, the gather exchange).
  switch (mix_kind(coefficient)) {
    case MixKind::kTarget:
      return received.clone();
    case MixKind::kKeep:
      return params.clone();
    case MixKind::kLerp:
      break;
  }
  return params.lerp(received, coefficient);
}

std::vector<at::Tensor> MixingContext::views(const at::Tensor& flat) const {
  DECENT_DP_CHECK_ARG(tensors != nullptr, "MixingContext::views: the context has no tensors");
  DECENT_DP_CHECK_ARG(flat.dim() == 1 && flat.numel() == params.numel() &&
                          flat.scalar_type() == params.scalar_type() &&
                          flat.device() == params.device(),
                      "MixingContext::views: flat must be a 1-D tensor of ", params.numel(),
                      " elements of ", c10::toString(params.scalar_type()), " on ",
                      params.device().str(), " (laid out like params), got ", flat.sizes(), " ",
                      c10::toString(flat.scalar_type()), " on ", flat.device().str());
  DECENT_DP_CHECK_ARG(flat.stride(0) == 1, "MixingContext::views: flat must be contiguous");
  std::vector<at::Tensor> out;
  out.reserve(tensors->size());
  for (const at::Tensor& t : *tensors) {
    // Every tensor's data is its view of the parameter block (Note [parameter binding]).
    const int64_t offset = t.storage_offset() - params.storage_offset();
    out.push_back(optim::view_like(flat, t, offset));
  }
  return out;
}

}  // namespace decent_dp
