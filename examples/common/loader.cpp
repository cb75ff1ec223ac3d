#include "examples/common/loader.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>

#include <chrono>
#include <random>
#include <stdexcept>
#include <string>

namespace decent_dp {
namespace examples {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t seed_of(uint64_t seed, uint64_t a, uint64_t b = 0) {
  return mix(mix(mix(seed) ^ a) ^ b);
}

// Fisher-Yates with an unbiased multiply-shift draw: the same order on every platform.
void shuffle(std::vector<int64_t>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    const auto j = static_cast<size_t>((static_cast<unsigned __int128>(rng()) * i) >> 64);
    std::swap(v[i - 1], v[j]);
  }
}

}  // namespace

Sharder::Sharder(const at::Tensor& labels, int64_t num_classes, int world, uint64_t seed,
                 double alpha)
    : n_(labels.numel()), world_(world), seed_(seed), alpha_(alpha) {
  if (world < 1)
    throw std::invalid_argument("Sharder: world must be >= 1, got " + std::to_string(world));
  per_rank_ = n_ / world;
  if (per_rank_ < 1)
    throw std::invalid_argument("Sharder: " + std::to_string(n_) + " samples cannot feed " +
                                std::to_string(world) + " ranks, expected at least one each");
  parts_.resize(world);
  if (alpha <= 0)
    return;
  const auto lab = labels.to(at::kLong).contiguous();
  const int64_t* l = lab.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by_class(num_classes);
  for (int64_t i = 0; i < n_; ++i) {
    if (l[i] < 0 || l[i] >= num_classes)
      throw std::invalid_argument("Sharder: label " + std::to_string(l[i]) + " of sample " +
                                  std::to_string(i) + " outside [0, " +
                                  std::to_string(num_classes - 1) + "]");
    by_class[l[i]].push_back(i);
  }
  std::mt19937_64 rng(seed_of(seed, 0xD1D1));
  std::gamma_distribution<double> gamma(alpha, 1.0);
  for (auto& members : by_class) {
    shuffle(members, rng);
    std::vector<double> p(world);
    double total = 0;
    for (auto& x : p)
      total += (x = gamma(rng));
    // Cut the class at the cumulative proportions.
    double acc = 0;
    size_t begin = 0;
    for (int r = 0; r < world; ++r) {
      acc += p[r] / total;
      const size_t end = r == world - 1 ? members.size()
                                        : std::min(members.size(),
                                                   static_cast<size_t>(acc * members.size() + 0.5));
      parts_[r].insert(parts_[r].end(), members.begin() + begin, members.begin() + end);
      begin = std::max(begin, end);
    }
  }
  for (int r = 0; r < world; ++r) {
    if (parts_[r].empty())
      throw std::invalid_argument("Sharder: the non-IID split with alpha " + std::to_string(alpha) +
                                  " left rank " + std::to_string(r) +
                                  " without samples; expected a larger alpha");
  }
}

std::vector<int64_t> Sharder::indices(int rank, int64_t epoch) const {
  if (rank < 0 || rank >= world_)
    throw std::invalid_argument("Sharder: rank must be in [0, " + std::to_string(world_ - 1) +
                                "], got " + std::to_string(rank));
  if (iid()) {
    std::vector<int64_t> perm(n_);
    for (int64_t i = 0; i < n_; ++i)
      perm[i] = i;
    std::mt19937_64 rng(seed_of(seed_, static_cast<uint64_t>(epoch)));
    shuffle(perm, rng);
    return {perm.begin() + rank * per_rank_, perm.begin() + (rank + 1) * per_rank_};
  }
  std::mt19937_64 rng(
      seed_of(seed_, static_cast<uint64_t>(epoch), static_cast<uint64_t>(rank) + 1));
  std::vector<int64_t> out;
  out.reserve(per_rank_);
  std::vector<int64_t> order = parts_[rank];
  while (static_cast<int64_t>(out.size()) < per_rank_) {
    shuffle(order, rng);
    const size_t take = std::min(order.size(), static_cast<size_t>(per_rank_) - out.size());
    out.insert(out.end(), order.begin(), order.begin() + take);
  }
  return out;
}

at::Tensor apply_transform(const at::Tensor& images, const Transform& t, at::Generator& gen) {
  at::Tensor x = images.to(at::kFloat).div_(255.0);
  const int64_t b = x.size(0), h = x.size(2), w = x.size(3);
  if (t.random_crop && t.pad > 0) {
    const auto padded = at::constant_pad_nd(x, {t.pad, t.pad, t.pad, t.pad}, 0.0);
    const auto offsets = at::randint(0, 2 * t.pad + 1, {b, 2}, gen, at::kLong);
    const int64_t* o = offsets.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i) {
      x[i].copy_(padded[i].narrow(1, o[2 * i], h).narrow(2, o[2 * i + 1], w));
    }
  }
  if (t.horizontal_flip) {
    const auto coins = at::rand({b}, gen);
    const float* c = coins.data_ptr<float>();
    for (int64_t i = 0; i < b; ++i) {
      if (c[i] < 0.5f)
        x[i].copy_(x[i].flip({2}));
    }
  }
  if (!t.mean.empty()) {
    if (static_cast<int64_t>(t.mean.size()) != x.size(1) || t.stdev.size() != t.mean.size())
      throw std::invalid_argument(
          "Transform: mean and stdev need one value per channel (" + std::to_string(x.size(1)) +
          "), got " + std::to_string(t.mean.size()) + " and " + std::to_string(t.stdev.size()));
    for (int64_t c = 0; c < x.size(1); ++c)
      x.select(1, c).sub_(t.mean[c]).div_(t.stdev[c]);
  }
  return x;
}

BatchLoader::BatchLoader(const Dataset& data, std::vector<int64_t> indices, int64_t batch_size,
                         Transform transform, uint64_t seed, bool drop_last, size_t depth)
    : data_(data),
      indices_(std::move(indices)),
      batch_size_(batch_size),
      transform_(std::move(transform)),
      seed_(seed),
      depth_(std::max<size_t>(depth, 1)) {
  if (batch_size < 1)
    throw std::invalid_argument("BatchLoader: batch_size must be >= 1, got " +
                                std::to_string(batch_size));
  const auto n = static_cast<int64_t>(indices_.size());
  batches_ = drop_last ? n / batch_size : (n + batch_size - 1) / batch_size;
  thread_ = std::thread([this] { run(); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BatchLoader::run() {
  try {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_);
    for (int64_t b = 0; b < batches_; ++b) {
      const int64_t begin = b * batch_size_;
      const int64_t count = std::min<int64_t>(batch_size_, indices_.size() - begin);
      auto idx = at::from_blob(indices_.data() + begin, {count}, at::kLong);
      Batch batch;
      batch.x = apply_transform(data_.images.index_select(0, idx), transform_, gen);
      batch.y = data_.labels.index_select(0, idx);
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || ready_.size() < depth_; });
      if (stop_)
        return;
      ready_.push_back(std::move(batch));
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

bool BatchLoader::next(Batch& out) {
  if (served_ >= batches_)
    return false;
  std::unique_lock<std::mutex> lock(mutex_);
  if (ready_.empty() && !error_) {
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [this] { return !ready_.empty() || error_; });
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (ready_.empty() && error_)
    std::rethrow_exception(error_);
  out = std::move(ready_.front());
  ready_.pop_front();
  ++served_;
  cv_.notify_all();
  return true;
}

}  // namespace examples
}  // namespace decent_dp
