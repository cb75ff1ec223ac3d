// Global averaging of a wrapper's buckets (spec §5): every rank's parameters (and, when
// asked, floating buffers) replaced by the mean over all ranks, with an exact revert, and
// the consensus distance.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "decent_dp/bucket_set.h"
#include "decent_dp/communicator.h"

namespace decent_dp {

class GlobalAverager {
 public:
  // Collective. The buckets' exchanges in flight must have been waited for. With
  // will_revert, a backup of the local state is kept for revert(); without it, pending
  // exchanges are dropped (training continues from the mean). Returns this rank's L2
  // distance to the mean with return_d2c, else 0.
  double global_avg(BucketSet& buckets, const ParamBinding& binding, Communicator& comm,
                    const std::vector<at::Tensor>& buffers, bool will_revert, bool return_d2c);
  // Restores the state global_avg(will_revert = true) saved; `buffers` as passed there.
  void revert(BucketSet& buckets, const ParamBinding& binding,
              const std::vector<at::Tensor>& buffers);
  bool has_backup() const { return has_backup_; }
  // Collective: mean over ranks of ||x_i - mean||^2, the same value on every rank.
  static double consensus_distance(BucketSet& buckets, const ParamBinding& binding,
                                   Communicator& comm);

 private:
  std::vector<at::Tensor> backup_params_;
  std::vector<at::Tensor> backup_buffers_;
  bool has_backup_ = false;
};

}  // namespace decent_dp
