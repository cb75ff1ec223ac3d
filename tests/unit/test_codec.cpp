// Codecs against their definitions (Note [uniform asymmetric quantization]).
#include "torch_catch.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "decent_dp/compensated_codec.h"
#include "decent_dp/quantize_codec.h"
#include "decent_dp/stream_codec.h"

using decent_dp::CodecContext;
using decent_dp::ErrorCompensatedCodec;
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

TEST_CASE("quantization: float16 and bfloat16 blocks travel as their float32 values", "[codec]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    for (int bits : {8, 4}) {
      INFO(dtype << ", " << bits << " bits");
      QuantizeCodec codec(bits, 64);
      const at::Tensor x = at::randn({1000}, gen).to(dtype);
      const at::Tensor exact = x.to(at::kFloat);
      const int64_t bytes = codec.payload_numel(1000, dtype);
      CHECK(bytes == codec.payload_numel(1000, at::kFloat));
      at::Tensor payload = at::empty({bytes}, at::kByte);
      at::Tensor reference = at::empty({bytes}, at::kByte);
      codec.encode(x, payload, CodecContext{});
      codec.encode(exact, reference, CodecContext{});
      CHECK(payload.equal(reference));
      at::Tensor out = at::empty_like(x);
      codec.decode(payload, out, CodecContext{});
      at::Tensor out_float = at::empty({1000});
      codec.decode(reference, out_float, CodecContext{});
      CHECK(out.scalar_type() == dtype);
      CHECK(out.equal(out_float.to(dtype)));
      // Within half a step per chunk plus the dtype's rounding.
      const double eps = dtype == at::kHalf ? 1.0 / 1024 : 1.0 / 128;
      check_bound(exact, out_float, bits, 64);
      CHECK((out.to(at::kFloat) - out_float).abs().max().item<double>() <=
            eps * out_float.abs().max().item<double>());
    }
  }
  // NaN in a low-precision block is named like in float32.
  QuantizeCodec codec(8, 4);
  at::Tensor x = at::zeros({10}, at::kBFloat16);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  at::Tensor payload = at::empty({codec.payload_numel(10, at::kBFloat16)}, at::kByte);
  CHECK_THROWS_WITH(codec.encode(x, payload, CodecContext{1, 2, 0}),
                    Catch::Contains("element 3 of the block is nan"));
}

