#include "torch_catch.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include "decent_dp/detail/progress_engine.h"
#include "decent_dp/detail/shm.h"
#include "decent_dp/errors.h"
#include "decent_dp/topology/topology.h"
#include "mpi_test_util.h"

using namespace decent_dp;
using decent_dp::testing::comm;

namespace {

// Input of rank r at element i: (r + 1) * (i % 3 + 1). Small integers, so every partial sum
// is exact even in bfloat16 (8 bits of mantissa) for up to 8 ranks.
double input_value(int rank, int64_t i) {
  return (rank + 1.0) * static_cast<double>(i % 3 + 1);
}

at::Tensor make_input(int rank, int64_t n, at::ScalarType dtype) {
  auto t = at::arange(n, at::TensorOptions().dtype(at::kDouble));
  t = t.remainder(3).add(1).mul(rank + 1).to(dtype);
  return t.contiguous();
}

// The closed-form result of reducing make_input over `ranks`, computed the way the
// backend's kAvg does: exact sum, then one division in the tensor's dtype (float opmath).
template <typename T>
T expected_value(const std::vector<int>& ranks, int64_t i, ReduceOp op) {
  double sum = 0.0;
  for (int r : ranks) {
    sum += input_value(r, i);
  }
  if (op == ReduceOp::kSum) {
    return static_cast<T>(sum);
  }
  if (std::is_same<T, double>::value) {
    return static_cast<T>(sum / static_cast<double>(ranks.size()));
  }
  return static_cast<T>(static_cast<float>(sum) / static_cast<float>(ranks.size()));
}

template <typename T>
int64_t count_wrong(const at::Tensor& t, const std::vector<int>& ranks, ReduceOp op) {
  const T* p = t.data_ptr<T>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const T want = expected_value<T>(ranks, i, op);
    if (!(static_cast<double>(p[i]) == static_cast<double>(want))) {
      ++wrong;
    }
  }
  return wrong;
}

int64_t count_wrong_any(const at::Tensor& t, const std::vector<int>& ranks, ReduceOp op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return count_wrong<float>(t, ranks, op);
    case at::kDouble:
      return count_wrong<double>(t, ranks, op);
    case at::kBFloat16:
      return count_wrong<c10::BFloat16>(t, ranks, op);
    case at::kHalf:
      return count_wrong<c10::Half>(t, ranks, op);
    case at::kInt:
      return count_wrong<int32_t>(t, ranks, op);
    case at::kLong:
      return count_wrong<int64_t>(t, ranks, op);
    default:
      return -1;
  }
}

bool torch_equal_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

bool is_power_of_two(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

std::vector<std::unique_ptr<topology::Topology>> topologies_for(int n) {
  std::vector<std::unique_ptr<topology::Topology>> out;
  out.push_back(topology::make_topology("complete", n, 1));
  if (n % 2 == 0 || n == 1)
    out.push_back(topology::make_topology("ring", n, 1));
  if (is_power_of_two(n))
    out.push_back(topology::make_topology("exp", n, 1));
  for (int lws = 2; lws <= n; ++lws) {
    if (n % lws == 0 && is_power_of_two(n / lws) && n / lws >= 2) {
      out.push_back(topology::make_topology("aer", n, lws));
    }
  }
  return out;
}

// Checks that every rank holds the same bytes in `t`.
void check_same_bytes_everywhere(Communicator& c, const at::Tensor& t) {
  const int n = c.size();
  auto bytes = t.view(at::kByte).clone();
  auto gathered = at::empty({bytes.numel() * n}, at::kByte);
  c.allgather(gathered, bytes)->wait();
  for (int r = 1; r < n; ++r) {
    INFO("rank " << r << " vs rank 0, dtype " << t.scalar_type());
    CHECK(gathered.narrow(0, r * bytes.numel(), bytes.numel())
              .equal(gathered.narrow(0, 0, bytes.numel())));
  }
}

}  // namespace

TEST_CASE("ranks and local ranks", "[mpi]") {
  auto& c = comm();
  CHECK(c.rank() >= 0);
  CHECK(c.rank() < c.size());
  CHECK(c.local_size() >= 1);
  CHECK(c.local_rank() < c.local_size());
  CHECK(c.backend() == Backend::kMpi);
  // All ranks of this test run on one node.
  CHECK(c.local_size() == c.size());
  CHECK(c.local_rank() == c.rank());
}

TEST_CASE("group all-reduce matches closed forms for every slot of every topology", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  for (const auto& topo : topologies_for(n)) {
    c.make_groups(topo->distinct_groups());
    for (int s = 0; s < topo->period(); ++s) {
      const auto& group = topo->group_of(c.rank(), s);
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4099}}) {
            INFO("rank " << c.rank() << " topology " << topo->name() << " lws "
                         << topo->local_world_size() << " slot " << s << " group "
                         << ranks_to_string(group.ranks) << " dtype " << dtype << " op "
                         << to_string(op) << " numel " << numel);
            auto t = make_input(c.rank(), numel, dtype);
            c.allreduce(t, group.ranks, op)->wait();
            CHECK(count_wrong_any(t, group.ranks, op) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("integer sums and a large odd-sized tensor", "[mpi]") {
  auto& c = comm();
  std::vector<int> all(c.size());
  for (int r = 0; r < c.size(); ++r)
    all[r] = r;
  for (auto dtype : {at::kInt, at::kLong}) {
    auto t = make_input(c.rank(), 1001, dtype);
    c.allreduce(t, all, ReduceOp::kSum)->wait();
    CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
  }
  auto big = make_input(c.rank(), (int64_t{1} << 21) + 13, at::kFloat);
  c.allreduce(big, all, ReduceOp::kAvg)->wait();
  CHECK(count_wrong_any(big, all, ReduceOp::kAvg) == 0);
}

TEST_CASE("many outstanding works waited in a different order than launched", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  auto ring = topology::make_topology(n % 2 == 0 || n == 1 ? "ring" : "complete", n, 1);
  c.make_groups(ring->distinct_groups());
  std::vector<at::Tensor> tensors;
  std::vector<std::vector<int>> groups;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 24; ++i) {
    groups.push_back(ring->group_of(c.rank(), i).ranks);
    tensors.push_back(make_input(c.rank(), 1000 + 37 * i, i % 2 ? at::kFloat : at::kBFloat16));
    works.push_back(c.allreduce(tensors.back(), groups.back(), ReduceOp::kAvg));
  }
  // Reverse order, then the odd ones before the even ones.
  for (int i = 23; i >= 0; i -= 2)
    works[i]->wait();
  for (int i = 22; i >= 0; i -= 2)
    works[i]->wait();
  for (int i = 0; i < 24; ++i) {
    INFO("rank " << c.rank() << " work " << i << ": " << works[i]->description());
    CHECK(works[i]->is_completed());
    CHECK(count_wrong_any(tensors[i], groups[i], ReduceOp::kAvg) == 0);
  }
}

TEST_CASE("communication progresses while the caller computes", "[mpi]") {
  // Nobody calls into MPI or wait() here: only the progress thread can complete the work.
  auto& c = comm();
  std::vector<int> all(c.size());
  for (int r = 0; r < c.size(); ++r)
    all[r] = r;
  auto t = make_input(c.rank(), int64_t{4} << 20, at::kFloat);  // 16 MiB
  auto work = c.allreduce(t, all, ReduceOp::kSum);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  volatile double sink = 0.0;
  while (!work->is_completed() && std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 100000; ++i)
      sink = sink + i * 0.5;  // "compute"
  }
  CHECK(work->is_completed());
  work->wait();
  CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
}

