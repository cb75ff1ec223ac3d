// codec_bench: single-core throughput of the quantization codec (Note [uniform asymmetric
// quantization]) on a float32 block: encode, decode and both, in GB/s of float32 input,
// next to a plain copy of the block measured in the same run, and the payload's share of
// the float32 bytes. Then the lossless stream codecs (Note [stream codecs]: zstd at
// --zstd-level, fpzip) on the same block: their ratio and speed. Cases are interleaved
// round by round; medians are reported. The block is N(0, 0.05^2) values, or the float32
// values of --raw FILE (e.g. a trained model's parameters written with numpy's tofile).
// Last, the gather path's aggregators on a group of --group members, each sending
// --agg-numel values: mean, median and trimmed mean (b = --trim) through the sorting network
// (Note [sorting network]), next to the trimmed mean through ATen's sort along the group
// dimension (the previous implementation), in ms per aggregation and as a paired ratio.
//
//   build/bin/codec_bench [--numel 4194304] [--rounds 15] [--chunk 1024] [--zstd-level 1]
//                         [--raw FILE] [--group 8] [--trim 2] [--agg-numel 421888]
//                         [--json out.json]
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <vector>

#include "benchmarks/bench_util.h"
#include "decent_dp/exchange_stage.h"
#include "decent_dp/quantize_codec.h"
#include "decent_dp/stream_codec.h"

