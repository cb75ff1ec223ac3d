#include "decent_dp/global_averager.h"

#include <ATen/ops/full.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <memory>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

// Labels name the operation in messages and in the operation header (Note [operation header]
// in detail/op_header.h), so a rank that averages alone is told so instead of pairing with
// a peer's exchange.
const AllreduceOptions kWorldMean{ReduceOp::kAvg, {}, {}, "global average"};
const AllreduceOptions kConsensusMean{ReduceOp::kAvg, {}, {}, "consensus distance"};

}  // namespace

double GlobalAverager::global_avg(BucketSet& buckets, const ParamBinding& binding,
                                  Communicator& comm, const std::vector<at::Tensor>& buffers,
                                  bool will_revert, bool return_d2c) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> blocks;
  for (Bucket& b : buckets) {
    binding.load_block(b);
    blocks.push_back(b.storage.params);
  }
  backup_params_.clear();
  backup_buffers_.clear();
  std::vector<at::Tensor> local;
  if (will_revert || return_d2c) {
    for (auto& x : blocks) {
      local.push_back(x.clone());
    }
  }
  has_backup_ = will_revert;
  if (will_revert) {
    backup_params_ = local;
    for (const auto& buf : buffers) {
      backup_buffers_.push_back(buf.clone());
    }
  }
  std::vector<std::shared_ptr<Work>> works;
  for (auto& x : blocks) {
    works.push_back(comm.allreduce(x, x, kWorldMean));
  }
  std::vector<at::Tensor> staged;
  for (const auto& buf : buffers) {
    staged.push_back(buf.contiguous());
    works.push_back(comm.allreduce(staged.back(), staged.back(), kWorldMean));
  }
  for (auto& w : works) {
    w->wait();
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!staged[i].is_same(buffers[i])) {
      buffers[i].copy_(staged[i]);
    }
  }
  for (Bucket& b : buckets) {
    binding.store_block(b);
    if (!will_revert) {
      b.work.reset();  // training continues from the mean: pending exchanges are dropped
    }
  }
  double d2 = 0.0;
  if (return_d2c) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      d2 += local[i].sub(blocks[i]).pow(2).sum().item<double>();
    }
  }
  return std::sqrt(d2);
}

void GlobalAverager::revert(BucketSet& buckets, const ParamBinding& binding,
                            const std::vector<at::Tensor>& buffers) {
  DECENT_DP_CHECK_ARG(has_backup_,
                      "revert_global_avg: there is no backup to restore; call "
                      "global_avg(will_revert = true) first");
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets.size(); ++b) {
    buckets[b].storage.params.copy_(backup_params_[b]);
    binding.store_block(buckets[b]);
  }
  for (size_t i = 0; i < buffers.size() && i < backup_buffers_.size(); ++i) {
    buffers[i].copy_(backup_buffers_[i]);
  }
  backup_params_.clear();
  backup_buffers_.clear();
  has_backup_ = false;
}

double GlobalAverager::consensus_distance(BucketSet& buckets, const ParamBinding& binding,
                                          Communicator& comm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> locals, means;
  std::vector<std::shared_ptr<Work>> works;
  for (Bucket& b : buckets) {
    binding.load_block(b);
    locals.push_back(b.storage.params);
    means.push_back(b.storage.params.clone());
    works.push_back(comm.allreduce(means.back(), means.back(), kConsensusMean));
  }
  for (auto& w : works) {
    w->wait();
  }
  double d2 = 0.0;
  for (size_t i = 0; i < locals.size(); ++i) {
    d2 += locals[i].to(at::kDouble).sub(means[i].to(at::kDouble)).pow(2).sum().item<double>();
  }
  if (locals.empty()) {
    return 0.0;  // no buckets yet (before the first backward), on every rank alike
  }
  // On the blocks' device: the data communicator takes that device's tensors only.
  auto total = at::full({1}, d2, at::TensorOptions().dtype(at::kDouble).device(locals[0].device()));
  comm.allreduce(total, total, kConsensusMean)->wait();
  return total.item<double>();
}

}  // namespace decent_dp
