// ObservingSgd: plain SGD that opts into the pre-mixing hook (spec §6, Note [pre-mixing
// hook]) and keeps what every call was given, and check_observations(), which checks it
// against the exchanges' definition with every rank's records. Shared by the tests of
// DecentralizedDataParallel and DecentOptimWrapper.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "decent_dp/pre_mixing.h"
#include "decent_dp/topology/topology.h"
#include "mpi_test_util.h"
#include "torch_catch.h"

namespace decent_dp {
namespace testing {

class ObservingSgd final : public torch::optim::SGD, public PreMixingHook {
 public:
  struct Seen {
    size_t bucket = 0;
    int64_t update = 0;
    int rank = 0;
    std::vector<int> ranks;
    double self_weight = 0, adaptive_factor = 0, coefficient = 0;
    at::Tensor x, received, mixed, rows;
    bool views_ok = false;       // received_views and views() lay the blocks out like the tensors
    bool stepped_mixed = false;  // the next step() found its tensors equal to mixed(), bit for bit
  };

  ObservingSgd(std::vector<at::Tensor> params, double lr)
      : torch::optim::SGD(std::move(params), torch::optim::SGDOptions(lr)) {}

  void pre_mixing(const MixingContext& c) override {
    Seen s;
    s.bucket = c.bucket;
    s.update = c.update;
    s.rank = c.rank;
    s.ranks = c.group->ranks;
    s.self_weight = c.group->self_weight;
    s.adaptive_factor = c.adaptive_factor;
    s.coefficient = c.coefficient;
    s.x = c.params.clone();
    s.received = c.received.clone();
    s.mixed = c.mixed();
    if (c.rows.defined())
      s.rows = c.rows.clone();
    const auto& tensors = *c.tensors;
    const auto param_views = c.views(c.params);
    const auto received_views = c.views(c.received);
    s.views_ok = c.received_views.size() == tensors.size() && param_views.size() == tensors.size();
    for (size_t k = 0; s.views_ok && k < tensors.size(); ++k) {
      s.views_ok = c.received_views[k].sizes() == tensors[k].sizes() &&
                   c.received_views[k].strides() == tensors[k].strides() &&
                   torch::equal(c.received_views[k], received_views[k]) &&
                   torch::equal(param_views[k], tensors[k]) &&
                   param_views[k].data_ptr() == tensors[k].data_ptr();
    }
    pending_.push_back({seen.size(), tensors, c.views(s.mixed)});
    seen.push_back(std::move(s));
  }

  at::Tensor step(LossClosure closure = nullptr) override {
    for (const Pending& p : pending_) {
      bool same = true;
      for (size_t k = 0; k < p.tensors.size(); ++k)
        same = same && torch::equal(p.tensors[k], p.expected[k]);
      seen[p.index].stepped_mixed = same;
    }
    pending_.clear();
    return torch::optim::SGD::step(closure);
  }

  std::vector<Seen> seen;

 private:
  struct Pending {
    size_t index;
    std::vector<at::Tensor> tensors;
    std::vector<at::Tensor> expected;
  };
  std::vector<Pending> pending_;
};

// Checks every record of `seen` on this rank: one call per bucket and update 2..updates, the
// group and self weight of the exchange launched after update - 1, the coefficient, mixed()
// and what step() found, and `received` against the members' blocks (all-gathered from
// every rank's records): their plain mean on the all-reduce path, or (`gather`: the mean
// aggregator) the weighted mean, with rows holding the members' exact blocks.
inline void check_observations(std::vector<ObservingSgd::Seen> seen, const topology::Topology& topo,
                               size_t buckets, int64_t updates, double adaptive_factor,
                               bool gather) {
  Communicator& world = comm();
  const int n = world.size();
  const int rank = world.rank();
  INFO("rank " << rank);
  if (n == 1) {
    CHECK(seen.empty());  // training alone mixes nothing
    return;
  }
  REQUIRE(seen.size() == buckets * static_cast<size_t>(updates - 1));
  std::sort(seen.begin(), seen.end(), [](const auto& a, const auto& b) {
    return std::tie(a.update, a.bucket) < std::tie(b.update, b.bucket);
  });
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < seen.size(); ++i) {
    const auto& s = seen[i];
    INFO("bucket " << s.bucket << " update " << s.update);
    CHECK(s.bucket == i % buckets);
    CHECK(s.update == 2 + static_cast<int64_t>(i / buckets));
    CHECK(s.rank == rank);
    const auto& g = topo.group_of(rank, s.update - 1);
    CHECK(s.ranks == g.ranks);
    CHECK(s.self_weight == g.self_weight);
    CHECK(s.adaptive_factor == adaptive_factor);
    const double k = g.size();
    // A group of one (a rank left alone in its slot) mixes nothing on the all-reduce path.
    const double expected_coef = gather  ? adaptive_factor
                                 : k > 1 ? adaptive_factor * ((1 - g.self_weight) * k / (k - 1))
                                         : 0.0;
    CHECK(s.coefficient == Approx(expected_coef).epsilon(1e-12));
    if (std::abs(s.coefficient - 1) <= 1e-12)
      CHECK(torch::equal(s.mixed, s.received));  // the blocks trade roles (Note [block swap])
    else
      CHECK(torch::equal(s.mixed, s.x.lerp(s.received, s.coefficient)));
    CHECK(s.views_ok);
    CHECK(s.stepped_mixed);
    CHECK(s.rows.defined() == gather);
    mine.push_back(s.x);
  }
  // Every rank's records line up (the same buckets and updates): gather their blocks.
  const at::Tensor flat = torch::cat(mine);
  const at::Tensor all = torch::empty({n, flat.numel()}, flat.options());
  world.allgather(all.view({-1}), flat)->wait();
  int64_t offset = 0;
  for (const auto& s : seen) {
    INFO("bucket " << s.bucket << " update " << s.update);
    const int64_t len = s.x.numel();
    auto block_of = [&](int r) { return all[r].narrow(0, offset, len); };
    at::Tensor expected;
    if (gather) {
      expected = block_of(rank) * s.self_weight;
      for (size_t m = 0; m < s.ranks.size(); ++m) {
        CHECK(torch::equal(s.rows[m], block_of(s.ranks[m])));
        if (s.ranks[m] != rank)
          expected += block_of(s.ranks[m]) * ((1 - s.self_weight) / (s.ranks.size() - 1.0));
      }
    } else {
      expected = torch::zeros_like(s.x);
      for (int r : s.ranks)
        expected += block_of(r);
      expected /= static_cast<double>(s.ranks.size());
    }
    CHECK(torch::allclose(s.received, expected, 1e-5, 1e-6));
    offset += len;
  }
}

}  // namespace testing
}  // namespace decent_dp