TEST_CASE("quantization: bad settings, dtypes and buffers are refused", "[codec]") {
  CHECK_THROWS_WITH(QuantizeCodec(2, 64), Catch::Contains("bits must be 8 or 4, got 2"));
  CHECK_THROWS_WITH(QuantizeCodec(8, 0), Catch::Contains("chunk must be >= 1 element, got 0"));
  QuantizeCodec codec;
  CHECK_THROWS_WITH(codec.payload_numel(10, at::kDouble),
                    Catch::Contains("quantizes float32, float16 and bfloat16 blocks, got Double"));
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

namespace {

std::shared_ptr<ErrorCompensatedCodec> compensated(int bits) {
  return std::make_shared<ErrorCompensatedCodec>(std::make_shared<QuantizeCodec>(bits, 64));
}

// One exchange of x from `sender` (rank 0) to `receiver`: what the receiver reads.
at::Tensor send(ErrorCompensatedCodec& sender, ErrorCompensatedCodec& receiver, const at::Tensor& x,
                int slot = 0, size_t bucket = 0) {
  at::Tensor payload =
      at::empty({sender.payload_numel(x.numel(), at::kFloat)}, at::TensorOptions(at::kByte));
  sender.encode(x, payload, CodecContext{bucket, 0, 0, slot});
  at::Tensor out = at::empty_like(x);
  receiver.decode(payload, out, CodecContext{bucket, 0, 0, slot});
  return out;
}

}  // namespace

TEST_CASE(
    "error compensation: the estimate converges on a steady block, the sender's is the "
    "receiver's bit for bit",
    "[codec][compensated]") {
  for (int bits : {8, 4}) {
    INFO("bits " << bits);
    torch::manual_seed(3);
    auto sender = compensated(bits);
    auto receiver = compensated(bits);
    const at::Tensor x = torch::randn({1000});
    QuantizeCodec plain(bits, 64);
    const double plain_error = (round_trip(plain, x) - x).abs().max().item<double>();
    double error = 0;
    for (int t = 0; t < 6; ++t) {
      const at::Tensor got = send(*sender, *receiver, x);
      error = (got - x).abs().max().item<double>();
      if (t == 0) {
        CHECK(error == plain_error);  // the first exchange codes x itself
      }
      // What the receiver reads is the sender's own estimate.
      REQUIRE(sender->state().size() == 1);
      CHECK(torch::equal(sender->state()[0].second, got));
    }
    // Each exchange codes the remaining error: it shrinks by about the number of levels.
    CHECK(error < plain_error * 1e-3);
  }
}

TEST_CASE("error compensation: float16 and bfloat16 blocks converge to the block",
          "[codec][compensated]") {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    INFO(dtype);
    torch::manual_seed(3);
    auto sender = compensated(4);
    auto receiver = compensated(4);
    const at::Tensor x = torch::randn({1000}).to(dtype);
    QuantizeCodec plain(4, 64);
    at::Tensor got = send(*sender, *receiver, x);
    CHECK(torch::equal(got, round_trip(plain, x.to(at::kFloat)).to(dtype)));  // x itself coded
    for (int t = 0; t < 8; ++t) {
      got = send(*sender, *receiver, x);
    }
    REQUIRE(sender->state().size() == 1);
    CHECK(torch::equal(receiver->state()[0].second, sender->state()[0].second));
    CHECK(got.scalar_type() == dtype);
    CHECK(torch::equal(got, x));  // converged to the block's own values
  }
}

TEST_CASE("error compensation: a drifting block stays within one code of its change",
          "[codec][compensated]") {
  torch::manual_seed(4);
  auto sender = compensated(4);
  auto receiver = compensated(4);
  at::Tensor x = torch::randn({517});
  send(*sender, *receiver, x);
  for (int t = 0; t < 20; ++t) {
    const at::Tensor step = 1e-3 * torch::randn({517});
    x = x + step;
    const at::Tensor got = send(*sender, *receiver, x);
    // Once the first code's error is worked off (it shrinks by about the 15 levels per
    // exchange), the coded change is a few steps of drift wide: the error stays a small
    // fraction of the plain code's (about 0.3 on this block).
    if (t >= 2) {
      CHECK((got - x).abs().max().item<double>() < 1e-3);
    }
  }
}

TEST_CASE("error compensation: estimates per bucket, slot and rank; state round trip",
          "[codec][compensated]") {
  auto sender = compensated(8);
  auto receiver = compensated(8);
  const at::Tensor a = torch::linspace(-1, 1, 300);
  const at::Tensor b = torch::linspace(5, 9, 300);
  send(*sender, *receiver, a, /*slot=*/0);
  send(*sender, *receiver, b, /*slot=*/1);
  send(*sender, *receiver, b, /*slot=*/0, /*bucket=*/2);
  CHECK(sender->estimates() == 3);
  CHECK(receiver->estimates() == 3);
  // A codec restored from the state decodes the next payload as the original does.
  auto restored = compensated(8);
  restored->load_state(receiver->state());
  const at::Tensor next = a + 0.01;
  at::Tensor payload =
      at::empty({sender->payload_numel(300, at::kFloat)}, at::TensorOptions(at::kByte));
  sender->encode(next, payload, CodecContext{0, 1, 0, 0});
  at::Tensor x1 = at::empty({300});
  at::Tensor x2 = at::empty({300});
  receiver->decode(payload, x1, CodecContext{0, 1, 0, 0});
  restored->decode(payload, x2, CodecContext{0, 1, 0, 0});
  CHECK(torch::equal(x1, x2));
  CHECK(sender->name() == "error-compensated quantize(8 bit, chunk 64)");
}

