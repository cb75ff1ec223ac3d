// Image data sets of the examples, read from their real files:
//   fashion-mnist  the IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-*),
//                  gzip-compressed (.gz) or not; Debian's dataset-fashion-mnist package puts
//                  them under /usr/share/datasets/fashion-mnist (the default folder)
//   cifar10        the binary version: data_batch_1.bin .. data_batch_5.bin, test_batch.bin
//   cifar100       the binary version: train.bin, test.bin (fine labels)
//   synthetic      learnable classes made in memory (class prototypes plus noise), for tests
// A missing, truncated or malformed file raises DataError naming the file and what was
// expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace decent_dp {
namespace examples {

class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Dataset {
  std::string name;
  at::Tensor images;  // uint8 [N, C, H, W]
  at::Tensor labels;  // int64 [N], in [0, num_classes)
  int64_t num_classes = 0;

  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t image_size() const { return images.size(2); }
};

// The names load_dataset() accepts.
const std::vector<std::string>& dataset_names();
// Where a data set is looked for when no folder is given ("" when it has none).
std::string default_data_dir(const std::string& name);

// The training (`train`) or test split of data set `name` from `dir` ("" = the default
// folder). CIFAR folders may also be the ones their archives unpack into
// (cifar-10-batches-bin/, cifar-100-binary/) or the folder holding them.
Dataset load_dataset(const std::string& name, const std::string& dir, bool train);

Dataset read_fashion_mnist(const std::string& dir, bool train);
Dataset read_cifar10(const std::string& dir, bool train);
Dataset read_cifar100(const std::string& dir, bool train);
// One IDX image file (magic 0x803, [N, H, W] bytes) and its label file (magic 0x801),
// gzip-compressed or not.
Dataset read_idx(const std::string& images_path, const std::string& labels_path,
                 int64_t num_classes, const std::string& name);

// `n` images of `channels` x `side` x `side` in `classes` classes: each class is a fixed
// random prototype (seeded by `seed`), each sample its prototype plus noise. The training
// and test splits of one seed share prototypes and differ in noise.
Dataset make_synthetic(int64_t n, int64_t classes, int64_t channels, int64_t side, uint64_t seed,
                       bool train);

// The first `n` samples (all when n <= 0 or n >= size).
Dataset take(const Dataset& data, int64_t n);

// ---- attack emulation: label flipping ----

// The class map of a label-flipping attack on `num_classes` classes: "reverse" sends
// l -> C - 1 - l; "permutation" a permutation seeded by `seed` that moves every class (no
// l -> l; the same map on every rank for one seed). Throws std::invalid_argument naming
// the mode otherwise.
std::vector<int64_t> flip_map(const std::string& mode, int64_t num_classes, uint64_t seed);
// data.labels[i] <- map[data.labels[i]] (a new labels tensor; images are shared).
Dataset flip_labels(const Dataset& data, const std::vector<int64_t>& map);
// The attacking ranks of a world of `world` ranks: the ranks listed in `ranks` ("2,5",
// each in [0, world)), or, when it is empty, round(fraction * world) ranks drawn with
// `seed` (the same on every rank). Sorted. Throws std::invalid_argument naming the flag.
std::vector<int> attacking_ranks(int world, const std::string& ranks, double fraction,
                                 uint64_t seed);

// Per-channel mean and standard deviation of the images, scaled to [0, 1].
std::pair<std::vector<double>, std::vector<double>> channel_stats(const Dataset& data);

}  // namespace examples
}  // namespace decent_dp
