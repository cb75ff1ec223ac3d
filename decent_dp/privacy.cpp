#include "decent_dp/privacy.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "decent_dp/bucket_set.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace privacy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// log(exp(a) + exp(b)).
double log_add(double a, double b) {
  if (a == -kInf) {
    return b;
  }
  if (b == -kInf) {
    return a;
  }
  const double hi = std::max(a, b);
  return hi + std::log1p(std::exp(-std::abs(a - b)));
}

// log(exp(a) - exp(b)), a >= b.
double log_sub(double a, double b) {
  if (b == -kInf) {
    return a;
  }
  if (b >= a) {
    return -kInf;  // rounding: the terms cancel
  }
  return a + std::log(-std::expm1(b - a));
}

// log(erfc(x)); an asymptotic series where erfc underflows.
double log_erfc(double x) {
  if (x < 25.0) {
    return std::log(std::erfc(x));
  }
  const double r = 1.0 / (x * x);
  return -x * x - std::log(x) - 0.5 * std::log(M_PI) +
         std::log1p(-0.5 * r + 0.75 * r * r - 1.875 * r * r * r + 6.5625 * r * r * r * r);
}

double log_binom_int(int64_t n, int64_t k) {
  return std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0);
}

// log A_alpha for an integer order (Mironov et al. 2019, Section 3.3, integer case).
double log_a_int(double q, double sigma, int64_t alpha) {
  double log_a = -kInf;
  for (int64_t i = 0; i <= alpha; ++i) {
    const double log_coef = log_binom_int(alpha, i) + static_cast<double>(i) * std::log(q) +
                            static_cast<double>(alpha - i) * std::log1p(-q);
    const double s = log_coef + static_cast<double>(i * i - i) / (2 * sigma * sigma);
    log_a = log_add(log_a, s);
  }
  return log_a;
}

// log A_alpha for a fractional order: the two converging series of the same section.
double log_a_frac(double q, double sigma, double alpha) {
  double log_a0 = -kInf, log_a1 = -kInf;
  const double z0 = sigma * sigma * std::log(1 / q - 1) + 0.5;
  double log_coef = 0;  // log |binom(alpha, i)|
  bool positive = true;
  for (int64_t i = 0;; ++i) {
    const double di = static_cast<double>(i);
    const double j = alpha - di;
    const double log_t0 = log_coef + di * std::log(q) + j * std::log1p(-q);
    const double log_t1 = log_coef + j * std::log(q) + di * std::log1p(-q);
    const double log_e0 = std::log(0.5) + log_erfc((di - z0) / (std::sqrt(2.0) * sigma));
    const double log_e1 = std::log(0.5) + log_erfc((z0 - j) / (std::sqrt(2.0) * sigma));
    const double log_s0 = log_t0 + (di * di - di) / (2 * sigma * sigma) + log_e0;
    const double log_s1 = log_t1 + (j * j - j) / (2 * sigma * sigma) + log_e1;
    if (positive) {
      log_a0 = log_add(log_a0, log_s0);
      log_a1 = log_add(log_a1, log_s1);
    } else {
      log_a0 = log_sub(log_a0, log_s0);
      log_a1 = log_sub(log_a1, log_s1);
    }
    if (std::max(log_s0, log_s1) < -30 && di > alpha) {
      break;
    }
    // binom(alpha, i + 1) = binom(alpha, i) (alpha - i) / (i + 1)
    const double factor = alpha - di;
    if (factor == 0) {
      break;  // every later coefficient is zero
    }
    log_coef += std::log(std::abs(factor)) - std::log(di + 1);
    if (factor < 0) {
      positive = !positive;
    }
    DECENT_DP_CHECK_ARG(i < 100000, "privacy: the RDP series did not converge for q = ", q,
                        ", sigma = ", sigma, ", order ", alpha);
  }
  return log_add(log_a0, log_a1);
}

}  // namespace

void check(const PrivacyOptions& o, const char* who) {
  DECENT_DP_CHECK_ARG(std::isfinite(o.clip_norm) && o.clip_norm >= 0, who,
                      ": privacy.clip_norm must be a finite value >= 0, got ", o.clip_norm);
  DECENT_DP_CHECK_ARG(std::isfinite(o.noise_multiplier) && o.noise_multiplier >= 0, who,
                      ": privacy.noise_multiplier must be a finite value >= 0, got ",
                      o.noise_multiplier);
  DECENT_DP_CHECK_ARG(o.noise_multiplier == 0 || o.clip_norm > 0, who,
                      ": privacy.noise_multiplier ", o.noise_multiplier,
                      " needs privacy.clip_norm > 0 (the noise is sigma * C)");
}