TEST_CASE("error compensation: bad inner codecs, states and blocks are refused",
          "[codec][compensated]") {
  CHECK_THROWS_WITH(ErrorCompensatedCodec(nullptr), Catch::Contains("inner"));
  auto codec = compensated(8);
  CHECK_THROWS_WITH(codec->load_state({{"slot 1", torch::zeros({3})}}),
                    Catch::Contains("'slot 1' is not named"));
  CHECK_THROWS_WITH(codec->load_state({{"bucket 0 slot 0 rank 1", torch::zeros({2, 2})}}),
                    Catch::Contains("1-D"));
  auto receiver = compensated(8);
  send(*codec, *receiver, torch::ones({10}));
  // The same bucket, slot and rank with another size: a different model.
  CHECK_THROWS_WITH(send(*codec, *receiver, torch::ones({11})),
                    Catch::Contains("holds 10 x Float"));
  // Non-finite changes are refused by the inner codec, naming the element.
  at::Tensor bad = torch::ones({10});
  bad[4] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(send(*codec, *receiver, bad), Catch::Contains("element 4"));
  // A stateless codec refuses state.
  QuantizeCodec plain(8, 64);
  CHECK_THROWS_WITH(plain.load_state({{"bucket 0 slot 0 rank 0", torch::zeros({3})}}),
                    Catch::Contains("keeps no state"));
}

// ---- lossless stream codecs (Note [stream codecs]) ----

namespace {

using decent_dp::CommError;
using decent_dp::FpzipCodec;
using decent_dp::StreamCodec;
using decent_dp::ZstdCodec;

// Encodes x, checks the used prefix against the header, decodes only that prefix.
at::Tensor stream_round_trip(StreamCodec& codec, const at::Tensor& x, int64_t* used_out = nullptr) {
  at::Tensor payload =
      at::empty({codec.payload_numel(x.numel(), x.scalar_type())}, at::TensorOptions(at::kByte));
  const int64_t used = codec.encode_prefix(x, payload, CodecContext{0, 0, 0});
  CHECK(used >= 16);
  CHECK(used <= 16 + static_cast<int64_t>(x.nbytes()));  // never more than the raw block
  CHECK(used == codec.last_encoded_bytes());
  if (used_out != nullptr) {
    *used_out = used;
  }
  at::Tensor out = at::full_like(x, 7);
  codec.decode(payload.narrow(0, 0, used), out, CodecContext{0, 0, 1});
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.nbytes())) == 0;
}

}  // namespace

TEST_CASE("stream codecs: bit-exact round trips, any length, NaN and infinity included",
          "[codec][stream]") {
  torch::manual_seed(9);
  ZstdCodec zstd(1);
  ZstdCodec zstd19(19);
  FpzipCodec fpzip;
  std::vector<StreamCodec*> codecs = {&zstd, &zstd19, &fpzip};
  for (StreamCodec* codec : codecs) {
    CAPTURE(codec->name());
    for (int64_t n : {0, 1, 2, 3, 17, 1000, 4099, 65537}) {
      CAPTURE(n);
      const at::Tensor x = torch::randn({n});
      CHECK(same_bits(stream_round_trip(*codec, x), x));
      const at::Tensor d = torch::randn({n}, at::kDouble);
      CHECK(same_bits(stream_round_trip(*codec, d), d));
    }
    // Special values pass through losslessly: the codec compresses bits, not numbers.
    at::Tensor s = torch::randn({300});
    s[0] = std::numeric_limits<float>::quiet_NaN();
    s[1] = std::numeric_limits<float>::infinity();
    s[2] = -std::numeric_limits<float>::infinity();
    s[3] = -0.0f;
    s[4] = std::numeric_limits<float>::denorm_min();
    CHECK(same_bits(stream_round_trip(*codec, s), s));
  }
}

