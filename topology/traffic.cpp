#include "decent_dp/topology/traffic.h"

#include <algorithm>

namespace decent_dp {
namespace topology {

namespace {

template <typename T>
T max_of(const std::vector<T>& v) {
  return v.empty() ? T(0) : *std::max_element(v.begin(), v.end());
}

}  // namespace

double SlotTraffic::max_sent() const {
  return max_of(sent);
}
double SlotTraffic::max_sent_inter() const {
  return max_of(sent_inter);
}
double SlotTraffic::max_nic_out() const {
  return max_of(nic_out);
}
double SlotTraffic::max_nic_in() const {
  return max_of(nic_in);
}
int SlotTraffic::max_nic_flows_out() const {
  return max_of(nic_flows_out);
}

SlotTraffic slot_traffic(const Topology& topology, int s, double block_bytes) {
  const int n = topology.world_size();
  const int lws = topology.local_world_size();
  SlotTraffic t;
  t.slot = s;
  t.nodes = (n + lws - 1) / lws;
  t.sent.assign(static_cast<size_t>(n), 0.0);
  t.sent_inter.assign(static_cast<size_t>(n), 0.0);
  t.nic_out.assign(static_cast<size_t>(t.nodes), 0.0);
  t.nic_in.assign(static_cast<size_t>(t.nodes), 0.0);
  t.nic_flows_out.assign(static_cast<size_t>(t.nodes), 0);
  for (const Group& g : topology.slot(s)) {
    const int k = g.size();
    t.max_group = std::max(t.max_group, k);
    if (k <= 1) {
      continue;
    }
    const double bytes = 2.0 * (k - 1) / k * block_bytes;
    for (int i = 0; i < k; ++i) {
      const int from = g.ranks[static_cast<size_t>(i)];
      const int to = g.ranks[static_cast<size_t>((i + 1) % k)];
      t.sent[static_cast<size_t>(from)] += bytes;
      const int a = node_of(from, lws);
      const int b = node_of(to, lws);
      if (a != b) {
        t.sent_inter[static_cast<size_t>(from)] += bytes;
        t.nic_out[static_cast<size_t>(a)] += bytes;
        t.nic_in[static_cast<size_t>(b)] += bytes;
        t.nic_flows_out[static_cast<size_t>(a)] += 1;
      }
    }
  }
  return t;
}

std::vector<SlotTraffic> period_traffic(const Topology& topology, double block_bytes) {
  std::vector<SlotTraffic> out;
  for (int s = 0; s < topology.period(); ++s) {
    out.push_back(slot_traffic(topology, s, block_bytes));
  }
  return out;
}

}  // namespace topology
}  // namespace decent_dp
