// Note [error compensation]
// A lossy codec C sends what it can of x; the error x - C(x) is lost every update, so with
// coarse codes the ranks never agree closer than the code's step (4-bit gossip loses about
// 12 points of accuracy that way, docs/results.md). ErrorCompensatedCodec sends the change
// instead, CHOCO-gossip style (Koloskova, Stich and Jaggi, ICML 2019): every member m of a
// group keeps an estimate h_m of every member's block, the same on all of them, and
//
//   sender:   q = C(x - h_self)        (what goes on the wire)
//             h_self <- h_self + D(q)  (D: the codec's decode)
//   receiver: h_m <- h_m + D(q_m)      and the aggregator reads h_m as member m's block
//
// so h_m tracks x_m and its error is the error of one code of the last change, which
// shrinks as the ranks converge, instead of a code of the whole block. All estimates start
// at zero (the first exchange codes x itself). The sender and its receivers apply the same
// D to the same bytes, so their h_m are bit-identical. A rank's own row is its exact x (Note
// [exchange seam]).
//
// Groups change from slot to slot while an estimate is only kept in step by the exchanges
// of its own group, so the estimates are per (bucket, slot, member): a topology of period P
// whose groups have k members keeps P k blocks of each bucket (1 + 1 for ring and a
// complete graph of two, log2(n) x 2 for one-peer exponential, 16 k for random-<k>). They
// are part of a checkpoint (state()).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "decent_dp/exchange_stage.h"

namespace decent_dp {

class ErrorCompensatedCodec final : public Codec {
 public:
  // `inner`: the lossy codec of the changes (QuantizeCodec); not null.
  explicit ErrorCompensatedCodec(std::shared_ptr<Codec> inner);
  std::string name() const override;
  const Codec& inner() const { return *inner_; }
  int64_t payload_numel(int64_t numel, c10::ScalarType dtype) const override;
  c10::ScalarType payload_dtype(c10::ScalarType dtype) const override;
  void encode(const at::Tensor& x, const at::Tensor& payload, const CodecContext& ctx) override;
  void decode(const at::Tensor& payload, const at::Tensor& out, const CodecContext& ctx) override;
  // One entry per estimate, named "bucket B slot S rank R".
  NamedTensors state() const override;
  void load_state(const NamedTensors& state) override;
  // Estimates kept so far.
  size_t estimates() const { return estimates_.size(); }

 private:
  using Key = std::tuple<size_t, int, int>;  // bucket, slot, member
  at::Tensor& estimate(const CodecContext& ctx, const at::Tensor& like);

  std::shared_ptr<Codec> inner_;
  std::map<Key, at::Tensor> estimates_;
  at::Tensor scratch_;
};

}  // namespace decent_dp
