// Note [stream codecs]
// Lossless byte-stream compression of what a rank sends: ZstdCodec (libzstd, any dtype, a
// level) and FpzipCodec (libfpzip, float32 and float64, full precision: predictive coding
// of floating-point values). Peers decode the exact bits, so the exchange computes what it
// would without a codec; only the bytes on the wire change. A payload is
//
//   [uint64 used bytes, header included][uint64 format: 1 compressed, 0 raw][the stream]
//
// and only its used bytes cross the wire (Codec::varying_size, Note [varying all-gather]).
// When the compressed stream would not be smaller than the block, the block goes raw,
// so a payload never exceeds 16 bytes plus the block. The payload dtype is uint8.
//
// Parameters are hard to compress losslessly: float32 mantissas are close to random. On a
// trained CNN's parameters both codecs keep about 92% of the bytes (docs/data_parallel.md;
// build/bin/codec_bench --raw measures any block).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "decent_dp/exchange_stage.h"

namespace decent_dp {

class StreamCodec : public Codec {
 public:
  int64_t payload_numel(int64_t numel, c10::ScalarType dtype) const override;
  c10::ScalarType payload_dtype(c10::ScalarType dtype) const override;
  bool varying_size() const override { return true; }
  void encode(const at::Tensor& x, const at::Tensor& payload, const CodecContext& ctx) override;
  int64_t encode_prefix(const at::Tensor& x, const at::Tensor& payload,
                        const CodecContext& ctx) override;
  void decode(const at::Tensor& payload, const at::Tensor& out, const CodecContext& ctx) override;

  // Payload bytes of the last encode (header included), and of the raw block it stood for.
  int64_t last_encoded_bytes() const { return last_bytes_; }

 protected:
  static constexpr int64_t kHeaderBytes = 16;
  // Bytes the compressor may need at most for `bytes` input bytes (may exceed them).
  virtual int64_t bound(int64_t bytes, c10::ScalarType dtype) const = 0;
  // Compresses `bytes` at `in` into at most `capacity` bytes at `out`; returns the bytes
  // written, or 0 when they did not fit.
  virtual int64_t compress(const void* in, int64_t bytes, c10::ScalarType dtype, void* out,
                           int64_t capacity) = 0;
  // Decompresses `size` bytes at `in` into exactly `bytes` bytes at `out`; throws on a
  // corrupt stream.
  virtual void decompress(const void* in, int64_t size, c10::ScalarType dtype, void* out,
                          int64_t bytes) = 0;
  virtual void check_dtype(c10::ScalarType dtype) const;

 private:
  int64_t last_bytes_ = 0;
};

class ZstdCodec final : public StreamCodec {
 public:
  // level: zstd's, 1 (fastest) to 19 (ZSTD_maxCLevel() allowed too); negative levels are
  // zstd's fast modes.
  explicit ZstdCodec(int level = 1);
  ~ZstdCodec() override;
  std::string name() const override;
  int level() const { return level_; }

 protected:
  int64_t bound(int64_t bytes, c10::ScalarType dtype) const override;
  int64_t compress(const void* in, int64_t bytes, c10::ScalarType dtype, void* out,
                   int64_t capacity) override;
  void decompress(const void* in, int64_t size, c10::ScalarType dtype, void* out,
                  int64_t bytes) override;

 private:
  struct Contexts;
  int level_;
  std::unique_ptr<Contexts> contexts_;
};

class FpzipCodec final : public StreamCodec {
 public:
  FpzipCodec() = default;
  std::string name() const override { return "fpzip"; }

 protected:
  int64_t bound(int64_t bytes, c10::ScalarType dtype) const override;
  int64_t compress(const void* in, int64_t bytes, c10::ScalarType dtype, void* out,
                   int64_t capacity) override;
  void decompress(const void* in, int64_t size, c10::ScalarType dtype, void* out,
                  int64_t bytes) override;
  void check_dtype(c10::ScalarType dtype) const override;
};

}  // namespace decent_dp
