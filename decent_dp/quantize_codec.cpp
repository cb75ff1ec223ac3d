#include "decent_dp/quantize_codec.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "decent_dp/detail/multiversion.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace quantize {
namespace {

constexpr uint32_t kExponent = 0x7f800000u;  // all ones: NaN or infinity

// Minimum, maximum and whether any element is NaN or infinite, in one pass. Sixteen
// independent lanes written out, so the compiler keeps them in vector registers (an `omp
// simd` min/max reduction measured 3-4x slower here: one dependent accumulator).
DECENT_DP_MULTIVERSION void range_of(const float* v, int64_t m, float& lo_out, float& hi_out,
                                     bool& bad) {
  constexpr int kLanes = 16;
  float lo[kLanes], hi[kLanes];
  uint32_t worst[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    lo[l] = v[0];
    hi[l] = v[0];
    worst[l] = 0;
  }
  auto take = [&](int l, float t) {
    uint32_t bits;
    std::memcpy(&bits, &t, sizeof bits);
    bits &= kExponent;
    lo[l] = t < lo[l] ? t : lo[l];
    hi[l] = t > hi[l] ? t : hi[l];
    worst[l] = bits > worst[l] ? bits : worst[l];
  };
  int64_t i = 0;
  for (; i + kLanes <= m; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      take(l, v[i + l]);
    }
  }
  for (int l = 0; i < m; ++i, ++l) {
    take(l, v[i]);
  }
  float a = lo[0], z = hi[0];
  uint32_t w = worst[0];
  for (int l = 1; l < kLanes; ++l) {
    a = lo[l] < a ? lo[l] : a;
    z = hi[l] > z ? hi[l] : z;
    w = worst[l] > w ? worst[l] : w;
  }
  lo_out = a;
  hi_out = z;
  bad = w == kExponent;
}

DECENT_DP_MULTIVERSION void codes8(const float* v, int64_t m, float lo, float inv, uint8_t* out) {
  const float top = 255.0f;
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) {
    // v >= lo, so truncating t + 0.5 rounds to nearest.
    const float t = std::min((v[i] - lo) * inv + 0.5f, top);
    out[i] = static_cast<uint8_t>(static_cast<int32_t>(t));
  }
}

DECENT_DP_MULTIVERSION void values8(const uint8_t* q, int64_t m, float lo, float scale,
                                    float* out) {
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) {
    out[i] = lo + static_cast<float>(q[i]) * scale;
  }
}

uint8_t code4(float v, float lo, float inv) {
  return static_cast<uint8_t>(static_cast<int32_t>(std::min((v - lo) * inv + 0.5f, 15.0f)));
}

// Element g of the block in nibble g % 2 of byte g / 2.
void codes4(const float* v, int64_t m, int64_t first, float lo, float inv, uint8_t* codes) {
  int64_t i = 0;
  if (first % 2 == 1 && m > 0) {  // the high nibble of a byte the previous chunk began
    codes[first / 2] =
        static_cast<uint8_t>((codes[first / 2] & 0x0f) | (code4(v[0], lo, inv) << 4));
    i = 1;
  }
  for (; i + 1 < m; i += 2) {
    codes[(first + i) / 2] =
        static_cast<uint8_t>(code4(v[i], lo, inv) | (code4(v[i + 1], lo, inv) << 4));
  }
  if (i < m) {  // a low nibble; the next chunk writes the high one (or it stays 0)
    codes[(first + i) / 2] = code4(v[i], lo, inv);
  }
}

void values4(const uint8_t* codes, int64_t m, int64_t first, float lo, float scale, float* out) {
  int64_t i = 0;
  if (first % 2 == 1 && m > 0) {
    out[0] = lo + static_cast<float>(codes[first / 2] >> 4) * scale;
    i = 1;
  }
  const uint8_t* pairs = codes + (first + i) / 2;
  const int64_t count = (m - i) / 2;
  float* o = out + i;
  for (int64_t p = 0; p < count; ++p) {
    o[2 * p] = lo + static_cast<float>(pairs[p] & 0x0f) * scale;
    o[2 * p + 1] = lo + static_cast<float>(pairs[p] >> 4) * scale;
  }
  i += 2 * count;
  if (i < m) {
    out[i] = lo + static_cast<float>(codes[(first + i) / 2] & 0x0f) * scale;
  }
}

void check_layout(int bits, int64_t chunk) {
  DECENT_DP_CHECK_ARG(bits == 8 || bits == 4, "quantize: bits must be 8 or 4, got ", bits);
  DECENT_DP_CHECK_ARG(chunk >= 1, "quantize: chunk must be >= 1 element, got ", chunk);
}

}  // namespace

int64_t payload_bytes(int64_t n, int bits, int64_t chunk) {
  check_layout(bits, chunk);
  DECENT_DP_CHECK_ARG(n >= 0, "quantize: the block size must be >= 0, got ", n);
  const int64_t chunks = (n + chunk - 1) / chunk;
  return 8 * chunks + (bits == 8 ? n : (n + 1) / 2);
}

