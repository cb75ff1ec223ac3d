#include "decent_dp/optim/sgd.h"

#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/empty_like.h>
#include <torch/serialize/archive.h>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace optim {
namespace {

void check_options(const SGDOptions& o) {
  DECENT_DP_CHECK_ARG(o.lr() >= 0, "SGD: lr must be >= 0, got ", o.lr());
  DECENT_DP_CHECK_ARG(o.momentum() >= 0, "SGD: momentum must be >= 0, got ", o.momentum());
  DECENT_DP_CHECK_ARG(o.weight_decay() >= 0, "SGD: weight_decay must be >= 0, got ",
                      o.weight_decay());
  DECENT_DP_CHECK_ARG(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                      "SGD: nesterov needs momentum > 0 and dampening = 0, got momentum ",
                      o.momentum(), " and dampening ", o.dampening());
}

// float16 and bfloat16 on the CPU are left to ATen operations: the CPU _fused_sgd_ of torch
// 2.11 (and of 2.12 and 2.13, pytorch/pytorch#191763) leaves the elements of their vectorized
// blocks unchanged, and its momentum path writes wrong buffers; tests/unit/test_optim.cpp
// ("bfloat16 and float16 parameters step as the float32 formula, rounded") catches it.
bool fused_kernel_supports(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf) {
  const auto dtype = p.scalar_type();
  const bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
  return (p.device().is_cuda() || (p.device().is_cpu() && !reduced)) && p.is_contiguous() &&
         g.is_contiguous() && (!buf.defined() || buf.is_contiguous()) && g.scalar_type() == dtype &&
         (dtype == at::kFloat || dtype == at::kDouble || reduced);
}

// torch::optim::SGD's update with ATen operations. Returns the (new) momentum buffer.
at::Tensor sgd_composite(const at::Tensor& p, const at::Tensor& grad, at::Tensor buf,
                         const SGDOptions& o) {
  at::Tensor d_p = grad;
  if (o.weight_decay() != 0) {
    d_p = d_p.add(p, o.weight_decay());
  }
  if (o.momentum() != 0) {
    if (!buf.defined()) {
      buf = d_p.clone().detach();
    } else {
      buf.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
    }
    d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
  }
  p.add_(d_p, -o.lr());
  return buf;
}

}  // namespace

void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
}

void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
}

void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  const at::Tensor& b = momentum_buffer();
  if (b.defined()) {
    const bool owns = b.storage_offset() == 0 && b.storage().nbytes() == b.nbytes();
    archive.write("momentum_buffer", c10::IValue(owns ? b : b.clone()));
  }
}

void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
}

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : Optimizer(param_groups, std::make_unique<SGDOptions>(defaults)) {
  check_options(defaults);
}

SGDParamState& SGD::state_of(const at::Tensor& p) {
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) {
    slot = std::make_unique<SGDParamState>();
  }
  return static_cast<SGDParamState&>(*slot);
}

at::Tensor SGD::step(LossClosure closure) {
  const at::Tensor loss = evaluate_closure(closure);
  torch::NoGradGuard no_grad;
  last_flat_groups_ = 0;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto& o = static_cast<const SGDOptions&>(group.options());
    check_options(o);
    std::vector<at::Tensor> params, grads;
    params_with_grads(group.params(), "SGD", params, grads);
    if (params.empty()) {
      continue;
    }
    const bool momentum = o.momentum() != 0;
    std::vector<SGDParamState*> states;
    for (const auto& p : params) {
      states.push_back(&state_of(p));
    }
    FlatCache::Entry* flat = flat_.lookup(gi, params, grads);
    if (flat != nullptr) {
      ++last_flat_groups_;
      const FlatLayout& l = flat->layout;
      bool first = false;
      if (momentum) {
        // The buffer starts as the first gradient: the first step is "first" unless a
        // buffer exists for the parameters (this optimizer's, or one loaded from an archive).
        first = !states[0]->momentum_buffer().defined();
        std::vector<std::vector<at::Tensor*>> slots(1);
        for (auto* s : states) {
          slots[0].push_back(&s->momentum_buffer());
        }
        flat->blocks.resize(1);
        bind_flat_state(l, params, flat->blocks, slots);
      }
      if (!l.grads.defined()) {
        // Gradients where autograd put them (Note [gradients in place]): the parameter and
        // momentum views with them, one fused call for the group; a dense layout shared by
        // a parameter, its gradient and its buffer (channels-last, say) in memory order.
        std::vector<at::Tensor> fp, fg, bufs;
        bool fused_ok = true;
        for (size_t i = 0; fused_ok && i < params.size(); ++i) {
          const at::Tensor& p = params[i];
          const at::Tensor buf = momentum ? states[i]->momentum_buffer() : at::Tensor();
          fused_ok = dense_alike(grads[i], p) && (!momentum || dense_alike(buf, p));
          if (fused_ok) {
            fp.push_back(memory_order(p));
            fg.push_back(memory_order(grads[i]));
            if (momentum) {
              bufs.push_back(memory_order(buf));
            }
            fused_ok =
                fused_kernel_supports(fp.back(), fg.back(), momentum ? bufs.back() : at::Tensor());
          }
        }
        if (fused_ok) {
          at::_fused_sgd_(fp, fg, bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                          o.nesterov(), /*maximize=*/false, first);
        } else {
          for (size_t i = 0; i < params.size(); ++i) {
            const at::Tensor& buf = momentum ? states[i]->momentum_buffer() : at::Tensor();
            const at::Tensor next =
                sgd_composite(params[i], grads[i], first ? at::Tensor() : buf, o);
            if (momentum && first) {
              buf.copy_(next);
            }
          }
        }
        continue;
      }
      if (fused_kernel_supports(l.params, l.grads, momentum ? flat->blocks[0] : at::Tensor())) {
        at::_fused_sgd_({l.params}, {l.grads},
                        momentum ? at::TensorList(flat->blocks) : at::TensorList(),
                        o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                        /*maximize=*/false, first);
      } else {
        at::Tensor buf = momentum && !first ? flat->blocks[0] : at::Tensor();
        buf = sgd_composite(l.params, l.grads, buf, o);
        if (momentum && first) {
          flat->blocks[0].copy_(buf);
        }
      }
      continue;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      SGDParamState& s = *states[i];
      const at::Tensor& p = params[i];
      if (fused_kernel_supports(p, grads[i], s.momentum_buffer())) {
        const bool first = momentum && !s.momentum_buffer().defined();
        if (first) {
          s.momentum_buffer(at::empty_like(p));
        }
        std::vector<at::Tensor> bufs;
        if (momentum) {
          bufs.push_back(s.momentum_buffer());
        }
        at::_fused_sgd_({p}, {grads[i]}, bufs, o.weight_decay(), o.momentum(), o.lr(),
                        o.dampening(), o.nesterov(), /*maximize=*/false, first);
      } else {
        at::Tensor buf = sgd_composite(p, grads[i], s.momentum_buffer(), o);
        if (momentum) {
          s.momentum_buffer(buf);
        }
      }
    }
  }
  return loss;
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
  flat_.clear();
}

}  // namespace optim
}  // namespace decent_dp