TEST_CASE("broadcast, allgather and barrier", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  for (int root = 0; root < n; ++root) {
    auto t = c.rank() == root ? at::arange(17, at::kFloat).add(root) : at::zeros({17}, at::kFloat);
    c.broadcast(t, root)->wait();
    const float* p = t.data_ptr<float>();
    for (int i = 0; i < 17; ++i) {
      CHECK(p[i] == static_cast<float>(i + root));
    }
  }
  auto in = at::full({3}, static_cast<int64_t>(c.rank() * 10), at::kLong);
  auto out = at::empty({3 * n}, at::kLong);
  c.allgather(out, in)->wait();
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < 3; ++i) {
      CHECK(out.data_ptr<int64_t>()[r * 3 + i] == r * 10);
    }
  }
  c.barrier();
}

TEST_CASE("a rank that does not join makes the others time out with a clear error", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  if (n < 2) {
    return;
  }
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  const auto timeout = std::chrono::milliseconds(1000);
  auto t = make_input(c.rank(), 64, at::kFloat);
  if (c.rank() == n - 1) {
    // Joins only after every other rank has given up waiting.
    std::this_thread::sleep_for(timeout * 3);
    c.allreduce(t, all, ReduceOp::kSum)->wait();
  } else {
    auto work = c.allreduce(t, all, ReduceOp::kSum);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_MATCHES(
        work->wait(timeout), TimeoutError,
        Catch::Matchers::Predicate<TimeoutError>([&](const TimeoutError& e) {
          const std::string m = e.what();
          return m.find("allreduce(sum, 64 x Float) on group " + ranks_to_string(all)) !=
                     std::string::npos &&
                 m.find("did not complete within the timeout of 1000 ms") != std::string::npos;
        }));
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK(waited < timeout * 2);
    // The late rank joins eventually and the collective completes.
    work->wait();
  }
  CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
}

TEST_CASE("bad input gets one clear error", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  auto strided = at::zeros({4, 6}, at::kFloat).t();
  CHECK_THROWS_MATCHES(c.allreduce(strided, all, ReduceOp::kSum), InvalidArgument,
                       Catch::Matchers::Predicate<InvalidArgument>([](const InvalidArgument& e) {
                         return std::string(e.what()).find(
                                    "allreduce: tensor must be contiguous; got sizes [6, 4] "
                                    "strides [1, 6]") != std::string::npos;
                       }));
  auto meta = at::empty({4}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  CHECK_THROWS_WITH(c.allreduce(meta, all, ReduceOp::kSum),
                    Catch::Contains("the MPI backend takes CPU tensors; tensor is on meta"));
  CHECK_THROWS_WITH(
      c.allreduce(at::zeros({4}, at::kBool), all, ReduceOp::kSum),
      Catch::Contains("float32, float64, bfloat16, float16, int32 or int64; got Bool"));
  CHECK_THROWS_WITH(c.allreduce(at::zeros({4}, at::kInt), all, ReduceOp::kAvg),
                    Catch::Contains("kAvg needs a floating-point tensor"));
  CHECK_THROWS_WITH(c.allreduce(at::Tensor(), all, ReduceOp::kSum),
                    Catch::Contains("tensor must be a defined tensor"));
  CHECK_THROWS_WITH(c.broadcast(at::zeros({4}), n), Catch::Contains("root must be in [0, "));
  CHECK_THROWS_WITH(c.allgather(at::zeros({3}), at::zeros({4})),
                    Catch::Contains("output must hold world size * input.numel()"));
  if (n >= 2) {
    CHECK_THROWS_WITH(c.make_groups({{1, 0}}), Catch::Contains("ascending order"));
  }
  CHECK_THROWS_WITH(c.make_groups({{0, n}}), Catch::Contains("names rank " + std::to_string(n)));
  if (n >= 3) {
    // A group this rank belongs to but that was never created.
    std::vector<int> pair = {c.rank(), (c.rank() + 2) % n};
    std::sort(pair.begin(), pair.end());
    if (!c.has_group(pair)) {
      CHECK_THROWS_WITH(c.allreduce(at::zeros({2}), pair, ReduceOp::kSum),
                        Catch::Contains("create it first with make_groups()"));
    }
    CHECK_THROWS_WITH(c.allreduce(at::zeros({2}), {(c.rank() + 1) % n}, ReduceOp::kSum),
                      Catch::Contains("contain this rank"));
  }
}

TEST_CASE("make_groups rejects lists that differ across ranks", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  if (n < 2) {
    return;
  }
  std::vector<std::vector<int>> groups = {{0, 1}};
  if (c.rank() == 1) {
    groups.push_back({0, 1});
  }
  CHECK_THROWS_WITH(c.make_groups(groups),
                    Catch::Contains("passed a different list of groups than rank 0"));
}

TEST_CASE("make_groups honours the timeout when a rank arrives late", "[mpi]") {
  MpiOptions o;
  o.timeout = std::chrono::milliseconds(500);
  MpiCommunicator c(o);
  if (c.size() < 2) {
    return;
  }
  std::vector<std::vector<int>> groups = {{0, 1}};
  if (c.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    c.make_groups(groups);
  } else {
    // It used to block inside MPI_Allgather, past any timeout, until rank 1 came.
    CHECK_THROWS_AS(c.make_groups(groups), TimeoutError);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  }
  c.barrier();  // the late rank arrives; everyone's make_groups completes behind the scenes
}

TEST_CASE("every member of a group ends with bit-identical results", "[mpi]") {
  // Inexact inputs: the sum depends on the order of additions, so this fails if members
  // reduce in different orders.
  auto& c = comm();
  const int n = c.size();
  auto topo = topology::make_topology("complete", n, 1);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto t = at::arange(10007, at::kDouble).mul(0.001 * (c.rank() + 1)).sin().to(dtype);
    std::vector<int> all(n);
    for (int r = 0; r < n; ++r)
      all[r] = r;
    c.allreduce(t, all, ReduceOp::kAvg)->wait();
    check_same_bytes_everywhere(c, t);
  }
}

