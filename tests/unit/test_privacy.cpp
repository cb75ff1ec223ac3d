// The RDP accountant of the sampled Gaussian mechanism (Note [differential privacy]) against
// published reference values. Source of the values: the test suite of Google's
// dp_accounting package (github.com/google/differential-privacy, python/dp_accounting,
// rdp/rdp_privacy_accountant_test.py: test_compute_rdp_poisson_sampled_gaussian,
// test_compute_epsilon_delta_pure_dp, test_compute_epsilon_delta_gaussian), which checks its
// log A_alpha against multi-precision numerical integration.
#include "torch_catch.h"

#include <cmath>
#include <limits>
#include <vector>

#include "decent_dp/errors.h"
#include "decent_dp/privacy.h"

namespace privacy = decent_dp::privacy;

TEST_CASE("RDP of the Poisson-sampled Gaussian: q = 0.01, sigma = 2.5, 50 steps", "[privacy]") {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> orders = {1.5, 2.5, 5, 50, 100, inf};
  // The published values, to their five digits (so rtol 1e-4 as in the source).
  const std::vector<double> expected = {6.5007e-04, 1.0854e-03, 2.1808e-03,
                                        2.3846e-02, 1.6742e+02, inf};
  for (size_t k = 0; k < orders.size(); ++k) {
    INFO("order " << orders[k]);
    const double rdp = 50 * privacy::rdp_sampled_gaussian(0.01, 2.5, orders[k]);
    if (std::isinf(expected[k])) {
      CHECK(std::isinf(rdp));
    } else {
      CHECK(std::abs(rdp - expected[k]) <= 1e-4 * expected[k]);
    }
  }
}

TEST_CASE("RDP at small sigma: the fractional series against numerical integration", "[privacy]") {
  // q = 0.0625, sigma = 0.75 (the trainer test's setting). Reference: log A_alpha / (alpha - 1)
  // with A_alpha = E_{z ~ N(0, s^2)} [((1 - q) + q exp((2z - 1) / (2 s^2)))^alpha] integrated
  // numerically (scipy.integrate.quad over [-40, 40] in log space, relative tolerance 1e-12).
  // dp_accounting 0.6.0's series gives 0.030107778 at order 2.5 (0.9% high) and does not
  // converge at 1.5: it stops when both terms fall below e^-30, which happens here before
  // the index passes the order; this series runs past the order first.
  const double orders[] = {1.5, 2.5, 3.25, 2.0, 3.0};
  const double expected[] = {0.012038885821870087, 0.029843254379218375, 0.06708759597336737,
                             0.019023730248863845, 0.049624136957056135};
  for (size_t k = 0; k < 5; ++k) {
    INFO("order " << orders[k]);
    const double rdp = privacy::rdp_sampled_gaussian(0.0625, 0.75, orders[k]);
    CHECK(std::abs(rdp - expected[k]) <= 1e-10 * expected[k]);
  }
}

TEST_CASE("RDP to (epsilon, delta): pure DP and the Gaussian mechanism", "[privacy]") {
  // A constant RDP curve is pure DP: the largest order wins.
  std::vector<double> orders, rdp;
  for (int a = 2; a <= 32; ++a) {
    orders.push_back(a);
    rdp.push_back(1.1);
  }
  const auto pure = privacy::epsilon_from_rdp(orders, rdp, 1e-5);
  CHECK(std::abs(pure.epsilon - 1.32783806176) < 1e-9);
  CHECK(pure.order == 32);
  // Without sampling, sigma = 4.530877117 is exactly (1, 1e-6)-DP.
  std::vector<double> fine;
  for (int i = 1000; i < 100000; ++i) {
    fine.push_back(0.001 * i);
  }
  fine.erase(fine.begin());  // order 1 itself is not an RDP order
  const auto gauss = privacy::epsilon(1.0, 4.530877117, 1, 1e-6, fine);
  CHECK(std::abs(gauss.epsilon - 1.0) < 1e-6);
}

TEST_CASE("the accountant: integer and fractional orders agree, and epsilon behaves", "[privacy]") {
  // The two series meet: orders just around an integer give about its value.
  for (double q : {1e-3, 0.01, 0.1, 0.5}) {
    for (double sigma : {0.7, 1.0, 4.0}) {
      INFO("q " << q << " sigma " << sigma);
      const double at3 = privacy::rdp_sampled_gaussian(q, sigma, 3);
      const double below = privacy::rdp_sampled_gaussian(q, sigma, 3 - 1e-7);
      const double above = privacy::rdp_sampled_gaussian(q, sigma, 3 + 1e-7);
      CHECK(std::abs(below - at3) <= 1e-5 * at3);
      CHECK(std::abs(above - at3) <= 1e-5 * at3);
      CHECK(below <= above);
    }
  }
  // More steps, a higher sampling rate or less noise cost more; nothing sampled costs 0.
  const double base = privacy::epsilon(0.01, 1.1, 1000, 1e-5).epsilon;
  CHECK(base > 0);
  CHECK(privacy::epsilon(0.01, 1.1, 2000, 1e-5).epsilon > base);
  CHECK(privacy::epsilon(0.02, 1.1, 1000, 1e-5).epsilon > base);
  CHECK(privacy::epsilon(0.01, 2.0, 1000, 1e-5).epsilon < base);
  CHECK(privacy::epsilon(0.0, 1.1, 1000, 1e-5).epsilon == 0);
  CHECK(privacy::epsilon(0.01, 1.1, 0, 1e-5).epsilon == 0);
  CHECK(std::isinf(privacy::epsilon(0.01, 0.0, 10, 1e-5).epsilon));
  // Subsampling amplifies: far below the unsampled mechanism's epsilon for the same steps.
  CHECK(base < privacy::epsilon(1.0, 1.1, 1000, 1e-5).epsilon / 10);
}

TEST_CASE("the accountant refuses bad inputs, naming them", "[privacy]") {
  using decent_dp::InvalidArgument;
  CHECK_THROWS_WITH(privacy::rdp_sampled_gaussian(1.5, 1, 2), Catch::Contains("sampling rate q"));
  CHECK_THROWS_WITH(privacy::rdp_sampled_gaussian(0.1, -1, 2), Catch::Contains("noise multiplier"));
  CHECK_THROWS_WITH(privacy::rdp_sampled_gaussian(0.1, 1, 1),
                    Catch::Contains("orders must be > 1"));
  CHECK_THROWS_WITH(privacy::epsilon(0.1, 1, 10, 0), Catch::Contains("delta must be in (0, 1)"));
  CHECK_THROWS_WITH(privacy::epsilon(0.1, 1, -1, 1e-5), Catch::Contains("steps must be >= 0"));
  decent_dp::PrivacyOptions o;
  o.noise_multiplier = 1;
  CHECK_THROWS_WITH(privacy::check(o, "W"), Catch::Contains("needs privacy.clip_norm > 0"));
  o.clip_norm = -1;
  CHECK_THROWS_WITH(privacy::check(o, "W"), Catch::Contains("privacy.clip_norm must be"));
}
