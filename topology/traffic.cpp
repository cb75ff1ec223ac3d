#include "decent_dp/topology/traffic.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

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

NodeShape node_aware_shape(const std::vector<int>& nodes) {
  std::vector<int> sorted = nodes;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> counts;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i == 0 || sorted[i] != sorted[i - 1]) {
      counts.push_back(0);
    }
    ++counts.back();
  }
  if (counts.size() < 2 || counts.front() < 2 ||
      std::any_of(counts.begin(), counts.end(), [&](int c) { return c != counts.front(); })) {
    return {};
  }
  return {static_cast<int>(counts.size()), counts.front()};
}

NodeLayout node_layout(const std::vector<int>& nodes, int index) {
  const NodeShape shape = node_aware_shape(nodes);
  const int k = static_cast<int>(nodes.size());
  if (shape.nodes == 0 || index < 0 || index >= k) {
    throw InvalidArgument(fmt::format(
        "node_layout: needs >= 2 nodes holding the same number (>= 2) of members and an index "
        "in [0, {}], got {} members on {} distinct nodes and index {}",
        k - 1, k, std::set<int>(nodes.begin(), nodes.end()).size(), index));
  }
  NodeLayout out;
  const int mine = nodes[static_cast<size_t>(index)];
  for (int m = 0; m < k; ++m) {
    if (nodes[static_cast<size_t>(m)] == mine) {
      if (m == index) {
        out.local_index = static_cast<int>(out.local.size());
      }
      out.local.push_back(m);
    }
  }
  // Nodes in the order of their first member; from each, its member at local_index.
  std::vector<int> order;
  for (int m = 0; m < k; ++m) {
    if (std::find(order.begin(), order.end(), nodes[static_cast<size_t>(m)]) == order.end()) {
      order.push_back(nodes[static_cast<size_t>(m)]);
    }
  }
  for (int node : order) {
    int seen = 0;
    for (int m = 0; m < k; ++m) {
      if (nodes[static_cast<size_t>(m)] == node && seen++ == out.local_index) {
        if (m == index) {
          out.across_index = static_cast<int>(out.across.size());
        }
        out.across.push_back(m);
      }
    }
  }
  return out;
}

std::vector<AllreduceStage> allreduce_stages(const std::vector<int>& ranks, int local_world_size,
                                             double block_bytes, AllreduceAlgorithm algorithm) {
  const int k = static_cast<int>(ranks.size());
  if (k <= 1) {
    return {};
  }
  // The ring through `members` (positions in the group) as edges between world ranks.
  auto ring = [&ranks](const std::vector<int>& members, std::vector<std::pair<int, int>>& edges) {
    const size_t m = members.size();
    for (size_t i = 0; i < m; ++i) {
      edges.emplace_back(ranks[static_cast<size_t>(members[i])],
                         ranks[static_cast<size_t>(members[(i + 1) % m])]);
    }
  };
  std::vector<int> nodes;
  for (int r : ranks) {
    nodes.push_back(node_of(r, local_world_size));
  }
  const NodeShape shape =
      algorithm == AllreduceAlgorithm::kNodeAware ? node_aware_shape(nodes) : NodeShape{};
  if (shape.nodes == 0) {
    AllreduceStage flat;
    std::vector<int> all(static_cast<size_t>(k));
    for (int m = 0; m < k; ++m) {
      all[static_cast<size_t>(m)] = m;
    }
    ring(all, flat.edges);
    flat.bytes_per_edge = 2.0 * (k - 1) / k * block_bytes;
    flat.steps = 2 * (k - 1);
    return {flat};
  }
  const int g = shape.nodes, l = shape.per_node;
  AllreduceStage inside, across;
  for (int m = 0; m < k; ++m) {
    const NodeLayout layout = node_layout(nodes, m);
    if (layout.local_index == 0) {  // once per node
      ring(layout.local, inside.edges);
    }
    if (layout.across_index == 0) {  // once per position
      ring(layout.across, across.edges);
    }
  }
  inside.bytes_per_edge = static_cast<double>(l - 1) / l * block_bytes;
  inside.steps = l - 1;
  across.bytes_per_edge = 2.0 * (g - 1) / g * block_bytes / l;
  across.steps = 2 * (g - 1);
  return {inside, across, inside};
}

SlotTraffic slot_traffic(const Topology& topology, int s, double block_bytes,
                         AllreduceAlgorithm algorithm) {
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
    t.max_group = std::max(t.max_group, g.size());
    for (const AllreduceStage& stage : allreduce_stages(g.ranks, lws, block_bytes, algorithm)) {
      for (const auto& [from, to] : stage.edges) {
        const double bytes = stage.bytes_per_edge;
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
  }
  return t;
}

std::vector<SlotTraffic> period_traffic(const Topology& topology, double block_bytes,
                                        AllreduceAlgorithm algorithm) {
  std::vector<SlotTraffic> out;
  for (int s = 0; s < topology.period(); ++s) {
    out.push_back(slot_traffic(topology, s, block_bytes, algorithm));
  }
  return out;
}

}  // namespace topology
}  // namespace decent_dp
