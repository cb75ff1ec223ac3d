#include "decent_dp/optim/adam.h"

#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>

#include "decent_dp/errors.h"
#include "decent_dp/optim/accum_adam_kernel.h"

namespace decent_dp {
namespace optim {
namespace {

// A tensor that owns exactly its elements: a view into a flat block would otherwise write
// the whole block into the archive once per parameter.
at::Tensor compact(const at::Tensor& t) {
  if (!t.defined() || (t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes())) {
    return t;
  }
  return t.clone();
}

template <typename Options>
void check_options(const Options& o, const char* name) {
  DECENT_DP_CHECK_ARG(o.lr() >= 0, name, ": lr must be >= 0, got ", o.lr());
  DECENT_DP_CHECK_ARG(o.eps() >= 0, name, ": eps must be >= 0, got ", o.eps());
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  DECENT_DP_CHECK_ARG(b1 >= 0 && b1 < 1, name, ": betas[0] must be in [0, 1), got ", b1);
  DECENT_DP_CHECK_ARG(b2 >= 0 && b2 < 1, name, ": betas[1] must be in [0, 1), got ", b2);
  DECENT_DP_CHECK_ARG(o.weight_decay() >= 0, name, ": weight_decay must be >= 0, got ",
                      o.weight_decay());
}

template <typename Options>
int64_t accum_iter_of(const Options& o) {
  if constexpr (std::is_same<Options, AccumAdamOptions>::value ||
                std::is_same<Options, AccumAdamWOptions>::value) {
    return o.accum_iter();
  } else {
    return 1;
  }
}

constexpr const char* variant_name(AdamVariant v) {
  switch (v) {
    case AdamVariant::kAdam:
      return "Adam";
    case AdamVariant::kAdamW:
      return "AdamW";
    case AdamVariant::kAccumAdam:
      return "AccumAdam";
    case AdamVariant::kAccumAdamW:
      return "AccumAdamW";
  }
  return "?";
}

// Note [float16 Adam state]: the moments live in the parameters' dtype, as in torch's fused
// kernels. The second moment, (1 - beta2) g^2 after a first step, falls under float16's
// smallest value (6e-8) for |g| < sqrt(6e-8 / (1 - beta2)) and is stored as 0 or nearly, so
// that element moves by about lr * m / eps instead of lr. Said once per process.
void warn_float16_state(const char* variant, double beta2, double eps) {
  TORCH_WARN_ONCE(variant,
                  " steps float16 parameters with its moments in float16: the second moment "
                  "underflows for gradients under ",
                  std::sqrt(6e-8 / (1 - beta2)),
                  " in magnitude, and those elements then move by about lr * m / eps (eps = ", eps,
                  "); train float32 parameters under autocast, or bfloat16 parameters");
}

// Contiguity aside: the callers pass contiguous tensors or memory-order views of alike ones.
bool fused_kernel_supports(const at::Tensor& p, const at::Tensor& g) {
  const auto dtype = p.scalar_type();
  return (p.device().is_cpu() || p.device().is_cuda()) && g.scalar_type() == dtype &&
         (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
          dtype == at::kBFloat16);
}

// torch::optim::Adam / AdamW with ATen operations, for tensors the fused kernels do not take.
void adam_composite(const at::Tensor& p, const at::Tensor& grad, const at::Tensor& m,
                    const at::Tensor& v, int64_t t, double lr, double b1, double b2, double wd,
                    double eps, bool decoupled) {
  at::Tensor g = grad;
  if (wd != 0) {
    if (decoupled) {
      p.mul_(1 - lr * wd);
    } else {
      g = grad.add(p, wd);
    }
  }
  const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(t));
  m.mul_(b1).add_(g, 1 - b1);
  v.mul_(b2).addcmul_(g, g, 1 - b2);
  const at::Tensor denom = v.sqrt().div_(std::sqrt(bc2)).add_(eps);
  p.addcdiv_(m, denom, -lr / bc1);
}

}  // namespace

// ---- options and state serialization ----

#define DECENT_DP_ADAM_SERIALIZE(Name, extra_write, extra_read)          \
  void Name::serialize(torch::serialize::OutputArchive& archive) const { \
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);                                \
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);                             \
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);                               \
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);                      \
    extra_write                                                          \
  }                                                                      \
  void Name::serialize(torch::serialize::InputArchive& archive) {        \
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);                      \
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);                  \
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);                     \
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);            \
    extra_read                                                           \
  }

DECENT_DP_ADAM_SERIALIZE(AdamOptions, , )
DECENT_DP_ADAM_SERIALIZE(AdamWOptions, , )
DECENT_DP_ADAM_SERIALIZE(AccumAdamOptions, _TORCH_OPTIM_SERIALIZE_TORCH_ARG(accum_iter);
                         , _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, accum_iter);)