TEST_CASE("out-of-place all-reduce leaves the input alone", "[mpi]") {
  auto& c = comm();
  const int n = c.size();
  auto topo = topology::make_topology(n % 2 == 0 ? "ring" : "complete", n, 1);
  c.make_groups(topo->distinct_groups());
  for (int s = 0; s < topo->period(); ++s) {
    const auto& group = topo->group_of(c.rank(), s);
    for (int64_t numel : {int64_t{1}, int64_t{1000}, int64_t{77777}}) {
      auto in = make_input(c.rank(), numel, at::kFloat);
      const auto before = in.clone();
      auto out = at::full({numel}, -1.0f, at::kFloat);
      c.allreduce(in, out, group.ranks, ReduceOp::kAvg)->wait();
      CHECK(torch_equal_bytes(in, before));
      CHECK(count_wrong_any(out, group.ranks, ReduceOp::kAvg) == 0);
    }
  }
  CHECK_THROWS_WITH(c.allreduce(at::zeros({4}), at::zeros({5}), {c.rank()}, ReduceOp::kSum),
                    Catch::Contains("output must have the input's dtype and size"));
}

namespace {

MpiOptions shm_options(int shared, int64_t min_bytes) {
  MpiOptions o;
  o.timeout = std::chrono::seconds(60);
  o.shared_memory = shared;
  o.shared_memory_min_bytes = min_bytes;
  return o;
}

at::Tensor shared_copy(Communicator& c, const at::Tensor& t) {
  auto s = c.allocate(t.numel(), t.options());
  s.copy_(t);
  return s;
}

}  // namespace

namespace {

// One all-reduce of `bytes` over all n ranks since `before`: summed over the ranks, the traffic
// counters grow by 2 (n-1) * bytes in each direction, whatever the transport.
void check_traffic(MpiCommunicator& c, const MpiStats& before, size_t bytes) {
  const auto now = c.stats();
  auto t = at::empty({2}, at::kLong);
  t.data_ptr<int64_t>()[0] =
      static_cast<int64_t>(now.allreduce_bytes_sent - before.allreduce_bytes_sent);
  t.data_ptr<int64_t>()[1] =
      static_cast<int64_t>(now.allreduce_bytes_received - before.allreduce_bytes_received);
  std::vector<int> all(c.size());
  for (int r = 0; r < c.size(); ++r)
    all[r] = r;
  c.allreduce(t, all, ReduceOp::kSum)->wait();
  const int64_t expected = 2 * (c.size() - 1) * static_cast<int64_t>(bytes);
  INFO("rank " << c.rank() << ": bytes sent and received over all ranks");
  CHECK(t.data_ptr<int64_t>()[0] == expected);
  CHECK(t.data_ptr<int64_t>()[1] == expected);
}

}  // namespace

TEST_CASE("shared-memory all-reduce: closed forms, in and out of place, every group", "[mpi]") {
  // Every size goes through shared memory on this communicator (no minimum).
  MpiCommunicator c(shm_options(1, 0));
  const int n = c.size();
  auto probe = c.allocate(5, at::kFloat);
  std::string name;
  uint64_t offset = 0;
  CHECK(probe.numel() == 5);
  CHECK(probe.abs().sum().item<double>() == 0.0);
  // One rank alone keeps private memory: there is no one to share with.
  CHECK(detail::find_shared(probe.data_ptr(), probe.nbytes(), name, offset) == (n > 1));
  for (const auto& topo : topologies_for(n)) {
    c.make_groups(topo->distinct_groups());
    for (int s = 0; s < topo->period(); ++s) {
      const auto& group = topo->group_of(c.rank(), s);
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
        const bool integral = dtype == at::kInt || dtype == at::kLong;
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          if (integral && op == ReduceOp::kAvg)
            continue;
          for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4099}}) {
            INFO("rank " << c.rank() << " topology " << topo->name() << " slot " << s << " group "
                         << ranks_to_string(group.ranks) << " dtype " << dtype << " op "
                         << to_string(op) << " numel " << numel);
            auto t = shared_copy(c, make_input(c.rank(), numel, dtype));
            c.allreduce(t, group.ranks, op)->wait();
            CHECK(count_wrong_any(t, group.ranks, op) == 0);
            auto in = shared_copy(c, make_input(c.rank(), numel, dtype));
            const auto before = in.clone();
            auto out = c.allocate(numel, in.options());
            c.allreduce(in, out, group.ranks, op)->wait();
            CHECK(torch_equal_bytes(in, before));
            CHECK(count_wrong_any(out, group.ranks, op) == 0);
          }
        }
      }
    }
  }
  // A view into the middle of a shared block works too (offsets travel with it).
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  auto block = c.allocate((int64_t{1} << 20) + 100, at::kFloat);
  auto view = block.narrow(0, 37, (int64_t{1} << 20) + 13);
  view.copy_(make_input(c.rank(), view.numel(), at::kFloat));
  const auto before = c.stats();
  c.allreduce(view, all, ReduceOp::kAvg)->wait();
  CHECK(count_wrong_any(view, all, ReduceOp::kAvg) == 0);
  CHECK(block.narrow(0, 0, 37).abs().sum().item<double>() == 0.0);
  if (n > 1) {
    CHECK(c.stats().shared_memory_allreduces == before.shared_memory_allreduces + 1);
  }
  check_traffic(c, before, view.nbytes());
}

TEST_CASE("shared-memory all-reduce: bit-identical members, mixed buffers fall back", "[mpi]") {
  MpiCommunicator c(shm_options(1, 0));
  const int n = c.size();
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto t =
        shared_copy(c, at::arange(100003, at::kDouble).mul(0.001 * (c.rank() + 1)).sin().to(dtype));
    c.allreduce(t, all, ReduceOp::kAvg)->wait();
    check_same_bytes_everywhere(c, t);
  }
  // Rank 0 passes a private buffer, the others shared ones: all take the ring together.
  const auto before = c.stats();
  auto input = make_input(c.rank(), 50001, at::kFloat);
  auto t = c.rank() == 0 ? input : shared_copy(c, input);
  c.allreduce(t, all, ReduceOp::kSum)->wait();
  CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
  if (n > 1) {
    CHECK(c.stats().ring_allreduces == before.ring_allreduces + 1);
    CHECK(c.stats().shared_memory_allreduces == before.shared_memory_allreduces);
  }
  check_traffic(c, before, t.nbytes());
  // With shared memory off, allocate() gives private memory and every all-reduce the ring.
  MpiCommunicator off(shm_options(0, 0));
  auto p = off.allocate(1000, at::kFloat);
  std::string name;
  uint64_t offset = 0;
  CHECK_FALSE(detail::find_shared(p.data_ptr(), p.nbytes(), name, offset));
  p.copy_(make_input(off.rank(), 1000, at::kFloat));
  off.allreduce(p, all, ReduceOp::kAvg)->wait();
  CHECK(count_wrong_any(p, all, ReduceOp::kAvg) == 0);
  CHECK(off.stats().shared_memory_allreduces == 0);
}

TEST_CASE("shared-memory settings that differ across ranks are one clear error", "[mpi]") {
  if (comm().size() == 1)
    return;
  CHECK_THROWS_WITH(MpiCommunicator(shm_options(comm().rank() == 0 ? 0 : 1, 0)),
                    Catch::Contains("shared-memory settings must be the same on every rank") &&
                        Catch::Contains("rank 0 has 0 / 0, rank 1 has 1 / 0"));
  CHECK_THROWS_WITH(MpiCommunicator(shm_options(1, comm().rank() == 0 ? 0 : 4096)),
                    Catch::Contains("rank 0 has 1 / 0, rank 1 has 1 / 4096"));
  MpiCommunicator fine(shm_options(1, 0));  // and communicators still work afterwards
  fine.barrier();
}

