// Reference simulator of decentralized training (spec §2): all n replicas in one process,
// the formulas written out directly, the same optimizer classes. Multi-rank tests compare
// every rank's parameters with its replica here.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "decent_dp/optim/factories.h"
#include "decent_dp/topology/topology.h"

namespace decent_dp {
namespace testing {

using ModelFactory = std::function<std::shared_ptr<torch::nn::Module>()>;
// The loss of replica `rank` at training step `step` (0-based) for its model.
using LossFn = std::function<at::Tensor(torch::nn::Module& model, int rank, int step)>;

class Simulator {
 public:
  // gossip = false: classic all-reduce of gradients instead.
  Simulator(const ModelFactory& make_model, int n, const std::string& topology, int lws,
            const optim::OptimFn& optim_fn, const optim::LrSchedulerFn& scheduler_fn = nullptr,
            bool gossip = true)
      : topo_(topology::make_topology(topology, n, lws)), gossip_(gossip) {
    for (int i = 0; i < n; ++i) {
      models_.push_back(make_model());
      torch::NoGradGuard no_grad;
      if (i > 0) {  // every replica starts from replica 0's parameters and buffers
        auto src = models_[0]->named_parameters();
        auto dst = models_[i]->named_parameters();
        for (const auto& p : src)
          dst[p.key()].copy_(p.value());
        auto srcb = models_[0]->named_buffers();
        auto dstb = models_[i]->named_buffers();
        for (const auto& b : srcb)
          dstb[b.key()].copy_(b.value());
      }
    }
    optim::NamedParams named;
    for (int i = 0; i < n; ++i) {
      named.clear();
      for (const auto& p : models_[i]->named_parameters())
        named.emplace_back(p.key(), p.value());
      optimizers_.push_back(optim_fn(named));
      if (scheduler_fn)
        schedulers_.push_back(scheduler_fn(*optimizers_.back()));
    }
  }

  // One training step of every replica: update u = updates_ + 1.
  void step(const LossFn& loss_fn, int step_index) {
    const int n = static_cast<int>(models_.size());
    for (int i = 0; i < n; ++i) {
      for (auto& p : models_[i]->parameters()) {
        if (p.grad().defined())
          p.mutable_grad().zero_();
      }
      loss_fn(*models_[i], i, step_index).backward();
    }
    torch::NoGradGuard no_grad;
    if (!gossip_) {
      const auto params0 = models_[0]->parameters();
      for (size_t k = 0; k < params0.size(); ++k) {
        at::Tensor sum = torch::zeros_like(params0[k]);
        for (int i = 0; i < n; ++i) {
          const auto g = models_[i]->parameters()[k].grad();
          if (g.defined())
            sum += g;
        }
        for (int i = 0; i < n; ++i) {
          auto p = models_[i]->parameters()[k];
          if (!p.grad().defined())
            p.mutable_grad() = torch::zeros_like(p);
          p.mutable_grad().copy_(sum / n);
        }
      }
    } else if (updates_ >= 1) {
      // x_i <- (1-a) x_i + a mix_R(x)_i over the group of the exchange launched after
      // update u-1 (slot (u-1) mod P), with every replica's x(u-1).
      std::vector<std::vector<at::Tensor>> snapshot(n);
      for (int i = 0; i < n; ++i) {
        for (const auto& p : models_[i]->parameters())
          snapshot[i].push_back(p.detach().clone());
      }
      for (int i = 0; i < n; ++i) {
        const auto& g = topo_->group_of(i, updates_);
        const double k = g.size();
        auto params = models_[i]->parameters();
        for (size_t t = 0; t < params.size(); ++t) {
          // What replica i receives of its peers: their exact values, or rounded through
          // the payload dtype of a codec.
          auto received = [&](int j) {
            return j == i || payload_dtype_ == at::kFloat
                       ? snapshot[j][t]
                       : snapshot[j][t].to(payload_dtype_).to(snapshot[j][t].scalar_type());
          };
          at::Tensor mix;
          if (median_) {
            // Coordinate-wise median of the k members (own value included); for even k the
            // mean of the two middle values.
            std::vector<at::Tensor> rows;
            for (int j : g.ranks)
              rows.push_back(received(j));
            auto sorted = std::get<0>(torch::stack(rows).sort(0));
            const int64_t kk = g.size();
            mix = kk % 2 == 1 ? sorted[kk / 2].clone() : (sorted[kk / 2 - 1] + sorted[kk / 2]) / 2;
          } else if (trim_ >= 0 && g.size() > 1) {
            // Coordinate-wise trimmed mean: drop the trim_ largest and smallest of the k
            // values, average the rest with equal weights.
            std::vector<at::Tensor> rows;
            for (int j : g.ranks)
              rows.push_back(received(j));
            auto sorted = std::get<0>(torch::stack(rows).sort(0));
            mix = sorted.narrow(0, trim_, g.size() - 2 * trim_).mean(0);
          } else {
            mix = snapshot[i][t] * g.self_weight;
            for (int j : g.ranks) {
              if (j != i)
                mix += received(j) * ((1 - g.self_weight) / (k - 1));
            }
          }
          params[t].copy_(snapshot[i][t] * (1 - adaptive_) + mix * adaptive_);
        }
      }
    }
    for (int i = 0; i < n; ++i) {
      // Missing gradients count as zero (spec §7).
      for (auto& p : models_[i]->parameters()) {
        if (!p.grad().defined())
          p.mutable_grad() = torch::zeros_like(p);
      }
      if (clip_norm_ > 0) {  // one bucket: the norm over all gradients
        double sq = 0;
        for (auto& p : models_[i]->parameters())
          sq += p.grad().pow(2).sum().item<double>();
        const double coef = clip_norm_ / (std::sqrt(sq) + 1e-6);
        if (coef < 1) {
          for (auto& p : models_[i]->parameters())
            p.mutable_grad().mul_(coef);
        }
      }
      optimizers_[i]->step();
      if (!schedulers_.empty())
        schedulers_[i]->step();
    }
    ++updates_;
  }

  torch::nn::Module& model(int i) { return *models_[i]; }
  void set_adaptive_factor(double a) { adaptive_ = a; }
  // Clips every replica's whole gradient (the wrapper with a single bucket).
  void set_clip_norm(double c) { clip_norm_ = c; }
  // Mixing by the coordinate-wise median of the group instead of the weighted mean.
  void set_median(bool on) { median_ = on; }
  // Mixing by the coordinate-wise trimmed mean dropping `b` values at each end (-1: off).
  void set_trimmed_mean(int64_t b) { trim_ = b; }
  // Peers' values arrive rounded to `dtype` (a codec that sends that dtype).
  void set_payload_dtype(at::ScalarType dtype) { payload_dtype_ = dtype; }

 private:
  std::unique_ptr<topology::Topology> topo_;
  bool gossip_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<std::unique_ptr<torch::optim::LRScheduler>> schedulers_;
  int64_t updates_ = 0;
  double adaptive_ = 1.0;
  double clip_norm_ = 0.0;
  bool median_ = false;
  int64_t trim_ = -1;
  at::ScalarType payload_dtype_ = at::kFloat;
};

}  // namespace testing
}  // namespace decent_dp
