// Gossip demo: every rank starts from its own random vector and repeatedly averages it
// with the group the topology names for that step. The consensus distance
// (1/n) sum_i ||x_i - mean||^2 shrinks at a rate set by the topology's spectral gap, while
// the global mean never changes.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <random>

#include "decent_dp/mpi_communicator.h"
#include "decent_dp/topology/topology.h"

namespace {

// Mean over ranks of ||x_i - mean||^2, and the mean's first element (collective).
std::pair<double, double> consensus(decent_dp::Communicator& comm, const at::Tensor& x,
                                    const std::vector<int>& all) {
  at::Tensor mean = x.clone();
  comm.allreduce(mean, all, decent_dp::ReduceOp::kAvg)->wait();
  at::Tensor d = at::empty({1}, x.options().dtype(at::kDouble));
  d.data_ptr<double>()[0] = x.sub(mean).pow(2).sum().item<double>();
  comm.allreduce(d, all, decent_dp::ReduceOp::kAvg)->wait();
  return {d.data_ptr<double>()[0], mean.data_ptr<float>()[0]};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decent_dp gossip demo: decentralized averaging over a topology"};
  std::string name = "ring";
  int steps = 12;
  int64_t numel = 1 << 16;
  int lws = 0;
  app.add_option("--topology", name, "complete, ring, exp, aer, or a registered name");
  app.add_option("--steps", steps, "gossip steps")->check(CLI::PositiveNumber);
  app.add_option("--numel", numel, "elements per rank")->check(CLI::PositiveNumber);
  app.add_option("--lws", lws, "ranks per node (default: found through MPI)");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  decent_dp::MpiCommunicator comm;
  try {
    const int n = comm.size();
    auto topo = decent_dp::topology::make_topology(name, n, lws > 0 ? lws : comm.local_size());
    comm.make_groups(topo->distinct_groups());
    std::vector<int> all(n);
    for (int r = 0; r < n; ++r)
      all[r] = r;

    at::Tensor x = at::empty({numel}, at::kFloat);
    std::mt19937 rng(1234 + comm.rank());
    std::normal_distribution<float> normal(static_cast<float>(comm.rank()), 1.0f);
    float* p = x.data_ptr<float>();
    for (int64_t i = 0; i < numel; ++i)
      p[i] = normal(rng);

    auto [d0, m0] = consensus(comm, x, all);
    if (comm.rank() == 0) {
      std::printf("topology %s, %d ranks, period %d, spectral gap %.4f, %lld floats per rank\n",
                  topo->name().c_str(), n, topo->period(), topo->spectral_gap(),
                  static_cast<long long>(numel));
      std::printf("step %3d  consensus distance %.6e  mean[0] %+.6f\n", 0, d0, m0);
    }
    for (int step = 0; step < steps; ++step) {
      const auto& group = topo->group_of(comm.rank(), step);
      comm.allreduce(x, group.ranks, decent_dp::ReduceOp::kAvg)->wait();
      auto [d, m] = consensus(comm, x, all);
      if (comm.rank() == 0) {
        std::printf("step %3d  consensus distance %.6e  mean[0] %+.6f  (slot %d)\n", step + 1, d, m,
                    topo->slot_index(step));
      }
    }
  } catch (const decent_dp::InvalidArgument& e) {
    // The same on every rank: say it once.
    if (comm.rank() == 0) {
      std::fprintf(stderr, "error: %s\n", e.what());
    }
    return 2;
  } catch (const decent_dp::Error& e) {
    std::fprintf(stderr, "error on rank %d: %s\n", comm.rank(), e.what());
    return 2;
  }
  return 0;
}
