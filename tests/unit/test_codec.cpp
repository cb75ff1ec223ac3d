// Codecs against their definitions (Note [uniform asymmetric quantization]).
#include "torch_catch.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "decent_dp/quantize_codec.h"

using decent_dp::CodecContext;
using decent_dp::InvalidArgument;
using decent_dp::QuantizeCodec;

namespace {

at::Tensor round_trip(QuantizeCodec& codec, const at::Tensor& x) {
  at::Tensor payload =
      at::empty({codec.payload_numel(x.numel(), at::kFloat)}, at::TensorOptions(at::kByte));
  codec.encode(x, payload, CodecContext{0, 0, 0});
  at::Tensor out = at::empty_like(x);
  codec.decode(payload, out, CodecContext{0, 0, 1});
  return out;
}

// Per chunk: |x - q(x)| <= step / 2, up to float rounding of the chunk's values.
void check_bound(const at::Tensor& x, const at::Tensor& y, int bits, int64_t chunk) {
  const int64_t n = x.numel();
  const float* a = x.data_ptr<float>();
  const float* b = y.data_ptr<float>();
  const double levels = bits == 8 ? 255.0 : 15.0;
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t m = std::min(chunk, n - first);
    double lo = a[first], hi = a[first];
    for (int64_t i = 0; i < m; ++i) {
      lo = std::min<double>(lo, a[first + i]);
      hi = std::max<double>(hi, a[first + i]);
    }
    const double step = (hi - lo) / levels;
    const double slack =
        4 * std::numeric_limits<float>::epsilon() * std::max(std::abs(lo), std::abs(hi));
    for (int64_t i = 0; i < m; ++i) {
      const double err = std::abs(static_cast<double>(a[first + i]) - b[first + i]);
      INFO("element " << first + i << " of " << n << ", bits " << bits << ", chunk " << chunk);
      REQUIRE(err <= step / 2 + slack);
      REQUIRE(b[first + i] >= lo - slack);
      REQUIRE(b[first + i] <= hi + slack);
    }
  }
}

}  // namespace

TEST_CASE("quantization: payload sizes", "[codec]") {
  CHECK(decent_dp::quantize::payload_bytes(0, 8, 1024) == 0);
  CHECK(decent_dp::quantize::payload_bytes(1, 8, 1024) == 9);
  CHECK(decent_dp::quantize::payload_bytes(1024, 8, 1024) == 1032);
  CHECK(decent_dp::quantize::payload_bytes(1025, 8, 1024) == 1041);
  CHECK(decent_dp::quantize::payload_bytes(1025, 4, 1024) == 16 + 513);
  CHECK(decent_dp::quantize::payload_bytes(7, 4, 3) == 24 + 4);
  // 8 bits with chunks of 1024 send 25.2% of the float32 bytes.
  const double ratio = decent_dp::quantize::payload_bytes(1 << 20, 8, 1024) / (4.0 * (1 << 20));
  CHECK(ratio == Approx(0.251953125));
  CHECK(QuantizeCodec(4, 64).name() == "quantize(4 bit, chunk 64)");
  CHECK(QuantizeCodec().payload_dtype(at::kFloat) == at::kByte);
}

TEST_CASE("quantization: error within half a step per chunk, any length", "[codec]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  for (int bits : {8, 4}) {
    for (int64_t chunk : {1, 3, 64, 1024}) {
      for (int64_t n : {1, 2, 3, 63, 64, 65, 1000, 4097}) {
        QuantizeCodec codec(bits, chunk);
        // Mixed scales: chunks of small and large values.
        at::Tensor x = at::randn({n}, gen).mul_(at::linspace(1e-3, 1e3, n));
        check_bound(x, round_trip(codec, x), bits, chunk);
      }
    }
  }
}

TEST_CASE("quantization: constant chunks and the chunk extremes come back exactly", "[codec]") {
  for (int bits : {8, 4}) {
    QuantizeCodec codec(bits, 16);
    at::Tensor x = at::full({40}, 3.25f);
    x.narrow(0, 16, 16).fill_(-1e30f);  // a constant chunk of a huge value
    CHECK(round_trip(codec, x).equal(x));
    // The minimum of a chunk is sent as is; its maximum is lo + levels * step.
    at::Tensor y = at::tensor({-2.0f, 0.5f, 6.0f, 1.0f});
    at::Tensor back = round_trip(codec, y);
    CHECK(back[0].item<float>() == -2.0f);
    CHECK(back[2].item<float>() == Approx(6.0f).epsilon(1e-6));
  }
}

TEST_CASE("quantization: NaN and infinity are refused naming the element", "[codec]") {
  QuantizeCodec codec(8, 4);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    at::Tensor x = at::zeros({10});
    x[6] = bad;
    at::Tensor payload = at::empty({codec.payload_numel(10, at::kFloat)}, at::kByte);
    CHECK_THROWS_WITH(codec.encode(x, payload, CodecContext{2, 17, 1}),
                      Catch::Contains("bucket 2, update 17, rank 1: element 6 of the block is") &&
                          Catch::Contains("needs finite values"));
  }
}

TEST_CASE("quantization: bad settings, dtypes and buffers are refused", "[codec]") {
  CHECK_THROWS_WITH(QuantizeCodec(2, 64), Catch::Contains("bits must be 8 or 4, got 2"));
  CHECK_THROWS_WITH(QuantizeCodec(8, 0), Catch::Contains("chunk must be >= 1 element, got 0"));
  QuantizeCodec codec;
  CHECK_THROWS_WITH(codec.payload_numel(10, at::kDouble),
                    Catch::Contains("quantizes float32 blocks, got Double"));
  at::Tensor x = at::zeros({10});
  at::Tensor small = at::empty({5}, at::kByte);
  CHECK_THROWS_WITH(codec.encode(x, small, CodecContext{}),
                    Catch::Contains("the payload must be 18 contiguous bytes, got 5"));
  // An empty block has an empty payload.
  at::Tensor none = at::empty({0});
  at::Tensor empty_payload = at::empty({0}, at::kByte);
  codec.encode(none, empty_payload, CodecContext{});
  codec.decode(empty_payload, none, CodecContext{});
}
