#include "decent_dp/stream_codec.h"

#include <ATen/core/Tensor.h>
#include <fpzip.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

constexpr uint64_t kRaw = 0;
constexpr uint64_t kCompressed = 1;

void put_u64(void* at, uint64_t v) {
  std::memcpy(at, &v, sizeof v);
}

uint64_t get_u64(const void* at) {
  uint64_t v = 0;
  std::memcpy(&v, at, sizeof v);
  return v;
}

}  // namespace

// ---- StreamCodec ----

void StreamCodec::check_dtype(c10::ScalarType /*dtype*/) const {}

int64_t StreamCodec::payload_numel(int64_t numel, c10::ScalarType dtype) const {
  check_dtype(dtype);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return kHeaderBytes + std::max(bytes, bound(bytes, dtype));
}

c10::ScalarType StreamCodec::payload_dtype(c10::ScalarType dtype) const {
  check_dtype(dtype);
  return at::kByte;
}

void StreamCodec::encode(const at::Tensor& x, const at::Tensor& payload, const CodecContext& ctx) {
  encode_prefix(x, payload, ctx);
}

int64_t StreamCodec::encode_prefix(const at::Tensor& x, const at::Tensor& payload,
                                   const CodecContext& ctx) {
  check_dtype(x.scalar_type());
  DECENT_DP_CHECK_ARG(x.is_contiguous() && x.device().is_cpu(), name(),
                      ": expected a contiguous CPU block, bucket ", ctx.bucket);
  const int64_t bytes = static_cast<int64_t>(x.nbytes());
  const int64_t capacity = payload.numel() - kHeaderBytes;
  DECENT_DP_CHECK_ARG(
      payload.scalar_type() == at::kByte && payload.is_contiguous() && capacity >= bytes, name(),
      ": the payload must be ", payload_numel(x.numel(), x.scalar_type()),
      " contiguous bytes, got ", payload.numel(), " x ", payload.scalar_type());
  auto* out = static_cast<uint8_t*>(payload.data_ptr());
  int64_t used =
      bytes == 0 ? 0 : compress(x.data_ptr(), bytes, x.scalar_type(), out + kHeaderBytes, capacity);
  uint64_t format = kCompressed;
  if (used == 0 || used >= bytes) {  // no gain: the block itself
    if (bytes > 0) {
      std::memcpy(out + kHeaderBytes, x.data_ptr(), static_cast<size_t>(bytes));
    }
    used = bytes;
    format = kRaw;
  }
  put_u64(out, static_cast<uint64_t>(kHeaderBytes + used));
  put_u64(out + 8, format);
  last_bytes_ = kHeaderBytes + used;
  return last_bytes_;
}

void StreamCodec::decode(const at::Tensor& payload, const at::Tensor& out,
                         const CodecContext& ctx) {
  check_dtype(out.scalar_type());
  DECENT_DP_CHECK_ARG(out.is_contiguous(), name(), ": expected a contiguous output block");
  const int64_t have = payload.numel();
  const auto* in = static_cast<const uint8_t*>(payload.data_ptr());
  const int64_t bytes = static_cast<int64_t>(out.nbytes());
  if (have < kHeaderBytes) {
    throw CommError(detail::cat(name(), ": the payload of rank ", ctx.rank, " for bucket ",
                                ctx.bucket, ", update ", ctx.update, " has ", have,
                                " bytes, less than its header"));
  }
  const uint64_t used = get_u64(in);
  const uint64_t format = get_u64(in + 8);
  const bool raw = format == kRaw;
  if (used < kHeaderBytes || static_cast<int64_t>(used) > have ||
      (format != kRaw && format != kCompressed) ||
      (raw && static_cast<int64_t>(used) != kHeaderBytes + bytes)) {
    throw CommError(detail::cat(name(), ": the payload of rank ", ctx.rank, " for bucket ",
                                ctx.bucket, ", update ", ctx.update, " is corrupt (header: ", used,
                                " bytes, format ", format, "; ", have,
                                " bytes received, a block of ", bytes, " bytes expected)"));
  }
  if (raw) {
    if (bytes > 0) {
      std::memcpy(out.data_ptr(), in + kHeaderBytes, static_cast<size_t>(bytes));
    }
    return;
  }
  decompress(in + kHeaderBytes, static_cast<int64_t>(used) - kHeaderBytes, out.scalar_type(),
             out.data_ptr(), bytes);
}

// ---- ZstdCodec ----

struct ZstdCodec::Contexts {
  std::mutex mu;
  ZSTD_CCtx* c = nullptr;
  ZSTD_DCtx* d = nullptr;
  ~Contexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};

ZstdCodec::ZstdCodec(int level) : level_(level), contexts_(std::make_unique<Contexts>()) {
  DECENT_DP_CHECK_ARG(level >= ZSTD_minCLevel() && level <= ZSTD_maxCLevel() && level != 0,
                      "ZstdCodec: level must be in [", ZSTD_minCLevel(), ", -1] or [1, ",
                      ZSTD_maxCLevel(), "], got ", level);
  contexts_->c = ZSTD_createCCtx();
  contexts_->d = ZSTD_createDCtx();
  if (contexts_->c == nullptr || contexts_->d == nullptr) {
    throw std::bad_alloc();
  }
}