DECENT_DP_ADAM_SERIALIZE(AccumAdamWOptions, _TORCH_OPTIM_SERIALIZE_TORCH_ARG(accum_iter);
                         , _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, accum_iter);)
#undef DECENT_DP_ADAM_SERIALIZE

void AdamFamilyParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"exp_avg", exp_avg()},
                                {"exp_avg_sq", exp_avg_sq()},
                                {"accum", accum()}}) {
    if (t.defined()) {
      archive.write(name, c10::IValue(compact(t)));
    }
  }
}

void AdamFamilyParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, accum);
}

// ---- the optimizer ----

template <typename Options, AdamVariant kVariant>
AdamFamily<Options, kVariant>::AdamFamily(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults)
    : Optimizer(param_groups, std::make_unique<Options>(defaults)) {
  check_options(defaults, variant_name(kVariant));
  DECENT_DP_CHECK_ARG(accum_iter_of(defaults) >= 1, variant_name(kVariant),
                      ": accum_iter must be >= 1, got ", accum_iter_of(defaults));
}

template <typename Options, AdamVariant kVariant>
AdamFamilyParamState& AdamFamily<Options, kVariant>::state_of(const at::Tensor& p) {
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) {
    slot = std::make_unique<AdamFamilyParamState>();
  }
  return static_cast<AdamFamilyParamState&>(*slot);
}

template <typename Options, AdamVariant kVariant>
at::Tensor AdamFamily<Options, kVariant>::step(LossClosure closure) {
  const at::Tensor loss = evaluate_closure(closure);
  torch::NoGradGuard no_grad;
  last_flat_groups_ = 0;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto& options = static_cast<const Options&>(group.options());
    check_options(options, variant_name(kVariant));
    std::vector<at::Tensor> params, grads;
    params_with_grads(group.params(), variant_name(kVariant), params, grads);
    if (params.empty()) {
      continue;
    }
    if (std::any_of(params.begin(), params.end(),
                    [](const at::Tensor& p) { return p.scalar_type() == at::kHalf; })) {
      warn_float16_state(variant_name(kVariant), std::get<1>(options.betas()), options.eps());
    }
    step_group(options, params, grads, flat_.lookup(gi, params, grads));
  }
  return loss;
}