void privatize(Bucket& bucket, const PrivacyOptions& o, int rank, int64_t update,
               int64_t total_numel) {
  int64_t numel = 0;
  for (const at::Tensor& v : bucket.storage.grad_views) {
    numel += v.numel();
  }
  if (numel == 0 || total_numel <= 0) {
    return;
  }
  const double clip = o.clip_norm * std::sqrt(static_cast<double>(numel) / total_numel);
  const double norm = bucket.storage.grads.norm().item<double>();
  if (norm > clip) {
    bucket.storage.grads.mul_(clip / norm);
  }
  if (o.noise_multiplier == 0) {
    return;
  }
  const uint64_t seed =
      splitmix64(splitmix64(splitmix64(o.seed) ^ static_cast<uint64_t>(rank)) ^
                 (static_cast<uint64_t>(bucket.index) << 40) ^ static_cast<uint64_t>(update));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double std_dev = o.noise_multiplier * o.clip_norm;
  for (const at::Tensor& g : bucket.storage.grad_views) {
    at::Tensor z = at::empty(g.sizes(), at::TensorOptions().dtype(g.scalar_type()));
    z.normal_(0.0, std_dev, gen);
    g.add_(g.device().is_cpu() ? z : z.to(g.device()));
  }
}

std::vector<double> default_orders() {
  std::vector<double> out;
  for (double a = 1.25; a < 11; a += 0.25) {
    out.push_back(a);
  }
  for (int a = 11; a <= 256; ++a) {
    out.push_back(a);
  }
  return out;
}

double rdp_sampled_gaussian(double q, double sigma, double alpha) {
  DECENT_DP_CHECK_ARG(q >= 0 && q <= 1, "privacy: the sampling rate q must be in [0, 1], got ", q);
  DECENT_DP_CHECK_ARG(sigma >= 0 && !std::isnan(sigma),
                      "privacy: the noise multiplier must be >= 0, got ", sigma);
  DECENT_DP_CHECK_ARG(alpha > 1, "privacy: RDP orders must be > 1, got ", alpha);
  if (q == 0) {
    return 0;
  }
  if (sigma == 0 || std::isinf(alpha)) {
    return kInf;
  }
  if (q == 1) {
    return alpha / (2 * sigma * sigma);
  }
  const double log_a = alpha == std::floor(alpha) ? log_a_int(q, sigma, static_cast<int64_t>(alpha))
                                                  : log_a_frac(q, sigma, alpha);
  return log_a / (alpha - 1);
}

Epsilon epsilon_from_rdp(const std::vector<double>& orders, const std::vector<double>& rdp,
                         double delta) {
  DECENT_DP_CHECK_ARG(delta > 0 && delta < 1, "privacy: delta must be in (0, 1), got ", delta);
  DECENT_DP_CHECK_ARG(!orders.empty() && orders.size() == rdp.size(),
                      "privacy: expected one RDP value per order, got ", rdp.size(), " for ",
                      orders.size(), " orders");
  Epsilon best{kInf, orders[0]};
  for (size_t k = 0; k < orders.size(); ++k) {
    const double a = orders[k];
    const double r = rdp[k];
    DECENT_DP_CHECK_ARG(r >= 0, "privacy: RDP values must be >= 0, got ", r, " at order ", a);
    double eps = kInf;
    if (delta * delta + std::expm1(-r) >= 0) {
      eps = 0;  // the RDP bound alone gives delta
    } else if (a > 1.01) {
      eps = r + std::log1p(-1 / a) - std::log(delta * a) / (a - 1);
    }
    if (eps < best.epsilon) {
      best = Epsilon{std::max(0.0, eps), a};
    }
  }
  return best;
}

Epsilon epsilon(double q, double sigma, int64_t steps, double delta,
                const std::vector<double>& orders) {
  DECENT_DP_CHECK_ARG(steps >= 0, "privacy: steps must be >= 0, got ", steps);
  std::vector<double> rdp;
  rdp.reserve(orders.size());
  for (double a : orders) {
    rdp.push_back(steps == 0 ? 0.0
                             : static_cast<double>(steps) * rdp_sampled_gaussian(q, sigma, a));
  }
  return epsilon_from_rdp(orders, rdp, delta);
}

}  // namespace privacy
}  // namespace decent_dp
