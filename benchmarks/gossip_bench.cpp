// gossip_bench: bandwidth of decent_dp's asynchronous group all-reduce, measured side by
// side with plain MPI_Allreduce on the same groups, nccl-tests style.
//
//   mpirun -n 2 build/bin/gossip_bench -b 4 -e 256M -f 2 -n 20 -w 5
//
// For every topology the world size allows and every slot of it, and every size from -b to
// -e (times -f), each rank all-reduces a buffer over its group of that slot: first through
// MpiCommunicator::allreduce (launch, then wait), then with MPI_Allreduce on an identical
// sub-communicator. The buffer comes from MpiCommunicator::allocate (--buffer shared, the
// default: what the wrappers exchange) or is ordinary memory (--buffer private). Columns and
// formulas: benchmarks/README.md.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>

#include "benchmarks/bench_util.h"
#include "decent_dp/mpi_communicator.h"
#include "decent_dp/topology/topology.h"

namespace {

using Clock = std::chrono::steady_clock;

// "4", "64K", "1M", "2G" in bytes; throws std::invalid_argument naming `flag` otherwise.
int64_t parse_size(const std::string& text, const char* flag) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used > 0 ? text.substr(used) : std::string();
  if (used == 0 || !(v >= 0) ||
      !(unit.empty() || unit == "K" || unit == "k" || unit == "M" || unit == "m" || unit == "G" ||
        unit == "g")) {
    throw std::invalid_argument(std::string(flag) +
                                ": expected a size in bytes such as 4, 64K, 1M or 2G, got '" +
                                text + "'");
  }
  if (unit == "K" || unit == "k")
    v *= 1024;
  else if (unit == "M" || unit == "m")
    v *= 1024.0 * 1024;
  else if (unit == "G" || unit == "g")
    v *= 1024.0 * 1024 * 1024;
  return static_cast<int64_t>(v);
}

struct Result {
  double time_us = 0;  // median
  double mean_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = 0;
};

// Exactly representable inputs: rank r holds (r + 1) * (i % 5 + 1).
void fill(float* p, int64_t n, int rank) {
  for (int64_t i = 0; i < n; ++i)
    p[i] = static_cast<float>((rank + 1) * (i % 5 + 1));
}

int64_t count_wrong(const float* p, int64_t n, const std::vector<int>& ranks) {
  double rank_sum = 0;
  for (int r : ranks)
    rank_sum += r + 1;
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != static_cast<float>(rank_sum * (i % 5 + 1)))
      ++wrong;
  }
  return wrong;
}

// Per iteration, the slowest rank's time (in place).
void slowest_per_iteration(std::vector<double>& us) {
  MPI_Allreduce(MPI_IN_PLACE, us.data(), static_cast<int>(us.size()), MPI_DOUBLE, MPI_MAX,
                MPI_COMM_WORLD);
}

// Median over iterations of the slowest rank's time: robust to the load spikes of a shared
// machine. The mean is reported in the JSON output as well.
double median_of_slowest(std::vector<double>& us) {
  slowest_per_iteration(us);
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}

double mean_of_slowest(const std::vector<double>& slowest) {
  double sum = 0;
  for (double v : slowest)
    sum += v;
  return sum / static_cast<double>(slowest.size());
}