// Note [node-aware all-reduce], on one machine: MpiOptions::ranks_per_node = 2 makes each
// pair of ranks a node, and every size takes the node-aware path where a group qualifies.
MpiOptions node_options(int64_t min_bytes) {
  MpiOptions o = shm_options(1, 0);
  o.node_aware = min_bytes < 0 ? 0 : 1;
  o.node_aware_min_bytes = std::max<int64_t>(0, min_bytes);
  o.ranks_per_node = 2;
  return o;
}

// True when `ranks` spans >= 2 nodes of ranks_per_node = 2 with both ranks of each.
bool two_per_node(const std::vector<int>& ranks) {
  std::map<int, int> per_node;
  for (int r : ranks)
    ++per_node[r / 2];
  if (per_node.size() < 2)
    return false;
  for (const auto& kv : per_node)
    if (kv.second != 2)
      return false;
  return true;
}

TEST_CASE("node-aware all-reduce: closed forms on every group, both paths counted", "[mpi]") {
  const int n = comm().size();
  if (n % 2 != 0)
    return;  // ranks_per_node = 2 must divide the world
  MpiCommunicator c(node_options(0));
  CHECK(c.local_size() == 2);
  CHECK(c.local_rank() == c.rank() % 2);
  auto topologies = topologies_for(n);
  if (n >= 4 && is_power_of_two(n / 2))
    topologies.push_back(topology::make_topology("aer", n, 2));  // groups of whole nodes
  bool took_it = false;
  for (const auto& topo : topologies) {
    c.make_groups(topo->distinct_groups());
    for (int s = 0; s < topo->period(); ++s) {
      const auto& group = topo->group_of(c.rank(), s);
      const bool node_aware = two_per_node(group.ranks);
      took_it = took_it || node_aware;
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong}) {
        const bool integral = dtype == at::kInt || dtype == at::kLong;
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          if (integral && op == ReduceOp::kAvg)
            continue;
          for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4099}}) {
            INFO("rank " << c.rank() << " topology " << topo->name() << " slot " << s << " group "
                         << ranks_to_string(group.ranks) << " dtype " << dtype << " op "
                         << to_string(op) << " numel " << numel);
            const auto before = c.stats();
            auto t = make_input(c.rank(), numel, dtype);
            c.allreduce(t, group.ranks, op)->wait();
            CHECK(count_wrong_any(t, group.ranks, op) == 0);
            auto in = make_input(c.rank(), numel, dtype);
            const auto kept = in.clone();
            auto out = at::empty({numel}, in.options());
            c.allreduce(in, out, group.ranks, op)->wait();
            CHECK(torch_equal_bytes(in, kept));
            CHECK(count_wrong_any(out, group.ranks, op) == 0);
            if (group.ranks.size() > 1) {
              const auto now = c.stats();
              CHECK(now.node_aware_allreduces - before.node_aware_allreduces ==
                    (node_aware ? 2u : 0u));
              CHECK(now.ring_allreduces - before.ring_allreduces == (node_aware ? 0u : 2u));
            }
          }
        }
      }
    }
  }
  CHECK(took_it == (n >= 4));
}

TEST_CASE("node-aware all-reduce: bit-identical members, its traffic, the size threshold",
          "[mpi]") {
  const int n = comm().size();
  if (n % 2 != 0 || n < 4)
    return;
  MpiCommunicator c(node_options(4096));
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto t = at::arange(100003, at::kDouble).mul(0.001 * (c.rank() + 1)).sin().to(dtype);
    c.allreduce(t, all, ReduceOp::kAvg)->wait();
    check_same_bytes_everywhere(c, t);
  }
  // Over all ranks, g nodes of l: (l - 1) g M inside the nodes (1.), 2 (g - 1) M across them
  // (2.), (l - 1) g M inside again (3.), each way: the flat ring's 2 (k - 1) M.
  const int64_t numel = 50001;
  const int64_t bytes = numel * 4;
  const int64_t g = n / 2, l = 2;
  const auto before = c.stats();
  auto t = make_input(c.rank(), numel, at::kFloat);
  c.allreduce(t, all, ReduceOp::kSum)->wait();
  CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
  const auto now = c.stats();
  CHECK(now.node_aware_allreduces == before.node_aware_allreduces + 1);
  auto traffic = at::empty({2}, at::kLong);
  traffic.data_ptr<int64_t>()[0] =
      static_cast<int64_t>(now.allreduce_bytes_sent - before.allreduce_bytes_sent);
  traffic.data_ptr<int64_t>()[1] =
      static_cast<int64_t>(now.allreduce_bytes_received - before.allreduce_bytes_received);
  c.allreduce(traffic, all, ReduceOp::kSum)->wait();  // 16 bytes: below the threshold
  const int64_t expected = (2 * (l - 1) * g + 2 * (g - 1)) * bytes;
  CHECK(expected == 2 * (n - 1) * bytes);
  CHECK(traffic.data_ptr<int64_t>()[0] == expected);
  CHECK(traffic.data_ptr<int64_t>()[1] == expected);
  CHECK(c.stats().ring_allreduces == now.ring_allreduces + 1);
  CHECK(c.stats().node_aware_allreduces == now.node_aware_allreduces);
  // node_aware = 0: never.
  MpiCommunicator flat(node_options(-1));
  auto f = make_input(flat.rank(), numel, at::kFloat);
  flat.allreduce(f, all, ReduceOp::kSum)->wait();
  CHECK(count_wrong_any(f, all, ReduceOp::kSum) == 0);
  CHECK(flat.stats().node_aware_allreduces == 0);
  CHECK(flat.stats().ring_allreduces == 1);
}

TEST_CASE("node-aware all-reduce: four ranks per node, chunks of uneven sizes", "[mpi]") {
  const int n = comm().size();
  if (n % 4 != 0 || n < 8)
    return;
  MpiOptions o = node_options(0);
  o.ranks_per_node = 4;
  MpiCommunicator c(o);
  CHECK(c.local_size() == 4);
  // Every rank; two ranks of each node (g nodes of 2); the first node and half of the next
  // (no equal shares: the flat ring).
  std::vector<std::vector<int>> groups(3);
  for (int r = 0; r < n; ++r) {
    groups[0].push_back(r);
    if (r % 4 < 2)
      groups[1].push_back(r);
    if (r < 6)
      groups[2].push_back(r);
  }
  c.make_groups(groups);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& group = groups[gi];
    if (std::find(group.begin(), group.end(), c.rank()) == group.end())
      continue;
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf}) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        for (int64_t numel : {int64_t{0}, int64_t{3}, int64_t{13}, int64_t{40961}}) {
          INFO("rank " << c.rank() << " group " << ranks_to_string(group) << " dtype " << dtype
                       << " numel " << numel);
          const auto before = c.stats();
          auto t = make_input(c.rank(), numel, dtype);
          c.allreduce(t, group, op)->wait();
          CHECK(count_wrong_any(t, group, op) == 0);
          CHECK(c.stats().node_aware_allreduces - before.node_aware_allreduces ==
                (gi < 2 ? 1u : 0u));
        }
      }
    }
  }
  // Bit-identical on every member, averaged in float32 over 2 nodes of 4.
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  auto t = at::arange(77777, at::kDouble).mul(0.01 * (c.rank() + 1)).cos().to(at::kFloat);
  c.allreduce(t, all, ReduceOp::kAvg)->wait();
  check_same_bytes_everywhere(c, t);
}