ZstdCodec::~ZstdCodec() = default;

std::string ZstdCodec::name() const {
  return detail::cat("zstd(level ", level_, ")");
}

int64_t ZstdCodec::bound(int64_t bytes, c10::ScalarType /*dtype*/) const {
  return static_cast<int64_t>(ZSTD_compressBound(static_cast<size_t>(bytes)));
}

int64_t ZstdCodec::compress(const void* in, int64_t bytes, c10::ScalarType /*dtype*/, void* out,
                            int64_t capacity) {
  std::lock_guard<std::mutex> lock(contexts_->mu);
  const size_t r = ZSTD_compressCCtx(contexts_->c, out, static_cast<size_t>(capacity), in,
                                     static_cast<size_t>(bytes), level_);
  return ZSTD_isError(r) ? 0 : static_cast<int64_t>(r);
}

void ZstdCodec::decompress(const void* in, int64_t size, c10::ScalarType /*dtype*/, void* out,
                           int64_t bytes) {
  std::lock_guard<std::mutex> lock(contexts_->mu);
  const size_t r = ZSTD_decompressDCtx(contexts_->d, out, static_cast<size_t>(bytes), in,
                                       static_cast<size_t>(size));
  if (ZSTD_isError(r) || static_cast<int64_t>(r) != bytes) {
    throw CommError(detail::cat(name(), ": a corrupt stream (", size, " bytes): ",
                                ZSTD_isError(r) ? ZSTD_getErrorName(r) : "wrong length", "; ",
                                bytes, " bytes expected"));
  }
}

// ---- FpzipCodec ----
// The stream is a sequence of pieces [uint64 bytes][fpzip stream of up to kPiece values]:
// fpzip counts values in int.

namespace {
constexpr int64_t kPiece = int64_t{1} << 28;
}  // namespace

void FpzipCodec::check_dtype(c10::ScalarType dtype) const {
  DECENT_DP_CHECK_ARG(dtype == at::kFloat || dtype == at::kDouble,
                      "FpzipCodec: blocks must be float32 or float64, got ", dtype);
}

int64_t FpzipCodec::bound(int64_t bytes, c10::ScalarType dtype) const {
  const int64_t values = bytes / static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t pieces = std::max<int64_t>(1, (values + kPiece - 1) / kPiece);
  return bytes + bytes / 8 + pieces * (8 + 1024);
}

int64_t FpzipCodec::compress(const void* in, int64_t bytes, c10::ScalarType dtype, void* out,
                             int64_t capacity) {
  const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t values = bytes / elem;
  auto* o = static_cast<uint8_t*>(out);
  int64_t written = 0;
  for (int64_t first = 0; first < values; first += kPiece) {
    const int64_t count = std::min(kPiece, values - first);
    if (capacity - written < 8 + 64) {
      return 0;
    }
    FPZ* fpz = fpzip_write_to_buffer(o + written + 8, static_cast<size_t>(capacity - written - 8));
    if (fpz == nullptr) {
      return 0;
    }
    fpz->type = dtype == at::kFloat ? FPZIP_TYPE_FLOAT : FPZIP_TYPE_DOUBLE;
    fpz->prec = 0;  // lossless
    fpz->nx = static_cast<int>(count);
    fpz->ny = fpz->nz = fpz->nf = 1;
    const size_t n = fpzip_write(fpz, static_cast<const uint8_t*>(in) + first * elem);
    fpzip_write_close(fpz);
    if (n == 0) {
      return 0;
    }
    put_u64(o + written, n);
    written += 8 + static_cast<int64_t>(n);
  }
  return written;
}

void FpzipCodec::decompress(const void* in, int64_t size, c10::ScalarType dtype, void* out,
                            int64_t bytes) {
  const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t values = bytes / elem;
  const auto* p = static_cast<const uint8_t*>(in);
  int64_t read = 0;
  for (int64_t first = 0; first < values; first += kPiece) {
    const int64_t count = std::min(kPiece, values - first);
    const uint64_t n = read + 8 <= size ? get_u64(p + read) : 0;
    if (n == 0 || n > static_cast<uint64_t>(std::max<int64_t>(0, size - read - 8))) {
      throw CommError(detail::cat("fpzip: a corrupt stream (", size, " bytes, a piece of ", n,
                                  " bytes at ", read, ")"));
    }
    FPZ* fpz = fpzip_read_from_buffer(p + read + 8);
    if (fpz == nullptr) {
      throw CommError("fpzip: cannot open a stream");
    }
    fpz->type = dtype == at::kFloat ? FPZIP_TYPE_FLOAT : FPZIP_TYPE_DOUBLE;
    fpz->prec = 0;
    fpz->nx = static_cast<int>(count);
    fpz->ny = fpz->nz = fpz->nf = 1;
    const size_t got = fpzip_read(fpz, static_cast<uint8_t*>(out) + first * elem);
    fpzip_read_close(fpz);
    if (got == 0 || got > n) {
      throw CommError(detail::cat("fpzip: a corrupt stream (piece at ", read, ": ", n,
                                  " bytes, read ", got, ")"));
    }
    read += 8 + static_cast<int64_t>(n);
  }
}

}  // namespace decent_dp