#include <cstdio>
#include <memory>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp codec throughput (one core)"};
  int64_t numel = 1 << 22;
  int rounds = 15;
  int64_t chunk = 1024;
  std::string json_path;
  std::string raw_path;
  int zstd_level = 1;
  int group = 8;
  int trim = 2;
  int64_t agg_numel = 421888;  // the examples' cnn, rounded up to whole 128-byte slots
  app.add_option("--group", group, "members of the aggregated group")->check(CLI::Range(1, 1024));
  app.add_option("--trim", trim, "values the trimmed mean drops at each end")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--agg-numel", agg_numel, "float32 elements per member for the aggregators")
      ->check(CLI::PositiveNumber);
  app.add_option("--raw", raw_path, "float32 values to use as the block (raw file)");
  app.add_option("--zstd-level", zstd_level, "zstd's level")->check(CLI::Range(1, 19));
  app.add_option("--numel", numel, "float32 elements per block")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "timed rounds per case")->check(CLI::PositiveNumber);
  app.add_option("--chunk", chunk, "elements per (minimum, step) pair")->check(CLI::PositiveNumber);
  app.add_option("-J,--json", json_path, "also write the results as JSON to this file");
  CLI11_PARSE(app, argc, argv);
  if (group > 1 && group <= 2 * trim) {
    std::fprintf(stderr, "error: --trim %d needs --group > %d, got %d\n", trim, 2 * trim, group);
    return 2;
  }
  if (const std::string why = decent_dp::bench::check_writable(json_path, "-J/--json");
      !why.empty()) {
    std::fprintf(stderr, "error: %s\n", why.c_str());
    return 2;
  }
  at::set_num_threads(1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  at::Tensor x;
  if (raw_path.empty()) {
    x = at::randn({numel}, gen).mul_(0.05);  // parameter-like values
  } else {
    std::FILE* f = std::fopen(raw_path.c_str(), "rb");
    if (f == nullptr || std::fseek(f, 0, SEEK_END) != 0) {
      std::fprintf(stderr, "error: --raw: cannot read %s\n", raw_path.c_str());
      return 2;
    }
    numel = std::ftell(f) / 4;
    std::rewind(f);
    x = at::empty({numel});
    if (numel == 0 ||
        std::fread(x.data_ptr(), 4, static_cast<size_t>(numel), f) != static_cast<size_t>(numel)) {
      std::fprintf(stderr, "error: --raw: %s holds no float32 values\n", raw_path.c_str());
      std::fclose(f);
      return 2;
    }
    std::fclose(f);
  }
  at::Tensor y = at::empty({numel});
  const double gb = static_cast<double>(numel) * 4 / 1e9;

  struct Case {
    int bits;
    std::vector<uint8_t> payload;
    std::vector<double> enc, dec;
  };
  std::vector<Case> cases;
  for (int bits : {8, 4}) {
    Case c;
    c.bits = bits;
    c.payload.resize(static_cast<size_t>(decent_dp::quantize::payload_bytes(numel, bits, chunk)));
    cases.push_back(std::move(c));
  }
  struct StreamCase {
    std::shared_ptr<decent_dp::StreamCodec> codec;
    at::Tensor payload;
    int64_t used = 0;
    std::vector<double> enc, dec;
  };
  std::vector<StreamCase> streams;
  for (std::shared_ptr<decent_dp::StreamCodec> codec :
       {std::shared_ptr<decent_dp::StreamCodec>(std::make_shared<decent_dp::ZstdCodec>(zstd_level)),
        std::shared_ptr<decent_dp::StreamCodec>(std::make_shared<decent_dp::FpzipCodec>())}) {
    StreamCase c;
    c.payload = at::empty({codec->payload_numel(numel, at::kFloat)}, at::kByte);
    c.codec = std::move(codec);
    streams.push_back(std::move(c));
  }
  // Aggregators: k rows of parameter-like values, this rank's own in row 0.
  struct AggCase {
    std::string name;
    std::function<void(const at::Tensor&, const at::Tensor&)> run;
    std::vector<double> t;
  };
  const at::Tensor agg_rows = at::randn({group, agg_numel}, gen).mul_(0.05);
  at::Tensor agg_out = at::empty({agg_numel});
  decent_dp::topology::Group agg_group;
  for (int m = 0; m < group; ++m) {
    agg_group.ranks.push_back(m);
  }
  agg_group.self_weight = 1.0 / group;
  auto mean_agg = std::make_shared<decent_dp::MeanAggregator>();
  auto median_agg = std::make_shared<decent_dp::MedianAggregator>();
  auto trimmed_agg = std::make_shared<decent_dp::TrimmedMeanAggregator>(trim);
  std::vector<AggCase> aggs;
  aggs.push_back(
      {"mean",
       [&](const at::Tensor& r, const at::Tensor& o) { mean_agg->aggregate(r, 0, agg_group, o); },
       {}});
  aggs.push_back(
      {"median (network)",
       [&](const at::Tensor& r, const at::Tensor& o) { median_agg->aggregate(r, 0, agg_group, o); },
       {}});
  aggs.push_back({fmt::format("trimmed b={} (network)", trim),
                  [&](const at::Tensor& r, const at::Tensor& o) {
                    trimmed_agg->aggregate(r, 0, agg_group, o);
                  },
                  {}});
  aggs.push_back({fmt::format("trimmed b={} (ATen sort)", trim),
                  [&](const at::Tensor& r, const at::Tensor& o) {
                    const at::Tensor sorted = std::get<0>(r.sort(0));
                    at::Tensor target = o;
                    at::sum_out(target, sorted.narrow(0, trim, group - 2 * trim), {0});
                    o.div_(static_cast<double>(group - 2 * trim));
                  },
                  {}});
  std::vector<double> copy;
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  for (int r = -1; r < rounds; ++r) {  // round -1 warms up
    const double t_copy =
        seconds_of([&] { std::memcpy(dst, src, static_cast<size_t>(numel) * sizeof(float)); });
    if (r >= 0) {
      copy.push_back(t_copy);
    }
    for (Case& c : cases) {
      const double te = seconds_of(
          [&] { decent_dp::quantize::encode(src, numel, c.bits, chunk, c.payload.data()); });
      const double td = seconds_of(
          [&] { decent_dp::quantize::decode(c.payload.data(), numel, c.bits, chunk, dst); });
      if (r >= 0) {
        c.enc.push_back(te);
        c.dec.push_back(td);
      }
    }
    for (AggCase& c : aggs) {
      const double t = seconds_of([&] { c.run(agg_rows, agg_out); });
      if (r >= 0) {
        c.t.push_back(t);
      }
    }
    for (StreamCase& c : streams) {
      const double te = seconds_of(
          [&] { c.used = c.codec->encode_prefix(x, c.payload, decent_dp::CodecContext{}); });
      const double td = seconds_of(
          [&] { c.codec->decode(c.payload.narrow(0, 0, c.used), y, decent_dp::CodecContext{}); });
      if (r >= 0) {
        c.enc.push_back(te);
        c.dec.push_back(td);
      }
    }
  }
  fmt::print("# {} float32 elements ({:.1f} MiB), chunk {}, one thread, medians of {} rounds\n",
             numel, numel * 4 / 1048576.0, chunk, rounds);
  fmt::print("{:<22} {:>10} {:>10} {:>12} {:>10}\n", "case", "encode", "decode", "enc+dec",
             "payload");
  fmt::print("{:<22} {:>10} {:>10} {:>12} {:>10}\n", "", "GB/s", "GB/s", "GB/s", "of fp32");
  const double copy_gbs = gb / median(copy);
  fmt::print("{:<22} {:>10.2f} {:>10} {:>12} {:>10}\n", "memcpy (reference)", copy_gbs, "", "", "");
  nlohmann::json out;
  out["numel"] = numel;
  out["chunk"] = chunk;
  out["memcpy_gbps"] = copy_gbs;
  for (const Case& c : cases) {
    const double e = median(c.enc), d = median(c.dec);
    const double ratio = static_cast<double>(c.payload.size()) / (static_cast<double>(numel) * 4);
    fmt::print("{:<22} {:>10.2f} {:>10.2f} {:>12.2f} {:>9.1f}%\n",
               fmt::format("quantize {} bit", c.bits), gb / e, gb / d, gb / (e + d), 100 * ratio);
    out["cases"].push_back({{"bits", c.bits},
                            {"encode_gbps", gb / e},
                            {"decode_gbps", gb / d},
                            {"roundtrip_gbps", gb / (e + d)},
                            {"payload_ratio", ratio}});
  }
  for (const StreamCase& c : streams) {
    const double e = median(c.enc), d = median(c.dec);
    const double ratio = static_cast<double>(c.used) / (static_cast<double>(numel) * 4);
    fmt::print("{:<22} {:>10.2f} {:>10.2f} {:>12.2f} {:>9.1f}%\n", c.codec->name(), gb / e, gb / d,
               gb / (e + d), 100 * ratio);
    out["streams"].push_back({{"codec", c.codec->name()},
                              {"encode_gbps", gb / e},
                              {"decode_gbps", gb / d},
                              {"roundtrip_gbps", gb / (e + d)},
                              {"payload_ratio", ratio}});
  }
  fmt::print("\n# aggregators: group of {}, {} float32 elements per member, one thread\n", group,
             agg_numel);
  fmt::print("{:<26} {:>10} {:>14}\n", "case", "ms", "member GB/s");
  const double agg_gb = static_cast<double>(agg_numel) * group * 4 / 1e9;
  for (const AggCase& c : aggs) {
    const double t = median(c.t);
    fmt::print("{:<26} {:>10.2f} {:>14.2f}\n", c.name, 1e3 * t, agg_gb / t);
    out["aggregators"].push_back({{"case", c.name}, {"ms", 1e3 * t}, {"gbps", agg_gb / t}});
  }
  // Paired per round: ATen's sort over the network, the same round's two timings.
  std::vector<double> speedup;
  for (size_t r = 0; r < aggs[2].t.size(); ++r) {
    speedup.push_back(aggs[3].t[r] / aggs[2].t[r]);
  }
  fmt::print("trimmed mean: ATen sort / network = {:.1f}x (median of paired rounds)\n",
             median(speedup));
  out["trimmed_sort_over_network"] = median(speedup);
  out["group"] = group;
  out["agg_numel"] = agg_numel;
  if (!json_path.empty() && !decent_dp::bench::write_json(json_path, out, "-J/--json")) {
    return 1;
  }
  return 0;
}
