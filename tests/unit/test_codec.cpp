// Codecs against their definitions (Note [uniform asymmetric quantization]).
#include "torch_catch.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "decent_dp/compensated_codec.h"
#include "decent_dp/quantize_codec.h"

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
