// Per-coordinate order statistics of k rows, for the robust aggregators (trimmed mean,
// median): Note [sorting network].
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace decent_dp {
namespace detail {

// The compare-exchange pairs (i, j), i < j, of Batcher's odd-even merge sort on k inputs,
// in the order they are applied: after all of them, any k values are ascending. Cached per k.
const std::vector<std::pair<int, int>>& sorting_network(int k);

// The widest group the network path takes; larger groups sort with ATen.
constexpr int kMaxNetworkRows = 64;

// For each coordinate c < n of the k rows (row m at rows + m * stride), sorts the k values
// ascending (NaN after every number, as ATen's sort does) and writes
//   out[c] = (sum of the sorted values at positions lo, ..., hi - 1) / divisor,
// summed in ascending position. 0 <= lo < hi <= k <= kMaxNetworkRows.
void sorted_range_sum(const float* rows, int64_t stride, int k, int64_t n, int lo, int hi,
                      float divisor, float* out);
void sorted_range_sum(const double* rows, int64_t stride, int k, int64_t n, int lo, int hi,
                      double divisor, double* out);

}  // namespace detail
}  // namespace decent_dp
