// A downstream program that knows decent_dp only through its installed package.
#include <ATen/ops/full.h>

#include <cstdio>

#include <decent_dp/mpi_communicator.h>
#include <topology/topology.h>

int main() {
  decent_dp::MpiCommunicator comm;
  auto topo = decent_dp::topology::make_topology("ring", comm.size(), 1);
  comm.make_groups(topo->distinct_groups());
  auto x = at::full({4}, static_cast<float>(comm.rank() + 1));
  comm.allreduce(x, topo->group_of(comm.rank(), 0).ranks, decent_dp::ReduceOp::kAvg)->wait();
  if (comm.rank() == 0) {
    std::printf("consumer ok: mean %.1f\n", x.data_ptr<float>()[0]);
  }
  return 0;
}
