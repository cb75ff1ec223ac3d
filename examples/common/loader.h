// Feeding one rank: which samples it sees in each epoch (Sharder), what is done to them
// (Transform: augmentation and normalization) and a background thread that prepares the next
// batches while the current step runs (BatchLoader).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "examples/common/data.h"

namespace decent_dp {
namespace examples {

// Splits a data set of N samples over `world` ranks, epoch by epoch. Every rank constructs it
// with the same arguments and gets the same answers.
//   IID (alpha <= 0): each epoch one permutation of all samples, drawn from (seed, epoch), is
//     cut into `world` disjoint shards of N / world samples (the N mod world left over go
//     unused that epoch; a different few each epoch).
//   non-IID (alpha > 0): once, each class's samples are dealt to the ranks in proportions drawn
//     from Dirichlet(alpha) (seeded: the same split on every rank), so small alpha gives each
//     rank few classes. Each epoch a rank walks its own part in a fresh seeded order, cycling
//     as needed, for N / world samples: every rank takes the same number of steps.
class Sharder {
 public:
  Sharder(const at::Tensor& labels, int64_t num_classes, int world, uint64_t seed,
          double alpha = 0);

  int64_t samples_per_rank() const { return per_rank_; }
  // The sample indices of `rank` in `epoch`, in the order to visit them.
  std::vector<int64_t> indices(int rank, int64_t epoch) const;
  // Non-IID: the samples dealt to `rank` (its whole part); IID: empty.
  const std::vector<int64_t>& part(int rank) const { return parts_.at(rank); }
  bool iid() const { return alpha_ <= 0; }

 private:
  int64_t n_;
  int world_;
  uint64_t seed_;
  double alpha_;
  int64_t per_rank_;
  std::vector<std::vector<int64_t>> parts_;
};

// What turns a batch of uint8 images into the model's input.
struct Transform {
  bool random_crop = false;  // pad by `pad` zeros on each side, crop back at a random offset
  int64_t pad = 4;
  bool horizontal_flip = false;  // with probability 1/2
  std::vector<double> mean;      // per channel, on the [0, 1] scale; empty: no normalization
  std::vector<double> stdev;
};

// Applies `t` to uint8 images [B, C, H, W]; float32 result. The random choices come from
// `gen`, so equal generator states give equal batches.
at::Tensor apply_transform(const at::Tensor& images, const Transform& t, at::Generator& gen);

struct Batch {
  at::Tensor x;  // float32 [B, C, H, W]
  at::Tensor y;  // int64 [B]
};

// Serves the batches of one pass over `indices` (batch `batch_size`, the last partial batch
// dropped when `drop_last`) from a thread that keeps up to `depth` batches ready. The
// transform's random choices come from a generator seeded with `seed`.
class BatchLoader {
 public:
  BatchLoader(const Dataset& data, std::vector<int64_t> indices, int64_t batch_size,
              Transform transform, uint64_t seed, bool drop_last = true, size_t depth = 3);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  int64_t batches() const { return batches_; }
  // The next batch; false after the last. Rethrows an error of the loading thread.
  bool next(Batch& out);
  // Seconds next() spent waiting for a batch that was not ready yet.
  double wait_seconds() const { return wait_seconds_; }

 private:
  void run();

  const Dataset& data_;
  std::vector<int64_t> indices_;
  int64_t batch_size_;
  Transform transform_;
  uint64_t seed_;
  int64_t batches_;
  size_t depth_;
  int64_t served_ = 0;
  double wait_seconds_ = 0;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace examples
}  // namespace decent_dp