template <typename Options, AdamVariant kVariant>
void AdamFamily<Options, kVariant>::step_group(const Options& o,
                                               const std::vector<at::Tensor>& params,
                                               const std::vector<at::Tensor>& grads,
                                               FlatCache::Entry* flat) {
  constexpr bool kAccum =
      kVariant == AdamVariant::kAccumAdam || kVariant == AdamVariant::kAccumAdamW;
  constexpr bool kDecoupled =
      kVariant == AdamVariant::kAdamW || kVariant == AdamVariant::kAccumAdamW;
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  AccumAdamStep accum_step;
  accum_step.lr = o.lr();
  accum_step.beta1 = b1;
  accum_step.beta2 = b2;
  accum_step.eps = o.eps();
  accum_step.weight_decay = o.weight_decay();
  accum_step.decoupled = kDecoupled;
  accum_step.accum_iter = accum_iter_of(o);

  auto fused = [&](at::TensorList p, at::TensorList g, at::TensorList m, at::TensorList v,
                   at::TensorList steps) {
    if constexpr (kDecoupled) {
      at::_fused_adamw_(p, g, m, v, {}, steps, o.lr(), b1, b2, o.weight_decay(), o.eps(),
                        /*amsgrad=*/false, /*maximize=*/false);
    } else {
      at::_fused_adam_(p, g, m, v, {}, steps, o.lr(), b1, b2, o.weight_decay(), o.eps(),
                       /*amsgrad=*/false, /*maximize=*/false);
    }
  };

  std::vector<AdamFamilyParamState*> states;
  states.reserve(params.size());
  for (const auto& p : params) {
    states.push_back(&state_of(p));
  }

  at::Tensor shared_step;  // the fused kernels' step for the views of a flat group
  int64_t shared_t = -1;   // its value
  if (flat != nullptr) {
    // Note [flat parameter groups]: per-parameter state is views into flat blocks; with
    // flat gradients one pass over the block.
    ++last_flat_groups_;
    std::vector<std::vector<at::Tensor*>> slots(kAccum ? 3 : 2);
    for (auto* s : states) {
      slots[0].push_back(&s->exp_avg());
      slots[1].push_back(&s->exp_avg_sq());
      if (kAccum) {
        slots[2].push_back(&s->accum());
      }
    }
    flat->blocks.resize(slots.size());
    bind_flat_state(flat->layout, params, flat->blocks, slots);
    const int64_t t = states[0]->step() + 1;
    const FlatLayout& l = flat->layout;
    if (!flat->step.defined()) {
      flat->step = at::full({}, 0.0, l.params.options().dtype(at::kFloat));
    }
    flat->step.fill_(static_cast<double>(t));
    if (l.grads.defined()) {
      for (auto* s : states) {
        s->step(t);
      }
      if constexpr (kAccum) {
        accum_step.step = t;
        accum_adam_step(l.params, l.grads, flat->blocks[0], flat->blocks[1], flat->blocks[2],
                        accum_step);
      } else if (fused_kernel_supports(l.params, l.grads)) {
        fused({l.params}, {l.grads}, {flat->blocks[0]}, {flat->blocks[1]}, {flat->step});
      } else {
        adam_composite(l.params, l.grads, flat->blocks[0], flat->blocks[1], t, o.lr(), b1, b2,
                       o.weight_decay(), o.eps(), kDecoupled);
      }
      return;
    }
    // Gradients where autograd put them (Note [gradients in place]): the loop below steps
    // the parameter and state views with them, one fused call for the group.
    shared_step = flat->step;
    shared_t = t;
  }

  // Tensor by tensor.
  std::vector<at::Tensor> fp, fg, fm, fv, fs;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    AdamFamilyParamState& s = *states[i];
    if (!s.exp_avg().defined()) {
      s.exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s.exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    }
    if (kAccum && !s.accum().defined()) {
      s.accum(at::zeros_like(p, at::MemoryFormat::Preserve));
    }
    const int64_t t = s.step() + 1;
    s.step(t);
    // A dense layout shared by the parameter, its gradient and its state (channels-last,
    // say) steps in memory order, where the single-pass kernels apply.
    const bool alike = dense_alike(grads[i], p) && dense_alike(s.exp_avg(), p) &&
                       dense_alike(s.exp_avg_sq(), p) && (!kAccum || dense_alike(s.accum(), p));
    auto flat_if_alike = [alike](const at::Tensor& x) { return alike ? memory_order(x) : x; };
    if constexpr (kAccum) {
      accum_step.step = t;
      accum_adam_step(flat_if_alike(p), flat_if_alike(grads[i]), flat_if_alike(s.exp_avg()),
                      flat_if_alike(s.exp_avg_sq()), flat_if_alike(s.accum()), accum_step);
    } else if (alike && fused_kernel_supports(p, grads[i])) {
      fp.push_back(memory_order(p));
      fg.push_back(memory_order(grads[i]));
      fm.push_back(memory_order(s.exp_avg()));
      fv.push_back(memory_order(s.exp_avg_sq()));
      fs.push_back(t == shared_t
                       ? shared_step
                       : at::full({}, static_cast<double>(t), p.options().dtype(at::kFloat)));
    } else {
      adam_composite(p, grads[i], s.exp_avg(), s.exp_avg_sq(), t, o.lr(), b1, b2, o.weight_decay(),
                     o.eps(), kDecoupled);
    }
  }
  // The fused kernels take one device and dtype per call.
  while (!fp.empty()) {
    std::vector<at::Tensor> p1, g1, m1, v1, s1, p2, g2, m2, v2, s2;
    for (size_t i = 0; i < fp.size(); ++i) {
      const bool same =
          fp[i].device() == fp[0].device() && fp[i].scalar_type() == fp[0].scalar_type();
      (same ? p1 : p2).push_back(fp[i]);
      (same ? g1 : g2).push_back(fg[i]);
      (same ? m1 : m2).push_back(fm[i]);
      (same ? v1 : v2).push_back(fv[i]);
      (same ? s1 : s2).push_back(fs[i]);
    }
    fused(p1, g1, m1, v1, s1);
    fp.swap(p2);
    fg.swap(g2);
    fm.swap(m2);
    fv.swap(v2);
    fs.swap(s2);
  }
}

template <typename Options, AdamVariant kVariant>
void AdamFamily<Options, kVariant>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamFamilyParamState, Options>(archive, *this);
}

template <typename Options, AdamVariant kVariant>
void AdamFamily<Options, kVariant>::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<AdamFamilyParamState, Options>(archive, *this);
  // Loaded state is per tensor; the next step copies it into fresh flat blocks.
  flat_.clear();
}

template class AdamFamily<AdamOptions, AdamVariant::kAdam>;
template class AdamFamily<AdamWOptions, AdamVariant::kAdamW>;
template class AdamFamily<AccumAdamOptions, AdamVariant::kAccumAdam>;
template class AdamFamily<AccumAdamWOptions, AdamVariant::kAccumAdamW>;

}  // namespace optim
}  // namespace decent_dp
