#include "decent_dp/optim/accum_adam_kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/sqrt.h>

#include <cmath>

namespace decent_dp {
namespace optim {
namespace {

// Note [AccumAdam step] (spec §8), per element, with K = accum_iter and r = ceil(t / K):
//   AdamW: p *= 1 - lr*wd          Adam: g += wd*p
//   acc += g / K
//   m_hat = m + (1-b1) g,  v_hat = v + (1-b2) g^2
//   p -= (lr / (1 - b1^r)) * m_hat / (sqrt(v_hat) / sqrt(1 - b2^r) + eps)
//   if t % K == 0: m = b1 (m + (1-b1) acc), v = b2 (v + (1-b2) acc^2), acc = 0
struct Coefficients {
  double step_size, inv_bc2_sqrt, b1, b2, eps, wd, decay, inv_k;
  bool boundary, decoupled;
};

// Elements [begin, end) of one pass.
template <typename scalar_t>
inline void accum_adam_range(scalar_t* __restrict p, const scalar_t* __restrict g,
                             scalar_t* __restrict m, scalar_t* __restrict v,
                             scalar_t* __restrict acc, int64_t begin, int64_t end,
                             const Coefficients& c) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t b1 = static_cast<opmath_t>(c.b1);
  const opmath_t b2 = static_cast<opmath_t>(c.b2);
  const opmath_t one_minus_b1 = 1 - b1;
  const opmath_t one_minus_b2 = 1 - b2;
  const opmath_t step_size = static_cast<opmath_t>(c.step_size);
  const opmath_t inv_bc2_sqrt = static_cast<opmath_t>(c.inv_bc2_sqrt);
  const opmath_t eps = static_cast<opmath_t>(c.eps);
  const opmath_t wd = static_cast<opmath_t>(c.wd);
  const opmath_t decay = static_cast<opmath_t>(c.decay);
  const opmath_t inv_k = static_cast<opmath_t>(c.inv_k);
  for (int64_t i = begin; i < end; ++i) {
    opmath_t pi = static_cast<opmath_t>(p[i]);
    opmath_t gi = static_cast<opmath_t>(g[i]);
    if (c.decoupled) {
      pi *= decay;
    } else {
      gi += wd * pi;
    }
    const opmath_t ai = static_cast<opmath_t>(acc[i]) + gi * inv_k;
    const opmath_t mi = static_cast<opmath_t>(m[i]);
    const opmath_t vi = static_cast<opmath_t>(v[i]);
    const opmath_t m_hat = mi + one_minus_b1 * gi;
    const opmath_t v_hat = vi + one_minus_b2 * gi * gi;
    pi -= step_size * m_hat / (std::sqrt(v_hat) * inv_bc2_sqrt + eps);
    p[i] = static_cast<scalar_t>(pi);
    if (c.boundary) {
      m[i] = static_cast<scalar_t>(b1 * (mi + one_minus_b1 * ai));
      v[i] = static_cast<scalar_t>(b2 * (vi + one_minus_b2 * ai * ai));
      acc[i] = static_cast<scalar_t>(0);
    } else {
      acc[i] = static_cast<scalar_t>(ai);
    }
  }
}

// float32, the common case, is also built for AVX2 and AVX-512; the loader picks the best
// the CPU supports.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(DECENT_DP_NO_MULTIVERSION)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void accum_adam_range_float(float* __restrict p, const float* __restrict g, float* __restrict m,
                            float* __restrict v, float* __restrict acc, int64_t begin,
                            int64_t end, const Coefficients& c) {
  accum_adam_range<float>(p, g, m, v, acc, begin, end, c);
}

template <typename scalar_t>
void accum_adam_cpu(scalar_t* p, const scalar_t* g, scalar_t* m, scalar_t* v, scalar_t* acc,
                    int64_t n, const AccumAdamStep& s) {
  const int64_t r = (s.step + s.accum_iter - 1) / s.accum_iter;
  Coefficients c;
  c.step_size = s.lr / (1.0 - std::pow(s.beta1, static_cast<double>(r)));
  c.inv_bc2_sqrt = 1.0 / std::sqrt(1.0 - std::pow(s.beta2, static_cast<double>(r)));
  c.b1 = s.beta1;
  c.b2 = s.beta2;
  c.eps = s.eps;
  c.wd = s.weight_decay;
  c.decay = 1.0 - s.lr * s.weight_decay;
  c.inv_k = 1.0 / static_cast<double>(s.accum_iter);
  c.boundary = s.step % s.accum_iter == 0;
  c.decoupled = s.decoupled;
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same<scalar_t, float>::value) {
      accum_adam_range_float(p, g, m, v, acc, begin, end, c);
    } else {
      accum_adam_range<scalar_t>(p, g, m, v, acc, begin, end, c);
    }
  });
}

// The same formula with ATen operations, for any device.
void accum_adam_generic(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                        const at::Tensor& v, const at::Tensor& acc, const AccumAdamStep& s) {
  const int64_t r = (s.step + s.accum_iter - 1) / s.accum_iter;
  at::Tensor g = grad;
  if (s.weight_decay != 0) {
    if (s.decoupled) {
      param.mul_(1 - s.lr * s.weight_decay);
    } else {
      g = grad.add(param, s.weight_decay);
    }
  }
  acc.add_(g, 1.0 / static_cast<double>(s.accum_iter));
  const at::Tensor m_hat = m.add(g, 1 - s.beta1);
  const at::Tensor v_hat = v.addcmul(g, g, 1 - s.beta2);
  const at::Tensor denom =
      v_hat.sqrt().mul_(1.0 / std::sqrt(1.0 - std::pow(s.beta2, r))).add_(s.eps);
  param.addcdiv_(m_hat, denom, -s.lr / (1.0 - std::pow(s.beta1, r)));
  if (s.step % s.accum_iter == 0) {
    m.add_(acc, 1 - s.beta1).mul_(s.beta1);
    v.addcmul_(acc, acc, 1 - s.beta2).mul_(s.beta2);
    acc.zero_();
  }
}

}  // namespace

void accum_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& accum,
                     const AccumAdamStep& s) {
  const bool cpu_contiguous =
      param.device().is_cpu() && param.is_contiguous() && grad.is_contiguous() &&
      exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() && accum.is_contiguous() &&
      grad.scalar_type() == param.scalar_type() && exp_avg.scalar_type() == param.scalar_type();
  if (!cpu_contiguous) {
    accum_adam_generic(param, grad, exp_avg, exp_avg_sq, accum, s);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "accum_adam", [&] {
    accum_adam_cpu<scalar_t>(param.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(),
                             exp_avg.data_ptr<scalar_t>(), exp_avg_sq.data_ptr<scalar_t>(),
                             accum.data_ptr<scalar_t>(), param.numel(), s);
  });
}

}  // namespace optim
}  // namespace decent_dp
