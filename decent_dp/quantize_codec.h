// Note [uniform asymmetric quantization]
// What a rank sends of a float32 block x of n elements, cut into chunks of `chunk` elements
// (the last one shorter): per chunk c its minimum lo_c and its step
//
//   s_c = (max_c - lo_c) / (2^bits - 1),
//
// and per element the code q_i = round((x_i - lo_c) / s_c), an integer in [0, 2^bits - 1]
// (8 bits: one byte; 4 bits: two codes per byte, element i in the low nibble of byte i / 2
// when i is even). The receiver reads x'_i = lo_c + q_i s_c, so |x_i - x'_i| <= s_c / 2 (up
// to float rounding); a constant chunk has s_c = 0 and comes back exactly. The payload is
// bytes: every chunk's (lo_c, s_c) as two floats, then the codes:
//
//   bytes(n) = 8 ceil(n / chunk) + n            (8 bits)
//            = 8 ceil(n / chunk) + ceil(n / 2)  (4 bits)
//
// 8 bits with chunks of 1024 send 25.2% of the float32 bytes, 4 bits 12.7%. NaN and Inf
// have no code: a chunk holding one is an InvalidArgument naming the bucket, the update and
// the element. Used as a Codec, the exchange never degrades a rank's own value (Note
// [exchange seam]): only what its peers receive is quantized. float16 and bfloat16 blocks
// are quantized through their exact float32 values (the same payload as for those values),
// and the receiver's x'_i is rounded to the block's dtype.
#pragma once

#include <cstdint>
#include <string>

#include "decent_dp/exchange_stage.h"

namespace decent_dp {

namespace quantize {

// Payload bytes of a block of `n` elements.
int64_t payload_bytes(int64_t n, int bits, int64_t chunk);
// Encodes x[0, n) into out[0, payload_bytes(n)). Returns the index of the first element
// that is NaN or infinite (nothing meaningful is written then), or -1.
int64_t encode(const float* x, int64_t n, int bits, int64_t chunk, uint8_t* out);
// Decodes a payload of `n` elements into out[0, n).
void decode(const uint8_t* payload, int64_t n, int bits, int64_t chunk, float* out);

}  // namespace quantize

class QuantizeCodec final : public Codec {
 public:
  // bits: 8 or 4; chunk: elements per (minimum, step) pair, >= 1.
  explicit QuantizeCodec(int bits = 8, int64_t chunk = 1024);
  std::string name() const override;
  int bits() const { return bits_; }
  int64_t chunk() const { return chunk_; }
  // Blocks must be float32, float16 or bfloat16 (anything else is an InvalidArgument naming
  // the dtype).
  int64_t payload_numel(int64_t numel, c10::ScalarType dtype) const override;
  c10::ScalarType payload_dtype(c10::ScalarType dtype) const override;
  void encode(const at::Tensor& x, const at::Tensor& payload, const CodecContext& ctx) override;
  void decode(const at::Tensor& payload, const at::Tensor& out, const CodecContext& ctx) override;

 private:
  // The float32 values of a float16 or bfloat16 block, kept between calls (it is the block's
  // size, and a codec runs every exchange; a codec serves one exchange at a time).
  float* float_values(int64_t n);

  int bits_;
  int64_t chunk_;
  at::Tensor values_;
};

}  // namespace decent_dp