MpiOptions lane_options(int lanes, int64_t min_bytes) {
  MpiOptions o = shm_options(0, 0);  // private buffers: every all-reduce takes messages
  o.ranks_per_node = 1;              // every group spans several nodes: lanes apply
  o.ring_lanes = lanes;
  o.ring_lane_min_bytes = min_bytes;
  return o;
}

TEST_CASE("ring lanes: how many an all-reduce takes", "[mpi]") {
  // Note [ring lanes]: up to max_lanes segments of at least lane_min_bytes, never shorter
  // than the group, one lane below twice the minimum.
  constexpr int64_t MiB = 1 << 20;
  CHECK(detail::ring_lane_count(8 * MiB, 2 * MiB, 2, 4, MiB) == 4);
  CHECK(detail::ring_lane_count(3 * MiB, 768 * 1024, 2, 4, MiB) == 3);
  CHECK(detail::ring_lane_count(2 * MiB - 4, MiB / 2 - 1, 2, 4, MiB) == 1);
  CHECK(detail::ring_lane_count(64 * MiB, 16 * MiB, 8, 8, MiB) == 8);
  CHECK(detail::ring_lane_count(64 * MiB, 16 * MiB, 8, 1, MiB) == 1);
  CHECK(detail::ring_lane_count(1000, 250, 100, 8, 64) == 2);  // segments of >= 100 elements
  CHECK(detail::ring_lane_count(0, 0, 2, 8, 1) == 1);
  // Tags: lanes of one operation and consecutive operations never meet.
  CHECK(detail::operation_tag(0, 0) == 0);
  CHECK(detail::operation_tag(0, 7) == 7);
  CHECK(detail::operation_tag(1, 0) == 8);
  CHECK(detail::operation_tag(4095, 7) == 32767);
  CHECK(detail::operation_tag(4096, 3) == 3);
}

TEST_CASE(
    "ring lanes: closed forms, bit-identical members, one operation counted, the ring's "
    "traffic",
    "[mpi]") {
  const int n = comm().size();
  if (n < 2)
    return;
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  for (int lanes : {1, 2, 3, 8}) {
    MpiCommunicator c(lane_options(lanes, 64));
    for (auto dtype : {at::kFloat, at::kHalf}) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        for (int64_t numel : {int64_t{0}, int64_t{3}, int64_t{100}, int64_t{40961}}) {
          INFO("lanes " << lanes << " dtype " << dtype << " numel " << numel);
          const auto before = c.stats();
          auto t = make_input(c.rank(), numel, dtype);
          c.allreduce(t, all, op)->wait();
          CHECK(count_wrong_any(t, all, op) == 0);
          CHECK(c.stats().ring_allreduces == before.ring_allreduces + 1);
          const int64_t bytes = numel * static_cast<int64_t>(t.element_size());
          CHECK(c.stats().allreduce_lanes ==
                before.allreduce_lanes +
                    static_cast<uint64_t>(detail::ring_lane_count(bytes, numel, n, lanes, 64)));
        }
      }
    }
    // Every chunk of every segment travels k - 1 times in each half of its ring: over all
    // ranks, 2 (k - 1) times the buffer each way, whatever the lanes.
    const int64_t numel = 40961;
    const auto before = c.stats();
    auto t = at::arange(numel, at::kDouble).mul(0.001 * (c.rank() + 1)).sin().to(at::kFloat);
    c.allreduce(t, all, ReduceOp::kAvg)->wait();
    check_same_bytes_everywhere(c, t);
    const auto now = c.stats();
    auto traffic = at::empty({2}, at::kLong);
    traffic.data_ptr<int64_t>()[0] =
        static_cast<int64_t>(now.allreduce_bytes_sent - before.allreduce_bytes_sent);
    traffic.data_ptr<int64_t>()[1] =
        static_cast<int64_t>(now.allreduce_bytes_received - before.allreduce_bytes_received);
    c.allreduce(traffic, all, ReduceOp::kSum)->wait();
    CHECK(traffic.data_ptr<int64_t>()[0] == 2 * (n - 1) * numel * 4);
    CHECK(traffic.data_ptr<int64_t>()[1] == 2 * (n - 1) * numel * 4);
  }
  // Two members: each element is one sum, the same in any segment, so lanes change no bit.
  if (n == 2) {
    MpiCommunicator one(lane_options(1, 64));
    MpiCommunicator four(lane_options(4, 64));
    auto a = at::arange(10007, at::kDouble).mul(0.37 * (one.rank() + 1)).cos().to(at::kFloat);
    auto b = a.clone();
    one.allreduce(a, all, ReduceOp::kAvg)->wait();
    four.allreduce(b, all, ReduceOp::kAvg)->wait();
    CHECK(a.equal(b));
  }
}

TEST_CASE("ring lanes: many operations in flight with broadcasts between them", "[mpi]") {
  const int n = comm().size();
  if (n < 2)
    return;
  MpiCommunicator c(lane_options(4, 256));
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  std::vector<at::Tensor> tensors;
  std::vector<at::Tensor> casts;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 12; ++i) {
    tensors.push_back(make_input(c.rank(), 5000 + 1237 * i, at::kFloat));
    works.push_back(c.allreduce(tensors.back(), all, i % 3 ? ReduceOp::kSum : ReduceOp::kAvg));
    casts.push_back(at::full({1000 + i}, c.rank() == i % n ? double(i) : -1.0, at::kDouble));
    works.push_back(c.broadcast(casts.back(), i % n));
  }
  for (auto& w : works)
    w->wait();
  for (int i = 0; i < 12; ++i) {
    INFO("operation " << i);
    CHECK(count_wrong_any(tensors[i], all, i % 3 ? ReduceOp::kSum : ReduceOp::kAvg) == 0);
    CHECK(casts[i].eq(double(i)).all().item<bool>());
  }
}

