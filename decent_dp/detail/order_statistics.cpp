#include "decent_dp/detail/order_statistics.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>

#include "decent_dp/detail/multiversion.h"

namespace decent_dp {
namespace detail {

// Note [sorting network]
// The trimmed mean and the median need, per coordinate, the order statistics of the k
// values a group's members sent. Sorting each coordinate's k values (ATen's sort along dim 0)
// is a data-dependent scalar loop per coordinate: about 190 ms per step for a 0.42M-parameter
// model at k = 8 on one core. A sorting network instead applies the same fixed list of
// compare-exchanges to every coordinate, so each compare-exchange is an element-wise min and
// max of two rows: branch-free, vectorized across coordinates. Batcher's odd-even merge sort
// takes 19 compare-exchanges for k = 8 and 543 for k = 64 (about k log2(k)^2 / 4); a network
// for a k that is not a power of two is the one for the next power of two without the
// comparators that touch an index >= k (those inputs would be +inf and never move).
//
// The coordinates are processed in tiles of kTile columns: the k rows of a tile are copied
// into a k x kTile scratch (the rows are not ours to reorder: row `self` is the rank's own
// parameters), the network runs there in cache, and the selected positions are summed into
// `out`. A NaN must sort after every number, like ATen's sort (a NaN sent by a faulty member
// is then one of the b largest values a trimmed mean drops): the compare-exchange keeps
// (a, b) when a <= b or b is NaN, and swaps otherwise.

const std::vector<std::pair<int, int>>& sorting_network(int k) {
  static std::mutex mu;
  static std::array<std::vector<std::pair<int, int>>, kMaxNetworkRows + 1> cache;
  static std::array<bool, kMaxNetworkRows + 1> made{};
  std::lock_guard<std::mutex> lock(mu);
  if (!made[k]) {
    std::vector<std::pair<int, int>>& net = cache[k];
    for (int p = 1; p < k; p <<= 1) {
      for (int d = p; d >= 1; d >>= 1) {
        for (int j = d % p; j + d < k; j += 2 * d) {
          for (int i = 0; i < d && i + j + d < k; ++i) {
            if ((i + j) / (2 * p) == (i + j + d) / (2 * p)) {
              net.emplace_back(i + j, i + j + d);
            }
          }
        }
      }
    }
    made[k] = true;
  }
  return cache[k];
}

namespace {

constexpr int64_t kTile = 256;

// One tile: the network over k rows of kTile values, then the sum of rows lo..hi-1 into acc.
// Written once per type (GCC's target_clones takes no templates).
#define DECENT_DP_NETWORK_TILE(T)                                                        \
  DECENT_DP_MULTIVERSION void network_tile(T* tile, const std::pair<int, int>* net,      \
                                           size_t comparators, int lo, int hi, T* acc) { \
    for (size_t p = 0; p < comparators; ++p) {                                           \
      T* __restrict a = tile + static_cast<size_t>(net[p].first) * kTile;                \
      T* __restrict b = tile + static_cast<size_t>(net[p].second) * kTile;               \
      for (int64_t c = 0; c < kTile; ++c) {                                              \
        const T x = a[c];                                                                \
        const T y = b[c];                                                                \
        const bool keep = x <= y || y != y;                                              \
        a[c] = keep ? x : y;                                                             \
        b[c] = keep ? y : x;                                                             \
      }                                                                                  \
    }                                                                                    \
    std::memcpy(acc, tile + static_cast<size_t>(lo) * kTile, kTile * sizeof(T));         \
    for (int m = lo + 1; m < hi; ++m) {                                                  \
      const T* __restrict v = tile + static_cast<size_t>(m) * kTile;                     \
      for (int64_t c = 0; c < kTile; ++c) {                                              \
        acc[c] += v[c];                                                                  \
      }                                                                                  \
    }                                                                                    \
  }
DECENT_DP_NETWORK_TILE(float)
DECENT_DP_NETWORK_TILE(double)
#undef DECENT_DP_NETWORK_TILE

template <typename T>
void sorted_range_sum_impl(const T* rows, int64_t stride, int k, int64_t n, int lo, int hi,
                           T divisor, T* out) {
  const std::vector<std::pair<int, int>>& net = sorting_network(k);
  std::vector<T> scratch(static_cast<size_t>(k) * kTile + kTile);
  T* tile = scratch.data();
  T* acc = tile + static_cast<size_t>(k) * kTile;
  for (int64_t c0 = 0; c0 < n; c0 += kTile) {
    const int64_t w = std::min(kTile, n - c0);
    for (int m = 0; m < k; ++m) {
      T* row = tile + static_cast<size_t>(m) * kTile;
      std::memcpy(row, rows + m * stride + c0, static_cast<size_t>(w) * sizeof(T));
      if (w < kTile) {
        std::fill(row + w, row + kTile, T(0));  // the last tile's tail: sorted, never read
      }
    }
    network_tile(tile, net.data(), net.size(), lo, hi, acc);
    for (int64_t c = 0; c < w; ++c) {
      out[c0 + c] = acc[c] / divisor;
    }
  }
}

}  // namespace

void sorted_range_sum(const float* rows, int64_t stride, int k, int64_t n, int lo, int hi,
                      float divisor, float* out) {
  sorted_range_sum_impl(rows, stride, k, n, lo, hi, divisor, out);
}

void sorted_range_sum(const double* rows, int64_t stride, int k, int64_t n, int lo, int hi,
                      double divisor, double* out) {
  sorted_range_sum_impl(rows, stride, k, n, lo, hi, divisor, out);
}

}  // namespace detail
}  // namespace decent_dp