TEST_CASE("stream codecs: compressible blocks shrink, incompressible ones go raw",
          "[codec][stream]") {
  ZstdCodec zstd(1);
  FpzipCodec fpzip;
  // fpzip predicts each value from the previous one: a smooth ramp is nearly free.
  int64_t used = 0;
  const at::Tensor ramp = torch::linspace(0, 1, 10000);
  CHECK(same_bits(stream_round_trip(fpzip, ramp, &used), ramp));
  CHECK(used < 20000);
  for (StreamCodec* codec : std::vector<StreamCodec*>{&zstd, &fpzip}) {
    CAPTURE(codec->name());
    // Few distinct values and a constant block compress well below their 40000 bytes.
    const at::Tensor few = torch::randint(0, 4, {10000}).to(at::kFloat) * 0.25;
    CHECK(same_bits(stream_round_trip(*codec, few, &used), few));
    CHECK(used < 30000);
    const at::Tensor flat = at::full({10000}, 0.25f);
    CHECK(same_bits(stream_round_trip(*codec, flat, &used), flat));
    CHECK(used < 2000);
  }
  // Random bytes do not compress: the block is sent as it is, 16 header bytes on top.
  const at::Tensor noise = torch::randint(0, 256, {5000}, at::kByte);
  CHECK(same_bits(stream_round_trip(zstd, noise, &used), noise));
  CHECK(used == 16 + 5000);
}

TEST_CASE("stream codecs: corrupt payloads, bad levels and dtypes are refused", "[codec][stream]") {
  ZstdCodec zstd(3);
  CHECK(zstd.name() == "zstd(level 3)");
  CHECK(zstd.varying_size());
  CHECK(zstd.payload_dtype(at::kFloat) == at::kByte);
  CHECK_THROWS_WITH(ZstdCodec(0), Catch::Contains("level must be in"));
  CHECK_THROWS_WITH(ZstdCodec(1000), Catch::Contains("got 1000"));
  FpzipCodec fpzip;
  CHECK_THROWS_WITH(fpzip.payload_numel(10, at::kHalf),
                    Catch::Contains("float32 or float64, got Half"));
  CHECK_THROWS_WITH(ErrorCompensatedCodec(std::make_shared<ZstdCodec>(1)),
                    Catch::Contains("lossy fixed-size codec"));

  const at::Tensor x = torch::linspace(0, 1, 1000);
  for (StreamCodec* codec : std::vector<StreamCodec*>{&zstd, &fpzip}) {
    CAPTURE(codec->name());
    at::Tensor payload = at::empty({codec->payload_numel(1000, at::kFloat)}, at::kByte);
    const int64_t used = codec->encode_prefix(x, payload, CodecContext{});
    at::Tensor out = at::empty({1000});
    // Shorter than its header, shorter than its header says, an unknown format, a damaged
    // stream: a CommError naming the sender, bucket and update.
    CHECK_THROWS_AS(codec->decode(payload.narrow(0, 0, 8), out, CodecContext{1, 5, 2}), CommError);
    CHECK_THROWS_WITH(codec->decode(payload.narrow(0, 0, used - 1), out, CodecContext{1, 5, 2}),
                      Catch::Contains("rank 2 for bucket 1, update 5 is corrupt"));
    at::Tensor bad = payload.clone();
    bad[8] = 9;
    CHECK_THROWS_WITH(codec->decode(bad, out, CodecContext{1, 5, 2}), Catch::Contains("format 9"));
    bad = payload.clone();
    bad.narrow(0, 16, used - 16).fill_(0xA5);
    CHECK_THROWS_AS(codec->decode(bad.narrow(0, 0, used), out, CodecContext{}), CommError);
    // A payload that does not fit the block, and a block of another dtype.
    at::Tensor small = at::empty({100}, at::kByte);
    CHECK_THROWS_WITH(codec->encode_prefix(x, small, CodecContext{}),
                      Catch::Contains("contiguous bytes, got 100"));
  }
}