TEST_CASE("node-aware all-reduce in lanes: closed forms, bit-identical members, one operation",
          "[mpi]") {
  const int n = comm().size();
  if (n % 2 != 0 || n < 4)
    return;
  MpiOptions o = node_options(0);
  o.ring_lanes = 3;
  o.ring_lane_min_bytes = 128;
  MpiCommunicator c(o);
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  for (int64_t numel : {int64_t{13}, int64_t{4096}, int64_t{50001}}) {
    INFO("numel " << numel);
    const auto before = c.stats();
    auto t = make_input(c.rank(), numel, at::kFloat);
    c.allreduce(t, all, ReduceOp::kSum)->wait();
    CHECK(count_wrong_any(t, all, ReduceOp::kSum) == 0);
    CHECK(c.stats().node_aware_allreduces == before.node_aware_allreduces + 1);
    CHECK(c.stats().allreduce_lanes ==
          before.allreduce_lanes +
              static_cast<uint64_t>(detail::ring_lane_count(numel * 4, numel, n, 3, 128)));
  }
  // A group inside one node takes one lane (Note [ring lanes]), however large.
  c.make_groups({{0, 1}});  // collective
  if (c.rank() < 2) {
    const auto before = c.stats();
    auto t = make_input(c.rank(), 50001, at::kFloat);
    c.allreduce(t, {0, 1}, ReduceOp::kSum)->wait();
    CHECK(count_wrong_any(t, {0, 1}, ReduceOp::kSum) == 0);
    CHECK(c.stats().ring_allreduces == before.ring_allreduces + 1);
    CHECK(c.stats().allreduce_lanes == before.allreduce_lanes + 1);
  }
  auto t = at::arange(77777, at::kDouble).mul(0.01 * (c.rank() + 1)).cos().to(at::kFloat);
  c.allreduce(t, all, ReduceOp::kAvg)->wait();
  check_same_bytes_everywhere(c, t);
}

TEST_CASE("ring_lanes and ring_lane_min_bytes: bad or differing values are clear errors", "[mpi]") {
  const int n = comm().size();
  CHECK_THROWS_WITH(MpiCommunicator(lane_options(0, 64)),
                    Catch::Contains("ring_lanes must be in [1, 8]") && Catch::Contains("got 0"));
  CHECK_THROWS_WITH(MpiCommunicator(lane_options(9, 64)),
                    Catch::Contains("ring_lanes must be in [1, 8]") && Catch::Contains("got 9"));
  CHECK_THROWS_WITH(MpiCommunicator(lane_options(2, 0)),
                    Catch::Contains("ring_lane_min_bytes must be >= 1, got 0"));
  if (n > 1) {
    CHECK_THROWS_WITH(MpiCommunicator(lane_options(comm().rank() == 0 ? 2 : 3, 64)),
                      Catch::Contains("ring_lanes (DECENT_DP_RING_LANES) and ring_lane_min_bytes "
                                      "must be the same on every rank") &&
                          Catch::Contains("rank 0 has 2 and 64, rank 1 has 3 and 64"));
  }
  MpiCommunicator fine(lane_options(8, 1));
  fine.barrier();
}

TEST_CASE("ranks_per_node and node_aware_min_bytes: bad or differing values are clear errors",
          "[mpi]") {
  const int n = comm().size();
  MpiOptions bad = shm_options(1, 0);
  bad.ranks_per_node = n + 1;
  CHECK_THROWS_WITH(MpiCommunicator(bad),
                    Catch::Contains("ranks_per_node must divide the world size " +
                                    std::to_string(n) + ", got " + std::to_string(n + 1)));
  bad.ranks_per_node = -1;
  CHECK_THROWS_WITH(MpiCommunicator(bad), Catch::Contains("ranks_per_node must be >= 0"));
  bad.ranks_per_node = 0;
  bad.node_aware_min_bytes = -1;
  CHECK_THROWS_WITH(MpiCommunicator(bad), Catch::Contains("node_aware_min_bytes must be >= 0") &&
                                              Catch::Contains("got -1"));
  if (n > 1) {
    MpiOptions differ = shm_options(1, 0);
    differ.node_aware_min_bytes = comm().rank() == 0 ? 0 : 100;
    CHECK_THROWS_WITH(MpiCommunicator(differ),
                      Catch::Contains("ranks_per_node must be the same on every rank") &&
                          Catch::Contains("rank 0 has 0 and 0, rank 1 has 100 and 0"));
  }
  MpiCommunicator fine(shm_options(1, 0));
  fine.barrier();
}

TEST_CASE("shared-memory segments are released with their tensors", "[mpi]") {
  MpiCommunicator c(shm_options(1, 0));
  if (c.size() == 1)
    return;
  std::string name;
  uint64_t offset = 0;
  {
    auto t = c.allocate(4096, at::kDouble);
    REQUIRE(detail::find_shared(t.data_ptr(), t.nbytes(), name, offset));
    CHECK(offset == 0);
    CHECK(std::ifstream("/dev/shm" + name).good());
  }
  CHECK_FALSE(std::ifstream("/dev/shm" + name).good());

  // Peers drop their mappings of a segment once its owner freed it, at their next new one.
  const int n = c.size();
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r)
    all[r] = r;
  auto mapped = [](const std::string& segment) {
    std::ifstream maps("/proc/self/maps");
    const std::string path = "/dev/shm" + segment;
    std::string line;
    while (std::getline(maps, line)) {
      const size_t at = line.find(path);
      if (at != std::string::npos &&
          (at + path.size() == line.size() || line[at + path.size()] == ' '))
        return true;
    }
    return false;
  };
  std::string first_name;
  {
    auto t = c.allocate(1 << 16, at::kFloat);
    REQUIRE(detail::find_shared(t.data_ptr(), t.nbytes(), first_name, offset));
    c.allreduce(t, all, ReduceOp::kSum)->wait();
    // Every rank's segment name, to look for the peers' in this process's mappings.
    auto mine = at::zeros({128}, at::kByte);
    std::memcpy(mine.data_ptr(), first_name.c_str(), first_name.size());
    auto names = at::zeros({128 * n}, at::kByte);
    c.allgather(names, mine)->wait();
    const int peer = (c.rank() + 1) % n;
    first_name = std::string(static_cast<const char*>(names.data_ptr()) + 128 * peer);
    CHECK(mapped(first_name));  // the peer's segment, mapped by the all-reduce
    c.barrier();
  }
  c.barrier();  // every rank freed its segment
  auto u = c.allocate(1 << 16, at::kFloat);
  c.allreduce(u, all, ReduceOp::kSum)->wait();
  CHECK_FALSE(mapped(first_name));
}

namespace {

// Member m of `ranks` contributes its world rank * 100 + i % 97 at element i (exact in float16);
// the gathered output must hold every member's block in group order, bit for bit.
int64_t count_wrong_gather(const at::Tensor& out, const std::vector<int>& ranks, int64_t n) {
  auto o = out.to(at::kDouble);
  const double* p = o.data_ptr<double>();
  int64_t wrong = 0;
  for (size_t m = 0; m < ranks.size(); ++m) {
    for (int64_t i = 0; i < n; ++i) {
      wrong += p[m * n + i] != static_cast<double>(ranks[m] * 100 + i % 97) ? 1 : 0;
    }
  }
  return wrong;
}

at::Tensor gather_input(Communicator& c, int64_t n, at::ScalarType dtype, bool shared) {
  auto base = at::arange(n, at::kDouble).remainder(97).add(c.rank() * 100).to(dtype);
  return shared ? shared_copy(c, base) : base;
}

// Since `before`, this rank sent and received `expected` all-gather payload bytes.
void check_gather_traffic(MpiCommunicator& c, const MpiStats& before, int64_t expected) {
  const auto now = c.stats();
  INFO("rank " << c.rank() << ": all-gather bytes sent and received");
  CHECK(static_cast<int64_t>(now.allgather_bytes_sent - before.allgather_bytes_sent) == expected);
  CHECK(static_cast<int64_t>(now.allgather_bytes_received - before.allgather_bytes_received) ==
        expected);
}

}  // namespace