int64_t encode(const float* x, int64_t n, int bits, int64_t chunk, uint8_t* out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  uint8_t* codes = out + 8 * chunks;
  const double levels = bits == 8 ? 255.0 : 15.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * chunk;
    const int64_t m = std::min(chunk, n - first);
    const float* v = x + first;
    float lo = 0.0f, hi = 0.0f;
    bool bad = false;
    range_of(v, m, lo, hi, bad);
    if (bad) {
      for (int64_t i = 0; i < m; ++i) {
        if (!std::isfinite(v[i])) {
          return first + i;
        }
      }
    }
    // The step in double, so a range near the float limit does not overflow.
    const double range = static_cast<double>(hi) - static_cast<double>(lo);
    const auto scale = static_cast<float>(range / levels);
    const float inv = range > 0.0 ? static_cast<float>(levels / range) : 0.0f;
    const float header[2] = {lo, scale};
    std::memcpy(out + 8 * c, header, sizeof header);
    if (bits == 8) {
      codes8(v, m, lo, inv, codes + first);
    } else {
      codes4(v, m, first, lo, inv, codes);
    }
  }
  return -1;
}

void decode(const uint8_t* payload, int64_t n, int bits, int64_t chunk, float* out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const uint8_t* codes = payload + 8 * chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * chunk;
    const int64_t m = std::min(chunk, n - first);
    float header[2];
    std::memcpy(header, payload + 8 * c, sizeof header);
    if (bits == 8) {
      values8(codes + first, m, header[0], header[1], out + first);
    } else {
      values4(codes, m, first, header[0], header[1], out + first);
    }
  }
}

}  // namespace quantize

QuantizeCodec::QuantizeCodec(int bits, int64_t chunk) : bits_(bits), chunk_(chunk) {
  DECENT_DP_CHECK_ARG(bits == 8 || bits == 4, "QuantizeCodec: bits must be 8 or 4, got ", bits);
  DECENT_DP_CHECK_ARG(chunk >= 1, "QuantizeCodec: chunk must be >= 1 element, got ", chunk);
}

std::string QuantizeCodec::name() const {
  return detail::cat("quantize(", bits_, " bit, chunk ", chunk_, ")");
}

namespace {

// float16 and bfloat16 blocks are quantized through their (exact) float32 values.
bool quantizable(c10::ScalarType dtype) {
  return dtype == c10::kFloat || dtype == c10::kHalf || dtype == c10::kBFloat16;
}

}  // namespace

int64_t QuantizeCodec::payload_numel(int64_t numel, c10::ScalarType dtype) const {
  DECENT_DP_CHECK_ARG(quantizable(dtype), name(),
                      ": quantizes float32, float16 and bfloat16 blocks, got ",
                      c10::toString(dtype));
  return quantize::payload_bytes(numel, bits_, chunk_);
}

c10::ScalarType QuantizeCodec::payload_dtype(c10::ScalarType /*dtype*/) const {
  return c10::kByte;
}

void QuantizeCodec::encode(const at::Tensor& x, const at::Tensor& payload,
                           const CodecContext& ctx) {
  const int64_t n = x.numel();
  DECENT_DP_CHECK_ARG(quantizable(x.scalar_type()) && x.is_contiguous(), name(),
                      ": x must be a contiguous float32, float16 or bfloat16 block, got ",
                      c10::toString(x.scalar_type()));
  DECENT_DP_CHECK_ARG(payload.scalar_type() == c10::kByte && payload.is_contiguous() &&
                          payload.numel() == quantize::payload_bytes(n, bits_, chunk_),
                      name(), ": the payload must be ", quantize::payload_bytes(n, bits_, chunk_),
                      " contiguous bytes, got ", payload.numel(), " of ",
                      c10::toString(payload.scalar_type()));
  if (n == 0) {
    return;
  }
  const float* values = nullptr;
  if (x.scalar_type() == c10::kFloat) {
    values = x.const_data_ptr<float>();
  } else {
    values = float_values(n);
    values_.narrow(0, 0, n).copy_(x.reshape({-1}));
  }
  const int64_t bad =
      quantize::encode(values, n, bits_, chunk_, payload.mutable_data_ptr<uint8_t>());
  if (bad >= 0) {
    throw InvalidArgument(
        detail::cat(name(), ": bucket ", ctx.bucket, ", update ", ctx.update, ", rank ", ctx.rank,
                    ": element ", bad, " of the block is ", values[bad],
                    "; quantization needs finite values (did training diverge?)"));
  }
}

float* QuantizeCodec::float_values(int64_t n) {
  if (!values_.defined() || values_.numel() < n) {
    values_ = at::empty({n}, at::TensorOptions().dtype(c10::kFloat));
  }
  return values_.mutable_data_ptr<float>();
}

void QuantizeCodec::decode(const at::Tensor& payload, const at::Tensor& out,
                           const CodecContext& /*ctx*/) {
  const int64_t n = out.numel();
  DECENT_DP_CHECK_ARG(quantizable(out.scalar_type()) && out.is_contiguous(), name(),
                      ": out must be a contiguous float32, float16 or bfloat16 block, got ",
                      c10::toString(out.scalar_type()));
  DECENT_DP_CHECK_ARG(payload.numel() == quantize::payload_bytes(n, bits_, chunk_), name(),
                      ": the payload must be ", quantize::payload_bytes(n, bits_, chunk_),
                      " bytes for ", n, " elements, got ", payload.numel());
  if (n == 0) {
    return;
  }
  if (out.scalar_type() == c10::kFloat) {
    quantize::decode(payload.const_data_ptr<uint8_t>(), n, bits_, chunk_,
                     out.mutable_data_ptr<float>());
    return;
  }
  quantize::decode(payload.const_data_ptr<uint8_t>(), n, bits_, chunk_, float_values(n));
  out.copy_(values_.narrow(0, 0, n).view_as(out));  // rounded to the block's dtype
}

}  // namespace decent_dp
