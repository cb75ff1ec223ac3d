// Note [exchange seam]
// The gossip exchange of one bucket is encode -> transport -> aggregate -> mix:
//
//   encode     what this rank sends for its parameter block x (a Codec; identity when none)
//   transport  the group all-reduce to the mean (the fast path, taken when there is neither a
//              codec nor an aggregator), or the group all-gather of every member's payload
//              (Note [group all-gather])
//   aggregate  the members' decoded blocks -> this rank's mixed value mix(x) (an Aggregator;
//              this rank's own row is its exact x, never its encoded payload)
//   mix        x <- (1 - a) x + a mix(x), a the adaptive factor (spec §2)
//
// A codec or an aggregator is one class; the wrappers never branch on which one runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "decent_dp/topology/topology.h"

namespace decent_dp {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Where a codec runs: which bucket, which update and slot, which rank.
struct CodecContext {
  size_t bucket = 0;
  int64_t update = 0;
  int rank = 0;  // the rank whose payload this is
  int slot = 0;  // the topology slot of the exchange (update mod period)
};

class Codec {
 public:
  virtual ~Codec() = default;
  virtual std::string name() const = 0;
  // The payload of a block of `numel` elements of `dtype`: its element count and dtype
  // (the same for every rank and update).
  virtual int64_t payload_numel(int64_t numel, c10::ScalarType dtype) const = 0;
  virtual c10::ScalarType payload_dtype(c10::ScalarType dtype) const = 0;
  // Writes what this rank sends for `x` into `payload` (1-D, payload_numel elements).
  virtual void encode(const at::Tensor& x, const at::Tensor& payload, const CodecContext& ctx) = 0;
  // Writes the block that `payload` (sent by ctx.rank) stands for into `out` (like x).
  virtual void decode(const at::Tensor& payload, const at::Tensor& out,
                      const CodecContext& ctx) = 0;
  // Lossless stream codecs (ZstdCodec, FpzipCodec) use a prefix of the payload whose length
  // depends on the data: payload_numel() is then their capacity, encode_prefix() returns
  // the elements used, and the exchange sends only those (Note [varying all-gather]);
  // decode() gets the prefix. Fixed-size codecs use the whole payload.
  virtual bool varying_size() const { return false; }
  virtual int64_t encode_prefix(const at::Tensor& x, const at::Tensor& payload,
                                const CodecContext& ctx) {
    encode(x, payload, ctx);
    return payload.numel();
  }
  // A codec that keeps state between updates (ErrorCompensatedCodec) lists it here for
  // checkpoints, and load_state() puts it back; a stateless codec refuses any state.
  virtual NamedTensors state() const { return {}; }
  virtual void load_state(const NamedTensors& state);
};

class Aggregator {
 public:
  virtual ~Aggregator() = default;
  virtual std::string name() const = 0;
  // `rows`: k x n, row m the block of the group's m-th member (ascending ranks), row
  // `self` this rank's own x. Writes mix(x) into `out` (n elements).
  virtual void aggregate(const at::Tensor& rows, int64_t self, const topology::Group& group,
                         const at::Tensor& out) = 0;
  // Called once when a wrapper is built, with its topology (the same on every rank): throws
  // InvalidArgument when the aggregator cannot run on one of its groups.
  virtual void check(const topology::Topology& /*topology*/) const {}
};

// mix(x) = w x + (1 - w) / (k - 1) * sum of the others' rows: the spec's weighted mean, the
// same value as the all-reduce fast path (up to float rounding).
class MeanAggregator final : public Aggregator {
 public:
  std::string name() const override { return "mean"; }
  void aggregate(const at::Tensor& rows, int64_t self, const topology::Group& group,
                 const at::Tensor& out) override;
};

// The coordinate-wise median of the k rows (this rank's included); for even k the mean of
// the two middle values. Robust to fewer than k / 2 arbitrary rows.
class MedianAggregator final : public Aggregator {
 public:
  std::string name() const override { return "median"; }
  void aggregate(const at::Tensor& rows, int64_t self, const topology::Group& group,
                 const at::Tensor& out) override;
};

// The coordinate-wise trimmed mean: per coordinate, the b largest and the b smallest of the
// k values (this rank's included) are dropped and the other k - 2b averaged. b = 0 is the
// plain mean of the k rows (equal weights); robust to at most b arbitrary rows per group.
// Needs k > 2b in every group of more than one member (check() names the first that is not).
class TrimmedMeanAggregator final : public Aggregator {
 public:
  explicit TrimmedMeanAggregator(int64_t b);
  std::string name() const override;
  int64_t trimmed() const { return b_; }
  void aggregate(const at::Tensor& rows, int64_t self, const topology::Group& group,
                 const at::Tensor& out) override;
  void check(const topology::Topology& topology) const override;

 private:
  int64_t b_;
};

// The stages of the gossip exchange; both null: the all-reduce fast path.
struct ExchangeStages {
  std::shared_ptr<Codec> codec;
  std::shared_ptr<Aggregator> aggregator;  // null with a codec: MeanAggregator
  bool gathers() const { return codec != nullptr || aggregator != nullptr; }
};

}  // namespace decent_dp