TEST_CASE("group all-gather: every member's block in order, both transports, every slot",
          "[mpi][allgather]") {
  for (int shared : {1, 0}) {
    MpiCommunicator c(shm_options(shared, 0));
    const int n = c.size();
    for (const auto& topo : topologies_for(n)) {
      c.make_groups(topo->distinct_groups());
      for (int s = 0; s < topo->period(); ++s) {
        const auto& group = topo->group_of(c.rank(), s);
        for (auto dtype : {at::kFloat, at::kHalf, at::kLong}) {
          for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{4099}}) {
            for (bool shared_input : {true, false}) {
              INFO("rank " << c.rank() << " shm " << shared << " topology " << topo->name()
                           << " slot " << s << " group " << ranks_to_string(group.ranks)
                           << " dtype " << dtype << " numel " << numel << " shared input "
                           << shared_input);
              const auto in = gather_input(c, numel, dtype, shared_input);
              const auto before_in = in.clone();
              auto out = at::full({numel * group.size()}, -1, at::TensorOptions().dtype(dtype));
              const auto stats_before = c.stats();
              c.allgather(out, in, AllgatherOptions{group.ranks, {}})->wait();
              CHECK(count_wrong_gather(out, group.ranks, numel) == 0);
              CHECK(in.equal(before_in));
              // (k - 1) blocks each way, on either transport.
              check_gather_traffic(c, stats_before, (group.size() - 1) * numel * in.element_size());
            }
          }
        }
      }
    }
    // Shared inputs on one node went through shared memory (or none: one rank per group).
    const auto stats = c.stats();
    if (shared == 0) {
      CHECK(stats.shared_memory_allgathers == 0);
    } else if (n > 1 && c.local_size() == n) {
      CHECK(stats.shared_memory_allgathers > 0);
    }
  }
}

TEST_CASE("group all-gather: many in flight on overlapping groups, and bad input",
          "[mpi][allgather]") {
  auto& c = comm();
  const int n = c.size();
  std::vector<std::vector<int>> groups;
  for (const auto& topo : topologies_for(n)) {
    for (const auto& g : topo->distinct_groups()) {
      groups.push_back(g);
    }
  }
  c.make_groups(groups);
  std::vector<std::pair<std::vector<int>, at::Tensor>> outs;
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& topo : topologies_for(n)) {
    for (int s = 0; s < topo->period(); ++s) {
      const auto& group = topo->group_of(c.rank(), s);
      auto in = gather_input(c, 333, at::kFloat, false);
      auto out = at::empty({333 * group.size()});
      works.push_back(c.allgather(out, in, AllgatherOptions{group.ranks, {}}));
      outs.emplace_back(group.ranks, out);
    }
  }
  for (size_t i = works.size(); i-- > 0;) {
    works[i]->wait();  // waited in reverse order
    CHECK(count_wrong_gather(outs[i].second, outs[i].first, 333) == 0);
  }
  std::vector<int> me{c.rank()};
  CHECK_THROWS_WITH(c.allgather(at::zeros({5}), at::zeros({4}), AllgatherOptions{me, {}}),
                    Catch::Contains("output must hold group size * input.numel() = 1 * 4 = 4"));
  CHECK_THROWS_WITH(
      c.allgather(at::zeros({4}), at::zeros({4}, at::kDouble), AllgatherOptions{me, {}}),
      Catch::Contains("output dtype must equal input dtype"));
  if (n > 2) {
    std::vector<int> missing{(c.rank() + 1) % n};
    CHECK_THROWS_WITH(c.allgather(at::zeros({4}), at::zeros({4}), AllgatherOptions{missing, {}}),
                      Catch::Contains("that contain this rank"));
  }
}

TEST_CASE("varying all-gather: each member's own length, both transports, every slot",
          "[mpi][allgather]") {
  // Note [varying all-gather]: member r sends len(r) = (37 r + 5 s) mod (capacity + 1)
  // elements; every member gets each block at its slot of the output and each length.
  for (int shared : {1, 0}) {
    MpiCommunicator c(shm_options(shared, 0));
    const int n = c.size();
    const int64_t capacity = 1031;
    auto len_of = [&](int r, int s) { return (37 * r + 5 * s) % (capacity + 1); };
    for (const auto& topo : topologies_for(n)) {
      c.make_groups(topo->distinct_groups());
      for (int s = 0; s < topo->period(); ++s) {
        const auto& group = topo->group_of(c.rank(), s);
        const int64_t k = group.size();
        for (bool shared_input : {true, false}) {
          INFO("rank " << c.rank() << " shm " << shared << " topology " << topo->name() << " slot "
                       << s << " shared input " << shared_input);
          const auto full = gather_input(c, capacity, at::kByte, shared_input);
          const auto in = full.narrow(0, 0, len_of(c.rank(), s));
          auto out = at::full({k * capacity}, 255, at::kByte);
          auto lengths = at::full({k}, -1, at::kLong);
          const auto before = c.stats();
          c.allgather_varying(out, in, lengths, AllgatherOptions{group.ranks, {}})->wait();
          int64_t received = 0, wrong = 0;
          for (int64_t m = 0; m < k; ++m) {
            const int r = group.ranks[static_cast<size_t>(m)];
            const int64_t len = len_of(r, s);
            CHECK(lengths[m].item<int64_t>() == len);
            // What gather_input() makes on rank r.
            const auto expected = at::arange(capacity, at::kDouble)
                                      .remainder(97)
                                      .add(r * 100)
                                      .to(at::kByte)
                                      .narrow(0, 0, len);
            wrong += out.narrow(0, m * capacity, len).ne(expected).sum().item<int64_t>();
            if (r != c.rank())
              received += len;
          }
          CHECK(wrong == 0);
          const auto now = c.stats();
          CHECK(static_cast<int64_t>(now.allgather_bytes_sent - before.allgather_bytes_sent) ==
                (k - 1) * in.numel());
          CHECK(static_cast<int64_t>(now.allgather_bytes_received -
                                     before.allgather_bytes_received) == received);
        }
      }
    }
  }
  auto& c = comm();
  std::vector<int> me{c.rank()};
  auto lengths = at::zeros({1}, at::kLong);
  CHECK_THROWS_WITH(
      c.allgather_varying(at::zeros({4}), at::zeros({5}), lengths, AllgatherOptions{me, {}}),
      Catch::Contains("input has 5 elements, more than the capacity of 4 per member"));
  CHECK_THROWS_WITH(c.allgather_varying(at::zeros({4}), at::zeros({2}), at::zeros({2}, at::kLong),
                                        AllgatherOptions{me, {}}),
                    Catch::Contains("lengths must be an int64 tensor of 1 elements"));
  auto out = at::zeros({4});
  c.allgather_varying(out, at::full({3}, 1.0), lengths, AllgatherOptions{me, {}})->wait();
  CHECK(lengths[0].item<int64_t>() == 3);
  CHECK(out.narrow(0, 0, 3).eq(1).all().item<bool>());
}

