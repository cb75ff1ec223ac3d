#include "decent_dp/compensated_codec.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/zeros_like.h>

#include <cstdio>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

std::string key_name(size_t bucket, int slot, int rank) {
  return detail::cat("bucket ", bucket, " slot ", slot, " rank ", rank);
}

}  // namespace

ErrorCompensatedCodec::ErrorCompensatedCodec(std::shared_ptr<Codec> inner)
    : inner_(std::move(inner)) {
  DECENT_DP_CHECK_ARG(inner_ != nullptr, "ErrorCompensatedCodec: inner must be a codec, got null");
  DECENT_DP_CHECK_ARG(!inner_->varying_size(), "ErrorCompensatedCodec: inner must be a lossy ",
                      "fixed-size codec (quantize), got the lossless ", inner_->name(),
                      ", which leaves no error to compensate");
}

std::string ErrorCompensatedCodec::name() const {
  return "error-compensated " + inner_->name();
}

int64_t ErrorCompensatedCodec::payload_numel(int64_t numel, c10::ScalarType dtype) const {
  return inner_->payload_numel(numel, dtype);
}

c10::ScalarType ErrorCompensatedCodec::payload_dtype(c10::ScalarType dtype) const {
  return inner_->payload_dtype(dtype);
}

at::Tensor& ErrorCompensatedCodec::estimate(const CodecContext& ctx, const at::Tensor& like) {
  at::Tensor& h = estimates_[Key{ctx.bucket, ctx.slot, ctx.rank}];
  if (!h.defined()) {
    h = at::zeros_like(like, at::MemoryFormat::Contiguous);
  }
  DECENT_DP_CHECK_ARG(h.numel() == like.numel() && h.scalar_type() == like.scalar_type(), name(),
                      ": the estimate of ", key_name(ctx.bucket, ctx.slot, ctx.rank), " holds ",
                      h.numel(), " x ", c10::toString(h.scalar_type()), ", the block is ",
                      like.numel(), " x ", c10::toString(like.scalar_type()));
  return h;
}

void ErrorCompensatedCodec::encode(const at::Tensor& x, const at::Tensor& payload,
                                   const CodecContext& ctx) {
  at::Tensor& h = estimate(ctx, x);
  if (!scratch_.defined() || scratch_.numel() < x.numel() ||
      scratch_.scalar_type() != x.scalar_type()) {
    scratch_ = at::empty_like(x, at::MemoryFormat::Contiguous);
  }
  at::Tensor change = scratch_.narrow(0, 0, x.numel()).view_as(x);
  at::sub_out(change, x, h);
  inner_->encode(change, payload, ctx);
  // What the receivers will add: the decoded change, not the exact one.
  inner_->decode(payload, change, ctx);
  h.add_(change);
}

void ErrorCompensatedCodec::decode(const at::Tensor& payload, const at::Tensor& out,
                                   const CodecContext& ctx) {
  at::Tensor& h = estimate(ctx, out);
  inner_->decode(payload, out, ctx);
  h.add_(out);
  out.copy_(h);
}

NamedTensors ErrorCompensatedCodec::state() const {
  NamedTensors out;
  out.reserve(estimates_.size());
  for (const auto& [key, h] : estimates_) {
    out.emplace_back(key_name(std::get<0>(key), std::get<1>(key), std::get<2>(key)), h);
  }
  return out;
}

void ErrorCompensatedCodec::load_state(const NamedTensors& state) {
  std::map<Key, at::Tensor> loaded;
  for (const auto& [label, h] : state) {
    size_t bucket = 0;
    int slot = 0, rank = 0, used = 0;
    const bool ok = std::sscanf(label.c_str(), "bucket %zu slot %d rank %d%n", &bucket, &slot,
                                &rank, &used) == 3 &&
                    static_cast<size_t>(used) == label.size();
    DECENT_DP_CHECK_ARG(ok, name(), ": load_state: entry '", label,
                        "' is not named 'bucket B slot S rank R'");
    DECENT_DP_CHECK_ARG(h.defined() && h.dim() == 1, name(), ": load_state: entry '", label,
                        "' must be a 1-D tensor");
    loaded[Key{bucket, slot, rank}] = h.clone();
  }
  estimates_ = std::move(loaded);
}

}  // namespace decent_dp