int64_t sum_over_ranks(int64_t v) {
  int64_t out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp gossip bandwidth: library group all-reduce vs MPI_Allreduce"};
  std::string min_text = "4", max_text = "256M", json_path;
  double factor = 2;
  int iters = 20, warmup = 5;
  std::vector<std::string> names = {"complete", "ring", "one-peer-exp", "alternating-exp-ring"};
  int lws = 0, inflight = 1;
  app.add_option("-b,--minbytes", min_text, "smallest size, e.g. 4, 64K, 1M");
  app.add_option("-e,--maxbytes", max_text, "largest size");
  app.add_option("-f,--stepfactor", factor, "size multiplier between rows")
      ->check(CLI::Range(1.01, 1024.0));
  app.add_option("-n,--iters", iters, "timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup_iters", warmup, "untimed iterations first")
      ->check(CLI::NonNegativeNumber);
  app.add_option("-t,--topology", names, "topologies to measure (skipped when n does not fit)");
  app.add_option("--lws", lws, "ranks per node for alternating-exp-ring (default: 2)");
  app.add_option("-J,--json", json_path, "also write the results as JSON to this file");
  std::string memory = "shared";
  app.add_option("--buffer", memory,
                 "shared: from MpiCommunicator::allocate, as the wrappers' blocks (shared memory "
                 "between ranks of a node); private: ordinary memory (the ring over MPI messages)")
      ->check(CLI::IsMember({"shared", "private"}));
  app.add_option("--inflight", inflight,
                 "library: split each block into this many all-reduces in flight at once, as "
                 "a step's buckets are (default 1)")
      ->check(CLI::Range(1, 4096));
  CLI11_PARSE(app, argc, argv);
  if (const std::string bad = decent_dp::bench::check_writable(json_path, "-J/--json");
      !bad.empty()) {
    std::fprintf(stderr, "error: %s\n", bad.c_str());
    return 2;
  }
  int64_t min_bytes = 0, max_bytes = 0;
  try {
    min_bytes = std::max<int64_t>(4, parse_size(min_text, "-b/--minbytes"));
    max_bytes = parse_size(max_text, "-e/--maxbytes");
    if (max_bytes < min_bytes)
      throw std::invalid_argument("-e/--maxbytes: expected at least -b/--minbytes (" +
                                  std::to_string(min_bytes) + " bytes), got '" + max_text + "'");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }

  at::set_num_threads(1);
  decent_dp::MpiCommunicator comm;
  const int rank = comm.rank(), n = comm.size();
  nlohmann::json results = nlohmann::json::array();
  if (rank == 0) {
    fmt::print(
        "# gossip_bench: {} ranks, {} iterations after {} warm-up, float32, sum, {} buffer, {} "
        "library operation(s) in flight per block; time = median over iterations of the "
        "slowest rank\n",
        n, iters, warmup, memory, inflight);
    fmt::print(
        "# library = decent_dp MpiCommunicator::allreduce (async + wait); mpi = "
        "MPI_Allreduce on the same group\n");
  }
  at::Tensor buffer = memory == "shared" ? comm.allocate(max_bytes / 4 + 1, at::kFloat)
                                         : at::empty({max_bytes / 4 + 1}, at::kFloat);
  float* data = buffer.data_ptr<float>();

  for (const auto& name : names) {
    std::unique_ptr<decent_dp::topology::Topology> topo;
    try {
      topo = decent_dp::topology::make_topology(name, n, lws > 0 ? lws : std::min(2, n));
    } catch (const decent_dp::InvalidArgument& e) {
      if (rank == 0)
        fmt::print("# skipping {}: {}\n", name, e.what());
      continue;
    }
    comm.make_groups(topo->distinct_groups());
    for (int s = 0; s < topo->period(); ++s) {
      const auto& group = topo->group_of(rank, s);
      int k_max = 0, color = 0;
      for (size_t g = 0; g < topo->slot(s).size(); ++g) {
        k_max = std::max(k_max, topo->slot(s)[g].size());
        if (topo->slot(s)[g].contains(rank))
          color = static_cast<int>(g);
      }
      MPI_Comm raw = MPI_COMM_NULL;
      MPI_Comm_split(MPI_COMM_WORLD, color, rank, &raw);
      if (rank == 0) {
        fmt::print("\n# {} slot {}: {}  (busbw factor 2(k-1)/k with k = {})\n", topo->name(), s,
                   decent_dp::topology::to_string(topo->slot(s)), k_max);
        fmt::print(
            "#{:>11} {:>11} {:>6} | {:>10} {:>8} {:>8} {:>6} | {:>10} {:>8} {:>8} {:>6} | "
            "{:>6}\n",
            "size(B)", "count", "type", "lib us", "algbw", "busbw", "#wrong", "mpi us", "algbw",
            "busbw", "#wrong", "ratio");
      }
      for (double bytes_d = static_cast<double>(min_bytes); bytes_d <= max_bytes * 1.0000001;
           bytes_d *= factor) {
        const int64_t count = std::max<int64_t>(1, static_cast<int64_t>(bytes_d) / 4);
        const int64_t bytes = count * 4;
        at::Tensor view = buffer.narrow(0, 0, count);
        const double bus_factor = k_max > 1 ? 2.0 * (k_max - 1) / k_max : 0.0;
        auto lib_once = [&] {
          if (inflight == 1 || count < inflight) {
            comm.allreduce(view, group.ranks, decent_dp::ReduceOp::kSum)->wait();
            return;
          }
          // Equal parts (the last one takes the rest), all launched before any is waited for.
          std::vector<std::shared_ptr<decent_dp::Work>> works;
          const int64_t part = count / inflight;
          for (int i = 0; i < inflight; ++i) {
            const int64_t len = i + 1 < inflight ? part : count - part * (inflight - 1);
            works.push_back(comm.allreduce(view.narrow(0, i * part, len), group.ranks,
                                           decent_dp::ReduceOp::kSum));
          }
          for (auto& w : works)
            w->wait();
        };
        auto mpi_once = [&] {
          MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw);
        };
        for (int i = 0; i < warmup; ++i) {
          lib_once();
          mpi_once();
        }
        // The two are timed in alternating iterations, so drift in the machine's load hits
        // both alike; each iteration starts together on every rank.
        std::vector<double> lib_us(iters), mpi_us(iters);
        for (int i = 0; i < iters; ++i) {
          MPI_Barrier(MPI_COMM_WORLD);
          auto t0 = Clock::now();
          lib_once();
          lib_us[i] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          MPI_Barrier(MPI_COMM_WORLD);
          t0 = Clock::now();
          mpi_once();
          mpi_us[i] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        }
        auto finish = [&](std::vector<double>& times, auto&& once) {
          Result r;
          r.time_us = median_of_slowest(times);
          r.mean_us = mean_of_slowest(times);
          r.algbw = bytes / r.time_us / 1e3;  // GB/s
          r.busbw = r.algbw * bus_factor;
          fill(data, count, rank);
          once();
          r.wrong = sum_over_ranks(count_wrong(data, count, group.ranks));
          return r;
        };
        const Result lib = finish(lib_us, lib_once);
        const Result mpi = finish(mpi_us, mpi_once);
        const double ratio = mpi.time_us > 0 ? mpi.time_us / lib.time_us : 0.0;
        if (rank == 0) {
          fmt::print(
              "{:>12} {:>11} {:>6} | {:>10.1f} {:>8.3f} {:>8.3f} {:>6} | {:>10.1f} "
              "{:>8.3f} {:>8.3f} {:>6} | {:>6.3f}\n",
              bytes, count, "float", lib.time_us, lib.algbw, lib.busbw, lib.wrong, mpi.time_us,
              mpi.algbw, mpi.busbw, mpi.wrong, ratio);
          results.push_back({{"topology", topo->name()},
                             {"slot", s},
                             {"groups", decent_dp::topology::to_string(topo->slot(s))},
                             {"k", k_max},
                             {"bytes", bytes},
                             {"count", count},
                             {"type", "float"},
                             {"library",
                              {{"time_us", lib.time_us},
                               {"mean_us", lib.mean_us},
                               {"algbw_GBps", lib.algbw},
                               {"busbw_GBps", lib.busbw},
                               {"wrong", lib.wrong}}},
                             {"mpi",
                              {{"time_us", mpi.time_us},
                               {"mean_us", mpi.mean_us},
                               {"algbw_GBps", mpi.algbw},
                               {"busbw_GBps", mpi.busbw},
                               {"wrong", mpi.wrong}}},
                             {"bandwidth_ratio", ratio}});
        }
        if (lib.wrong != 0 || mpi.wrong != 0) {
          MPI_Comm_free(&raw);
          if (rank == 0)
            fmt::print(stderr, "wrong results: stopping\n");
          return 1;
        }
      }
      MPI_Comm_free(&raw);
    }
  }
  // Which path rank 0's all-reduces took (Note [node-aware all-reduce], Note [shared-memory
  // transport]).
  const decent_dp::MpiStats stats = comm.stats();
  if (rank == 0) {
    fmt::print("# rank 0's all-reduces by path: shared memory {}, ring {}, node-aware {}\n",
               stats.shared_memory_allreduces, stats.ring_allreduces, stats.node_aware_allreduces);
  }
  if (rank == 0 && !json_path.empty() &&
      !decent_dp::bench::write_json(
          json_path,
          nlohmann::json{{"world_size", n},
                         {"iters", iters},
                         {"warmup", warmup},
                         {"inflight", inflight},
                         {"allreduces_by_path",
                          {{"shared_memory", stats.shared_memory_allreduces},
                           {"ring", stats.ring_allreduces},
                           {"node_aware", stats.node_aware_allreduces}}},
                         {"results", results}},
          "-J/--json")) {
    return 1;
  }
  return 0;
}