TEST_CASE("a step that throws after posting messages leaves none of them live", "[mpi][engine]") {
  // Note [abandoned requests]: rank 0 runs an operation whose step posts a receive and a
  // large send, then throws. The receive must be cancelled (a later message with its tag
  // goes to the next receive, not into the failed operation's buffer) and the send kept,
  // with its buffer, until rank 1 takes it.
  MPI_Comm c = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_WORLD, &c) == MPI_SUCCESS);
  const int rank = comm().rank();
  if (comm().size() >= 2 && rank <= 1) {
    constexpr int kLarge = 1 << 18;  // ints: 1 MiB, beyond the eager limit
    if (rank == 0) {
      detail::ProgressEngine engine(std::chrono::microseconds(20), std::chrono::milliseconds(500),
                                    0);
      engine.start_thread();
      auto received = std::make_shared<std::vector<int>>(1, -1);
      auto large = std::make_shared<std::vector<int>>(kLarge, 7);
      auto op = std::make_unique<detail::ProgressEngine::Op>();
      auto work = std::make_shared<Work>("failing step", std::vector<at::Tensor>{},
                                         std::chrono::milliseconds(5000));
      op->work = work;
      op->next = [c, received, large](int) -> std::vector<MPI_Request> {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Irecv(received->data(), 1, MPI_INT, 1, 5, c, &r);
        detail::track_posted(r);
        MPI_Isend(large->data(), kLarge, MPI_INT, 1, 6, c, &r);
        detail::track_posted(r);
        throw CommError("injected failure after posting");
      };
      engine.enqueue(std::move(op));
      CHECK_THROWS_WITH(work->wait(), Catch::Contains("injected failure after posting"));
      CHECK_FALSE(detail::graveyard_empty());  // the large send waits for rank 1
      int go = 1;
      MPI_Send(&go, 1, MPI_INT, 1, 7, c);
      int fresh = -1;
      MPI_Request r = MPI_REQUEST_NULL;
      MPI_Irecv(&fresh, 1, MPI_INT, 1, 5, c, &r);
      int done = 0;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!done && std::chrono::steady_clock::now() < deadline) {
        MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      }
      if (!done) {
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      CHECK(done == 1);  // the message went to the new receive...
      CHECK(fresh == 42);
      CHECK((*received)[0] == -1);  // ...not to the failed operation's
      bool empty = false;
      while (!(empty = detail::graveyard_empty()) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      CHECK(empty);  // the send completed once rank 1 took it
      engine.stop();
    } else {
      int go = 0;
      MPI_Recv(&go, 1, MPI_INT, 0, 7, c, MPI_STATUS_IGNORE);
      std::vector<int> large(kLarge, 0);
      MPI_Recv(large.data(), kLarge, MPI_INT, 0, 6, c, MPI_STATUS_IGNORE);
      CHECK(large[kLarge - 1] == 7);
      int value = 42;
      MPI_Send(&value, 1, MPI_INT, 0, 5, c);
    }
  }
  MPI_Barrier(c);
  MPI_Comm_free(&c);
}

TEST_CASE("the engine advances an operation's lanes independently", "[mpi][engine]") {
  // Note [lanes]: lane 1 waits for a message that lane 0 sends only in its third step. An
  // engine that advanced the operation's lanes together would never finish it.
  MPI_Comm self = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_SELF, &self) == MPI_SUCCESS);
  {
    detail::ProgressEngine engine(std::chrono::microseconds(20), std::chrono::milliseconds(500), 0);
    engine.start_thread();
    struct State {
      int step0 = 0;
      int step1 = 0;
      int out = 0, in = 0, late_out = 5, late_in = -1;
    };
    auto st = std::make_shared<State>();
    auto op = std::make_unique<detail::ProgressEngine::Op>();
    auto work = std::make_shared<Work>("two lanes", std::vector<at::Tensor>{},
                                       std::chrono::milliseconds(10000));
    op->work = work;
    op->lanes = [] { return 2; };
    op->next = [st, self](int lane) -> std::vector<MPI_Request> {
      if (lane == 0) {
        if (st->step0 == 3)
          return {};
        std::vector<MPI_Request> r(2, MPI_REQUEST_NULL);
        MPI_Irecv(&st->in, 1, MPI_INT, 0, 1, self, &r[0]);
        MPI_Isend(&st->out, 1, MPI_INT, 0, 1, self, &r[1]);
        if (st->step0 == 2) {  // the third step also feeds lane 1
          r.push_back(MPI_REQUEST_NULL);
          MPI_Isend(&st->late_out, 1, MPI_INT, 0, 9, self, &r[2]);
        }
        ++st->step0;
        return r;
      }
      if (st->step1++ == 0) {
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Irecv(&st->late_in, 1, MPI_INT, 0, 9, self, &r);
        return {r};
      }
      return {};
    };
    engine.enqueue(std::move(op));
    work->wait();
    CHECK(st->late_in == 5);
    CHECK(st->step0 == 3);
    CHECK(st->step1 == 2);
    engine.stop();
  }
  MPI_Comm_free(&self);
}

TEST_CASE("a lane that fails ends its operation and leaves the other lanes' messages dead",
          "[mpi][engine]") {
  MPI_Comm self = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_dup(MPI_COMM_SELF, &self) == MPI_SUCCESS);
  {
    detail::ProgressEngine engine(std::chrono::microseconds(20), std::chrono::milliseconds(500), 0);
    engine.start_thread();
    auto received = std::make_shared<int>(-1);
    auto op = std::make_unique<detail::ProgressEngine::Op>();
    auto work = std::make_shared<Work>("failing lane", std::vector<at::Tensor>{},
                                       std::chrono::milliseconds(5000));
    op->work = work;
    op->lanes = [] { return 2; };
    op->next = [received, self](int lane) -> std::vector<MPI_Request> {
      if (lane == 0) {
        // A receive nobody sends to: it stays in flight when lane 1 fails.
        MPI_Request r = MPI_REQUEST_NULL;
        MPI_Irecv(received.get(), 1, MPI_INT, 0, 3, self, &r);
        return {r};
      }
      throw CommError("lane 1 failed");
    };
    engine.enqueue(std::move(op));
    CHECK_THROWS_WITH(work->wait(), Catch::Contains("lane 1 failed"));
    // The receive was cancelled: a message with its tag goes to a new receive.
    int value = 42, fresh = -1;
    MPI_Request s = MPI_REQUEST_NULL;
    MPI_Isend(&value, 1, MPI_INT, 0, 3, self, &s);
    MPI_Recv(&fresh, 1, MPI_INT, 0, 3, self, MPI_STATUS_IGNORE);
    MPI_Wait(&s, MPI_STATUS_IGNORE);
    CHECK(fresh == 42);
    CHECK(*received == -1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    bool empty = false;
    while (!(empty = detail::graveyard_empty()) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(empty);
    engine.stop();
  }
  MPI_Comm_free(&self);
}
