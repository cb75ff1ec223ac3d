// Note [differential privacy]
// The Gaussian mechanism on each rank's gradient (DP-SGD at the batch level): before a
// bucket's update (and, under all-reduce, before the mean), the gradient g of this rank's
// batch is clipped and noised,
//
//   g_b <- g_b min(1, C_b / |g_b|) + N(0, sigma^2 C^2 I),   C_b = C sqrt(n_b / N),
//
// per bucket b of n_b parameter elements out of N, so the whole gradient has norm <= C
// (sum of C_b^2 = C^2) and every coordinate gets noise of standard deviation sigma C. The
// noise comes from a generator seeded by (seed, rank, bucket, update) (splitmix64), so runs
// repeat and a resumed run draws what the uninterrupted one would. Everything a rank shares
// (its parameters, in any exchange) is computed from noised gradients, so it is covered by
// the guarantee; the bucket layout's padding gets no noise (Note [block padding]).
//
// What is protected: one training example of a rank's shard (add/remove adjacency). The
// clip is of the batch's mean gradient, not of each example's, so one example can move the
// clipped gradient by up to 2C: the accountant is run with noise multiplier sigma / 2 for it
// (privacy::per_example_multiplier). The accountant assumes Poisson sampling at rate
// q = batch / shard; a trainer that shuffles and cuts fixed batches is the usual
// approximation of it.
//
// The accountant: Renyi DP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar and
// Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian Mechanism": the exact sum
// for integer orders, the series of their Section 3.3 for fractional ones), composed over
// steps (RDP adds up), converted to (epsilon, delta) with the bound of Canonne, Kamath and
// Steinke 2020 / Balle et al. 2020:
//
//   epsilon = min over orders a of  rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1)
#pragma once

#include <cstdint>
#include <vector>

namespace decent_dp {

struct Bucket;

struct PrivacyOptions {
  double clip_norm = 0;         // C; 0: the mechanism is off
  double noise_multiplier = 0;  // sigma >= 0 (0: clipping only, no guarantee)
  uint64_t seed = 0;
  bool enabled() const { return clip_norm > 0; }
};

namespace privacy {

// Throws InvalidArgument naming the field unless C >= 0 (finite), sigma >= 0 (finite).
void check(const PrivacyOptions& options, const char* who);

// Clips and noises `bucket`'s gradient block in place (its parameters' views only);
// `total_numel`: N, the parameter elements of every bucket.
void privatize(Bucket& bucket, const PrivacyOptions& options, int rank, int64_t update,
               int64_t total_numel);

// The accountant's orders: 1.25 to 10.75 in steps of 0.25 (fractional), then 11 to 256.
std::vector<double> default_orders();

// RDP of one step of the Poisson-subsampled Gaussian mechanism with sampling rate q in
// [0, 1] and noise multiplier sigma (> 0) at order `alpha` (> 1; infinity allowed).
double rdp_sampled_gaussian(double q, double sigma, double alpha);

struct Epsilon {
  double epsilon = 0;
  double order = 0;  // the order that gave it
};
// (epsilon, delta) of `steps` compositions of the sampled Gaussian; delta in (0, 1).
Epsilon epsilon(double q, double sigma, int64_t steps, double delta,
                const std::vector<double>& orders = default_orders());
// The conversion alone, for RDP values `rdp` at `orders`.
Epsilon epsilon_from_rdp(const std::vector<double>& orders, const std::vector<double>& rdp,
                         double delta);

// The noise multiplier per training example for the batch-level clip (see the note).
inline double per_example_multiplier(double sigma) {
  return sigma / 2;
}

}  // namespace privacy
}  // namespace decent_dp
