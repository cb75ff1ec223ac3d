#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "decent_dp/topology/planner.h"
#include "decent_dp/topology/topology.h"
#include "decent_dp/topology/traffic.h"

using namespace decent_dp;
using namespace decent_dp::topology;

namespace {

using GroupList = std::vector<std::vector<int>>;

GroupList groups_of(const Topology& t, int s) {
  GroupList out;
  for (const auto& g : t.slot(s)) {
    out.push_back(g.ranks);
  }
  return out;
}

std::vector<int> range(int a, int b) {
  std::vector<int> r;
  for (int i = a; i <= b; ++i) {
    r.push_back(i);
  }
  return r;
}

bool is_power_of_two(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// Every (name, n, lws) a built-in accepts for n in 1..64.
struct Config {
  std::string name;
  int n;
  int lws;
};

std::vector<Config> valid_configs() {
  std::vector<Config> out;
  for (int n = 1; n <= 64; ++n) {
    out.push_back({"complete", n, 1});
    if (n % 2 == 0 || n == 1)
      out.push_back({"ring", n, 1});
    if (is_power_of_two(n))
      out.push_back({"one-peer-exp", n, 1});
    for (int lws = 2; lws <= n; ++lws) {
      if (n % lws == 0 && is_power_of_two(n / lws) && n / lws >= 2) {
        out.push_back({"alternating-exp-ring", n, lws});
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("worked examples of spec section 5, n = 8", "[topology]") {
  auto ring = make_topology("ring", 8, 1);
  REQUIRE(ring->period() == 2);
  CHECK(groups_of(*ring, 0) == GroupList{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(groups_of(*ring, 1) == GroupList{{0, 7}, {1, 2}, {3, 4}, {5, 6}});

  auto exp = make_topology("one-peer-exp", 8, 1);
  REQUIRE(exp->period() == 3);
  CHECK(groups_of(*exp, 0) == GroupList{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(groups_of(*exp, 1) == GroupList{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(groups_of(*exp, 2) == GroupList{{0, 4}, {1, 5}, {2, 6}, {3, 7}});

  auto aer4 = make_topology("aer", 8, 4);
  REQUIRE(aer4->period() == 2);
  CHECK(groups_of(*aer4, 0) == GroupList{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(groups_of(*aer4, 1) == GroupList{range(0, 7)});

  auto aer2 = make_topology("alternating-exp-ring", 8, 2);
  REQUIRE(aer2->period() == 4);
  CHECK(groups_of(*aer2, 0) == GroupList{{0, 1}, {2, 3}, {4, 5, 6, 7}});
  CHECK(groups_of(*aer2, 1) == GroupList{{0, 1, 2, 3}, {4, 5}, {6, 7}});
  CHECK(groups_of(*aer2, 2) == GroupList{{0, 1}, {4, 5}, {2, 3, 6, 7}});
  CHECK(groups_of(*aer2, 3) == GroupList{{0, 1, 4, 5}, {2, 3}, {6, 7}});

  auto complete = make_topology("complete", 8, 1);
  REQUIRE(complete->period() == 1);
  CHECK(groups_of(*complete, 0) == GroupList{range(0, 7)});
  CHECK(complete->slot(0)[0].self_weight == 1.0 / 8);
}

TEST_CASE("aliases resolve to the canonical topologies", "[topology]") {
  CHECK(make_topology("exp", 4, 1)->name() == "one-peer-exp");
  CHECK(make_topology("aer", 4, 2)->name() == "alternating-exp-ring");
  CHECK(is_registered("exp"));
  CHECK_FALSE(is_registered("nosuch"));
}

TEST_CASE("every slot of every built-in is a partition with weights 1/k, n = 1..64", "[topology]") {
  for (const auto& c : valid_configs()) {
    INFO(c.name << " n=" << c.n << " lws=" << c.lws);
    auto t = make_topology(c.name, c.n, c.lws);
    REQUIRE(t->period() >= 1);
    for (int s = 0; s < t->period(); ++s) {
      std::vector<int> count(c.n, 0);
      for (const auto& g : t->slot(s)) {
        REQUIRE(g.size() >= 1);
        CHECK(g.self_weight == 1.0 / g.size());
        for (int r : g.ranks) {
          REQUIRE(r >= 0);
          REQUIRE(r < c.n);
          ++count[r];
        }
      }
      for (int r = 0; r < c.n; ++r) {
        CHECK(count[r] == 1);
      }
      // group_of agrees with the slot and mixing matrices are doubly stochastic + symmetric.
      const auto w = t->mixing_matrix(s);
      for (int i = 0; i < c.n; ++i) {
        CHECK(t->group_of(i, s).contains(i));
        double row = 0.0;
        for (int j = 0; j < c.n; ++j) {
          row += w[i * c.n + j];
          CHECK(w[i * c.n + j] == w[j * c.n + i]);
        }
        CHECK(row == Approx(1.0).epsilon(1e-12));
      }
    }
    // group_of wraps with the period: the exchange after update u uses slot u mod P.
    CHECK(t->group_of(0, t->period()).ranks == t->group_of(0, 0).ranks);
    const double gap = t->spectral_gap();
    CHECK(gap >= 0.0);
    CHECK(gap <= 1.0);
  }
}

TEST_CASE("the structure of each built-in for larger n", "[topology]") {
  for (int n : {2, 4, 16, 32, 64}) {
    auto exp = make_topology("exp", n, 1);
    CHECK(exp->period() == static_cast<int>(std::log2(n)));
    for (int s = 0; s < exp->period(); ++s) {
      for (const auto& g : exp->slot(s)) {
        REQUIRE(g.size() == 2);
        CHECK(g.ranks[1] - g.ranks[0] == (1 << s));
      }
    }
  }
  for (int n : {2, 6, 10, 64}) {
    auto ring = make_topology("ring", n, 1);
    REQUIRE(ring->period() == 2);
    for (int i = 0; i < n; i += 2) {
      CHECK(ring->group_of(i, 0).ranks == std::vector<int>{i, i + 1});
      const int left = (i - 1 + n) % n;
      CHECK(ring->group_of(i, 1).ranks == std::vector<int>{std::min(i, left), std::max(i, left)});
    }
  }
  // aer with m nodes: 2 * log2(m) slots, groups either one node or two whole nodes.
  auto aer = make_topology("aer", 32, 4);
  CHECK(aer->period() == 2 * 3);
  for (int s = 0; s < aer->period(); ++s) {
    for (const auto& g : aer->slot(s)) {
      CHECK((g.size() == 4 || g.size() == 8));
      CHECK(g.ranks[0] % 4 == 0);
    }
  }
}

TEST_CASE("one rank is local training for every topology", "[topology]") {
  for (const std::string name : {"complete", "ring", "exp", "aer"}) {
    auto t = make_topology(name, 1, 1);
    REQUIRE(t->period() == 1);
    CHECK(groups_of(*t, 0) == GroupList{{0}});
    CHECK(t->spectral_gap() == 1.0);
  }
}

TEST_CASE("constraint violations name the topology, the constraint and the numbers", "[topology]") {
  CHECK_THROWS_MATCHES(make_topology("ring", 5, 1), TopologyError,
                       Catch::Message("ring topology needs an even world size, got 5"));
  CHECK_THROWS_MATCHES(
      make_topology("exp", 6, 1), TopologyError,
      Catch::Message("one-peer-exp topology needs a world size that is a power of two, got 6"));
  CHECK_THROWS_MATCHES(make_topology("aer", 8, 1), TopologyError,
                       Catch::Message("alternating-exp-ring topology needs local_world_size > 1 "
                                      "(ranks per node), got 1"));
  CHECK_THROWS_WITH(make_topology("aer", 12, 5),
                    Catch::Contains("world size 12 to be a multiple of local_world_size 5"));
  CHECK_THROWS_WITH(make_topology("aer", 12, 4), Catch::Contains("power of two >= 2, got 3"));
  CHECK_THROWS_WITH(make_topology("aer", 4, 4), Catch::Contains("power of two >= 2, got 1"));
  CHECK_THROWS_MATCHES(make_topology("nosuch", 4, 1), InvalidArgument,
                       Catch::Message("unknown topology 'nosuch'; expected one of: aer, "
                                      "alternating-exp-ring, complete, exp, one-peer-exp, ring, "
                                      "or random-<k>[:<seed>]"));
  CHECK_THROWS_WITH(make_topology("complete", 0, 1),
                    Catch::Contains("world_size must be >= 1, got 0"));
  CHECK_THROWS_WITH(make_topology("complete", 4, 5),
                    Catch::Contains("local_world_size must be in [1, world_size = 4], got 5"));
  auto ring = make_topology("ring", 4, 1);
  CHECK_THROWS_WITH(ring->group_of(4, 0), Catch::Contains("rank must be in [0, 4), got 4"));
  CHECK_THROWS_WITH(ring->slot(2), Catch::Contains("slot index must be in [0, 2), got 2"));
  CHECK_THROWS_WITH(ring->group_of(0, -1), Catch::Contains("step must be >= 0, got -1"));
}

namespace {

// A user topology by subclass: ranks pair with their mirror image, then everyone mixes.
class MirrorTopology : public Topology {
 public:
  MirrorTopology(int n, int lws) : Topology("mirror", n, lws) {}

 protected:
  void check_world_size() const override {
    if (world_size() % 2 != 0) {
      throw TopologyError("mirror needs an even world size");
    }
  }
  std::vector<Slot> make_slots() const override {
    const int n = world_size();
    Slot pairs;
    for (int i = 0; i < n / 2; ++i) {
      pairs.push_back(Group{{i, n - 1 - i}, 0.5});
    }
    Slot all{Group{range(0, n - 1), 1.0 / n}};
    return {pairs, all};
  }
};

}  // namespace

TEST_CASE("user-registered topologies work by subclass and by function", "[topology]") {
  register_topology("mirror", TopologyFactory([](int n, int lws) {
                      return std::make_unique<MirrorTopology>(n, lws);
                    }));
  auto mirror = make_topology("mirror", 6, 1);
  CHECK(groups_of(*mirror, 0) == GroupList{{0, 5}, {1, 4}, {2, 3}});
  CHECK(mirror->group_of(4, 0).ranks == std::vector<int>{1, 4});
  CHECK(mirror->group_of(4, 1).ranks == range(0, 5));
  CHECK_THROWS_WITH(make_topology("mirror", 5, 1), "mirror needs an even world size");
  CHECK(mirror->spectral_gap() == Approx(1.0));

  // A function returning the slot list; weights other than 1/k are allowed.
  register_topology("lazy3", SlotsFn([](int n, int) {
                      std::vector<Slot> slots{Slot{Group{range(0, n - 1), 0.5}}};
                      return slots;
                    }));
  auto lazy = make_topology("lazy3", 3, 1);
  // W = 0.5 I + 0.25 (11^T - I): eigenvalues 1 and 0.25 (twice), so the gap is 0.75.
  const auto w = lazy->mixing_matrix(0);
  CHECK(w[0] == 0.5);
  CHECK(w[1] == 0.25);
  CHECK(lazy->spectral_gap() == Approx(0.75).epsilon(1e-9));

  register_alias("lazy", "lazy3");
  CHECK(make_topology("lazy", 3, 1)->period() == 1);
  CHECK_THROWS_WITH(register_alias("x", "nosuch"), Catch::Contains("is not a registered"));

  // A broken user topology is rejected with the reason.
  register_topology("broken", SlotsFn([](int n, int) {
                      return std::vector<Slot>{Slot{Group{{0}, 1.0}}};
                    }));
  CHECK_THROWS_MATCHES(make_topology("broken", 2, 1), TopologyError,
                       Catch::Message("topology 'broken' (n = 2): slot 0 is not a partition: "
                                      "rank 1 is in no group"));
  register_topology("heavy", SlotsFn([](int n, int) {
                      return std::vector<Slot>{Slot{Group{{0, 1}, 1.5}}};
                    }));
  CHECK_THROWS_WITH(make_topology("heavy", 2, 1),
                    Catch::Contains("has self weight 1.5, expected a value in (0, 1]"));
  register_topology("twice", SlotsFn([](int n, int) {
                      return std::vector<Slot>{Slot{Group{{0, 1}, 0.5}, Group{{1}, 1.0}}};
                    }));
  CHECK_THROWS_WITH(make_topology("twice", 2, 1),
                    Catch::Contains("rank 1 appears in more than one place"));
}

TEST_CASE("spectral gap", "[topology]") {
  CHECK(make_topology("complete", 7, 1)->spectral_gap() == 1.0);
  CHECK(make_topology("complete", 64, 1)->spectral_gap() == 1.0);
  // One-peer exponential graphs reach exact consensus after one period.
  CHECK(make_topology("exp", 16, 1)->spectral_gap() == Approx(1.0));
  // ring n = 4: averaging pairs (0,1)(2,3) then (0,3)(1,2) gives the exact mean.
  CHECK(make_topology("ring", 4, 1)->spectral_gap() == Approx(1.0));
  // Larger rings mix slowly and more slowly as they grow.
  const double g8 = make_topology("ring", 8, 1)->spectral_gap();
  const double g32 = make_topology("ring", 32, 1)->spectral_gap();
  CHECK(g8 > 0.0);
  CHECK(g8 < 1.0);
  CHECK(g32 < g8);
  // Two disconnected halves never agree.
  register_topology("halves", SlotsFn([](int n, int) {
                      return std::vector<Slot>{Slot{Group{range(0, n / 2 - 1), 2.0 / n},
                                                    Group{range(n / 2, n - 1), 2.0 / n}}};
                    }));
  CHECK(make_topology("halves", 4, 1)->spectral_gap() == Approx(0.0).margin(1e-9));
}

TEST_CASE("distinct groups list every group once in first-appearance order", "[topology]") {
  auto aer = make_topology("aer", 8, 2);
  const auto groups = aer->distinct_groups();
  std::set<std::vector<int>> unique(groups.begin(), groups.end());
  CHECK(unique.size() == groups.size());
  CHECK(groups.front() == std::vector<int>{0, 1});
  auto ring2 = make_topology("ring", 2, 1);
  CHECK(ring2->distinct_groups() == GroupList{{0, 1}});
}

TEST_CASE("dense matrices of huge worlds are refused with the limit, not bad_alloc", "[topology]") {
  auto topo = make_topology("complete", 100000, 1);
  CHECK(topo->period() == 1);
  CHECK_THROWS_WITH(topo->mixing_matrix(0), Catch::Contains("n must be <= 4096, got 100000"));
  CHECK_THROWS_WITH(topo->spectral_gap(), Catch::Contains("n must be <= 4096, got 100000"));
}

TEST_CASE("random-<k>: seeded partitions into groups of at least k", "[topology][random]") {
  for (int n : {2, 5, 8, 11, 16}) {
    for (int k : {2, 3, 5}) {
      INFO("n " << n << " k " << k);
      auto t = make_topology("random-" + std::to_string(k), n, 1);
      CHECK(t->name() == "random-" + std::to_string(k));
      CHECK(t->period() == RandomGroupsTopology::kDefaultPeriod);
      for (int s = 0; s < t->period(); ++s) {
        std::vector<int> seen(n, 0);
        for (const auto& g : t->slot(s)) {
          // floor(n / k) groups as even as possible (one group of all ranks when n < 2k),
          // mixing uniformly.
          if (n >= 2 * k) {
            CHECK(g.size() >= k);
            CHECK(g.size() <= (n + n / k - 1) / (n / k));
          } else {
            CHECK(g.size() == n);
          }
          CHECK(g.self_weight == Approx(1.0 / g.size()));
          for (int r : g.ranks)
            ++seen[r];
        }
        CHECK(std::count(seen.begin(), seen.end(), 1) == n);  // a partition
      }
    }
  }
  // The same slots for the same name (every rank builds the same schedule), other ones for
  // another seed, and not the same partition in every slot.
  auto a = make_topology("random-3", 12, 1);
  auto b = make_topology("random-3", 12, 1);
  auto c = make_topology("random-3:7", 12, 1);
  CHECK(c->name() == "random-3:7");
  bool differs_from_c = false, slots_vary = false;
  for (int s = 0; s < a->period(); ++s) {
    CHECK(a->slot(s) == b->slot(s));
    differs_from_c = differs_from_c || !(a->slot(s) == c->slot(s));
    slots_vary = slots_vary || !(a->slot(s) == a->slot(0));
  }
  CHECK(differs_from_c);
  CHECK(slots_vary);
  // Each rank meets many others over one period.
  std::vector<int> met(12, 0);
  for (int s = 0; s < a->period(); ++s)
    for (int r : a->group_of(0, s).ranks)
      met[r] = 1;
  CHECK(std::count(met.begin(), met.end(), 1) >= 8);
}

TEST_CASE("random-<k>: malformed names are refused with the expected form", "[topology][random]") {
  for (const char* bad :
       {"random-", "random-x", "random-3:", "random-3:y", "random--3", "random-3:1:2"})
    CHECK_THROWS_WITH(make_topology(bad, 8, 1), Catch::Contains("random-<k> or random-<k>:<seed>"));
  CHECK_THROWS_WITH(make_topology("random-1", 8, 1), Catch::Contains("must be >= 2, got 1"));
  CHECK_THROWS_WITH(make_topology("nonesuch", 8, 1), Catch::Contains("or random-<k>[:<seed>]"));
}

namespace {

// Per node of one slot: (bytes out through the NIC, ranks sending across), block B = 8.
using NicSlot = std::vector<std::pair<double, int>>;

std::vector<NicSlot> nic_table(const std::string& name, int n, int lws,
                               AllreduceAlgorithm algorithm = AllreduceAlgorithm::kRing) {
  auto t = make_topology(name, n, lws);
  std::vector<NicSlot> out;
  for (const SlotTraffic& s : period_traffic(*t, 8.0, algorithm)) {
    NicSlot row;
    for (int node = 0; node < s.nodes; ++node) {
      row.emplace_back(s.nic_out[static_cast<size_t>(node)],
                       s.nic_flows_out[static_cast<size_t>(node)]);
      // A ring enters a node as often as it leaves it.
      CHECK(s.nic_in[static_cast<size_t>(node)] == s.nic_out[static_cast<size_t>(node)]);
    }
    out.push_back(row);
  }
  return out;
}

}  // namespace

TEST_CASE("traffic: bytes per rank and per NIC of every built-in at n = 8, flat rings",
          "[topology][traffic]") {
  // Block B = 8 bytes. A group of k runs a ring all-reduce in rank order: each member sends
  // 2 (k - 1) / k B to the next, so 14 at k = 8, 12 at k = 4 and 8 at k = 2.
  using P = std::pair<double, int>;
  SECTION("complete") {
    // One ring 0 -> 1 -> ... -> 7 -> 0: it leaves each node once, from the node's last rank.
    CHECK(nic_table("complete", 8, 2) ==
          std::vector<NicSlot>{{P{14, 1}, P{14, 1}, P{14, 1}, P{14, 1}}});
    CHECK(nic_table("complete", 8, 4) == std::vector<NicSlot>{{P{14, 1}, P{14, 1}}});
    auto t = make_topology("complete", 8, 2);
    const SlotTraffic s = slot_traffic(*t, 0, 8.0, AllreduceAlgorithm::kRing);
    CHECK(s.sent == std::vector<double>(8, 14.0));
    CHECK(s.sent_inter == std::vector<double>{0, 14, 0, 14, 0, 14, 0, 14});
    CHECK(s.max_group == 8);
  }
  SECTION("ring") {
    // Slot 0 pairs [0,1] [2,3] ...: inside nodes at lws 2 and 4. Slot 1 pairs [0,7] [1,2]
    // [3,4] [5,6]: at lws 2 every pair crosses (two flows of B per node); at lws 4 only
    // [0,7] and [3,4] do (ranks 0 and 3 of node 0, 4 and 7 of node 1).
    CHECK(nic_table("ring", 8, 2) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}, P{0, 0}, P{0, 0}},
                               {P{16, 2}, P{16, 2}, P{16, 2}, P{16, 2}}});
    CHECK(nic_table("ring", 8, 4) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}}, {P{16, 2}, P{16, 2}}});
    auto t = make_topology("ring", 8, 4);
    CHECK(slot_traffic(*t, 1, 8.0, AllreduceAlgorithm::kRing).sent_inter ==
          std::vector<double>{8, 0, 0, 8, 8, 0, 0, 8});
  }
  SECTION("one-peer-exp") {
    // Slots pair j with j + 1, j + 2, j + 4: at lws 2 the last two cross with both ranks
    // of each node; at lws 4 only the last does, with all four.
    CHECK(nic_table("one-peer-exp", 8, 2) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}, P{0, 0}, P{0, 0}},
                               {P{16, 2}, P{16, 2}, P{16, 2}, P{16, 2}},
                               {P{16, 2}, P{16, 2}, P{16, 2}, P{16, 2}}});
    CHECK(nic_table("one-peer-exp", 8, 4) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}}, {P{0, 0}, P{0, 0}}, {P{32, 4}, P{32, 4}}});
  }
  SECTION("alternating-exp-ring") {
    // lws 2, four nodes: each slot joins one pair of nodes into a group of 4 (a ring that
    // leaves each of its two nodes once with 12 bytes) while the other nodes mix inside.
    CHECK(nic_table("aer", 8, 2) == std::vector<NicSlot>{{P{0, 0}, P{0, 0}, P{12, 1}, P{12, 1}},
                                                         {P{12, 1}, P{12, 1}, P{0, 0}, P{0, 0}},
                                                         {P{0, 0}, P{12, 1}, P{0, 0}, P{12, 1}},
                                                         {P{12, 1}, P{0, 0}, P{12, 1}, P{0, 0}}});
    // lws 4, two nodes: inside the nodes, then all eight ranks as one ring.
    CHECK(nic_table("aer", 8, 4) == std::vector<NicSlot>{{P{0, 0}, P{0, 0}}, {P{14, 1}, P{14, 1}}});
    auto t = make_topology("aer", 8, 2);
    const SlotTraffic s = slot_traffic(*t, 0, 8.0, AllreduceAlgorithm::kRing);
    CHECK(s.sent == std::vector<double>{8, 8, 8, 8, 12, 12, 12, 12});
    CHECK(s.sent_inter == std::vector<double>{0, 0, 0, 0, 0, 12, 0, 12});
    CHECK(s.max_group == 4);
    CHECK(s.max_nic_out() == 12);
    CHECK(s.max_nic_flows_out() == 1);
  }
  SECTION("one node and singletons") {
    auto t = make_topology("complete", 4, 4);
    const SlotTraffic s = slot_traffic(*t, 0, 8.0, AllreduceAlgorithm::kRing);
    CHECK(s.nodes == 1);
    CHECK(s.max_sent_inter() == 0);
    CHECK(s.max_sent() == 12);
    auto one = make_topology("complete", 1, 1);
    CHECK(slot_traffic(*one, 0, 8.0, AllreduceAlgorithm::kRing).max_sent() == 0);
  }
}

TEST_CASE("traffic: the node-aware all-reduce at n = 8", "[topology][traffic]") {
  // Block B = 8 bytes. A group of g >= 2 nodes of l >= 2 members each: a reduce-scatter
  // inside each node ((l - 1) / l B per edge), a ring across the nodes for each of the l
  // chunks (2 (g - 1) / g B / l per edge: l flows out of each NIC), an all-gather inside.
  // Every member still sends 2 (k - 1) / k B in all. Groups of other shapes take the ring.
  using P = std::pair<double, int>;
  const auto node_aware = AllreduceAlgorithm::kNodeAware;
  SECTION("complete") {
    // lws 2: g = 4, chunks of 4, 6 bytes per edge across, two flows per NIC: 12 (flat: 14).
    CHECK(nic_table("complete", 8, 2, node_aware) ==
          std::vector<NicSlot>{{P{12, 2}, P{12, 2}, P{12, 2}, P{12, 2}}});
    // lws 4: g = 2, chunks of 2, 2 bytes per edge across, four flows per NIC: 8 (flat: 14).
    CHECK(nic_table("complete", 8, 4, node_aware) == std::vector<NicSlot>{{P{8, 4}, P{8, 4}}});
    auto t = make_topology("complete", 8, 2);
    const SlotTraffic s = slot_traffic(*t, 0, 8.0);  // node-aware is the default
    CHECK(s.sent == std::vector<double>(8, 14.0));
    CHECK(s.sent_inter == std::vector<double>(8, 6.0));
  }
  SECTION("pairs across nodes have one member per node: the ring, as before") {
    for (const char* name : {"ring", "one-peer-exp"}) {
      for (int lws : {2, 4}) {
        INFO(name << " lws " << lws);
        CHECK(nic_table(name, 8, lws, node_aware) == nic_table(name, 8, lws));
      }
    }
  }
  SECTION("alternating-exp-ring") {
    // lws 2: the group of 4 over two nodes sends 4 bytes per edge across, two flows per NIC:
    // 8 out of each of its NICs (flat: 12).
    CHECK(nic_table("aer", 8, 2, node_aware) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}, P{8, 2}, P{8, 2}},
                               {P{8, 2}, P{8, 2}, P{0, 0}, P{0, 0}},
                               {P{0, 0}, P{8, 2}, P{0, 0}, P{8, 2}},
                               {P{8, 2}, P{0, 0}, P{8, 2}, P{0, 0}}});
    CHECK(nic_table("aer", 8, 4, node_aware) ==
          std::vector<NicSlot>{{P{0, 0}, P{0, 0}}, {P{8, 4}, P{8, 4}}});
    auto t = make_topology("aer", 8, 2);
    const SlotTraffic s = slot_traffic(*t, 0, 8.0, node_aware);
    CHECK(s.sent == std::vector<double>{8, 8, 8, 8, 12, 12, 12, 12});
    CHECK(s.sent_inter == std::vector<double>{0, 0, 0, 0, 4, 4, 4, 4});
  }
  SECTION("the stages of one group, its shape and layout") {
    const auto stages = allreduce_stages({4, 5, 6, 7}, 2, 8.0, node_aware);
    REQUIRE(stages.size() == 3);
    using E = std::vector<std::pair<int, int>>;
    CHECK(stages[0].edges == E{{4, 5}, {5, 4}, {6, 7}, {7, 6}});
    CHECK(stages[0].bytes_per_edge == 4.0);
    CHECK(stages[0].steps == 1);
    CHECK(stages[1].edges == E{{4, 6}, {6, 4}, {5, 7}, {7, 5}});
    CHECK(stages[1].bytes_per_edge == 4.0);
    CHECK(stages[1].steps == 2);
    CHECK(stages[2].edges == stages[0].edges);
    const auto flat = allreduce_stages({4, 5, 6, 7}, 2, 8.0, AllreduceAlgorithm::kRing);
    REQUIRE(flat.size() == 1);
    CHECK(flat[0].edges == E{{4, 5}, {5, 6}, {6, 7}, {7, 4}});
    CHECK(flat[0].bytes_per_edge == 12.0);
    CHECK(flat[0].steps == 6);
    CHECK(allreduce_stages({3}, 2, 8.0, node_aware).empty());
    CHECK(allreduce_stages({0, 1, 2}, 2, 8.0, node_aware).size() == 1);  // 2 + 1: the ring
    // Node ids in any order; nodes ordered by their first member.
    CHECK(node_aware_shape({5, 3, 5, 3}).nodes == 2);
    CHECK(node_aware_shape({5, 3, 5, 3}).per_node == 2);
    CHECK(node_aware_shape({1, 1, 1, 1}).nodes == 0);     // one node
    CHECK(node_aware_shape({1, 2, 3}).nodes == 0);        // one member per node
    CHECK(node_aware_shape({1, 1, 2, 2, 2}).nodes == 0);  // unequal shares
    const NodeLayout layout = node_layout({5, 3, 5, 3}, 3);
    CHECK(layout.local == std::vector<int>{1, 3});
    CHECK(layout.local_index == 1);
    CHECK(layout.across == std::vector<int>{2, 3});
    CHECK(layout.across_index == 1);
    CHECK_THROWS_WITH(node_layout({1, 1, 2}, 0),
                      Catch::Contains("3 members on 2 distinct nodes and index 0"));
    CHECK_THROWS_WITH(node_layout({1, 1, 2, 2}, 4), Catch::Contains("index in [0, 3]"));
  }
}

TEST_CASE("planner: hand-computed step times", "[topology][planner]") {
  PlanInputs in;
  in.bucket_bytes = {4e6};
  in.backward_fraction = 0.5;
  in.intra_bw = 1e9;
  in.inter_bw = 1e8;
  SECTION("one node") {
    // complete on 4 ranks of one node: a ring of 6 steps of 1 MB at 1 GB/s = 6 ms. Gossip
    // hides it behind the next step's 100 ms; all-reduce waits for it after the backward.
    in.compute_ms = 100;
    auto t = make_topology("complete", 4, 4);
    const Prediction g = predict_gossip(*t, in);
    CHECK(g.step_ms == Approx(100.0));
    CHECK(g.comm_ms == Approx(6.0));
    CHECK(g.wait_ms == Approx(0.0).margin(1e-9));
    CHECK(predict_allreduce(4, 4, in).step_ms == Approx(106.0));
  }
  SECTION("two nodes, slots alternating light and heavy") {
    in.node_aware = false;  // the flat ring (the next section: node-aware)
    // ring on 2 nodes of 2: slot 0 pairs inside nodes (2 steps of 2 MB at 1 GB/s = 4 ms),
    // slot 1 pairs across, two flows sharing each 100 MB/s NIC (2 x 2 MB / 50 MB/s = 80 ms).
    // With 50 ms of compute, every cross exchange makes the next step wait: two steps take
    // 80 + 50 ms, so 65 ms per step. All-reduce: one ring over both nodes, one flow per NIC,
    // 6 steps of 1 MB at 100 MB/s = 60 ms after each 50 ms step: 110 ms.
    in.compute_ms = 50;
    auto t = make_topology("ring", 4, 2);
    const Prediction g = predict_gossip(*t, in);
    CHECK(g.step_ms == Approx(65.0));
    CHECK(g.wait_ms == Approx(15.0));  // 30 ms every second step
    CHECK(g.comm_ms == Approx(42.0));  // (4 + 80) / 2
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(110.0));
    // One slow link: a cap of 30 MB/s per flow. Across: 2 x 2 MB / 30 MB/s = 133.3 ms, so
    // (133.3 + 50) / 2 per step; all-reduce: 6 x 1 MB / 30 MB/s = 200 ms, 250 per step.
    in.flow_bw = 3e7;
    CHECK(predict_gossip(*t, in).step_ms == Approx((4e6 / 3e7 * 1e3 + 50) / 2));
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(250.0));
    // Latency: 10 ms per ring step adds 2 x 10 to the cross pair, 6 x 10 to all-reduce.
    in.flow_bw = 0;
    in.latency_us = 10000;
    CHECK(predict_gossip(*t, in).step_ms == Approx((100.0 + 50) / 2));
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(170.0));
  }
  SECTION("two nodes: the node-aware all-reduce") {
    // All-reduce of 4 MB over 2 nodes of 2: a reduce-scatter inside each node (2 MB per edge
    // at 1 GB/s: 2 ms), each 2 MB chunk across on its own ring of 2 (2 MB per edge, two flows
    // per NIC at 50 MB/s: 40 ms), an all-gather inside (2 ms): 44 ms after each 50 ms step
    // (the flat ring: 60). The ring topology's pairs across have one member per node: as
    // before. Latency: 1 + 2 + 1 steps of 10 ms.
    in.compute_ms = 50;
    in.node_aware = true;
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(94.0));
    auto t = make_topology("ring", 4, 2);
    CHECK(predict_gossip(*t, in).step_ms == Approx(65.0));
    in.latency_us = 10000;
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(134.0));
    in.latency_us = 0;
    in.node_aware = false;
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(110.0));
    // AER on 2 nodes of 2: slot 0 inside the nodes (2 steps of 2 MB at 1 GB/s: 4 ms, hidden),
    // slot 1 all four. Flat, 60 ms outlast the next step's 50, which waits 10 ms: two steps
    // take 60 + 50 ms. Node-aware, 44 ms hide behind it: 50 ms per step.
    auto aer = make_topology("aer", 4, 2);
    CHECK(predict_gossip(*aer, in).step_ms == Approx(55.0));
    in.node_aware = true;
    CHECK(predict_gossip(*aer, in).step_ms == Approx(50.0));
    CHECK(predict_gossip(*aer, in).comm_ms == Approx((4.0 + 44.0) / 2));
  }
  SECTION("pairs and rings share a NIC with their own efficiencies") {
    // Note [pairs and rings share a NIC differently]. All-reduce of 4 MB over 4 nodes of 2,
    // node-aware: a reduce-scatter inside each node (2 MB at 1 GB/s: 2 ms), each 2 MB chunk on
    // its own ring of 4 across the nodes (2 x 3/4 x 2 MB = 3 MB per edge; every NIC has the two
    // rings' flows, one way each: ring_efficiency), an all-gather inside (2 ms).
    in.compute_ms = 50;
    in.node_aware = true;
    in.shared_efficiency = 0.5;
    // ring_efficiency 0 takes shared_efficiency: 25 MB/s per flow, 120 ms across.
    CHECK(predict_allreduce(8, 2, in).step_ms == Approx(50.0 + 2 + 120 + 2));
    in.ring_efficiency = 1;  // 50 MB/s per flow: 60 ms
    CHECK(predict_allreduce(8, 2, in).step_ms == Approx(50.0 + 2 + 60 + 2));
    // On 2 nodes the chunks cross on rings of two (pairs, data both ways): shared_efficiency,
    // 2 MB at 25 MB/s = 80 ms, whatever ring_efficiency says.
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(50.0 + 2 + 80 + 2));
    in.ring_efficiency = 0.25;
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(50.0 + 2 + 80 + 2));
    // The ring topology's slot across (pairs [1,2] [3,0] at n = 4, lws = 2): pairs too. Its
    // flat all-reduce, one flow per NIC, takes no efficiency at all: 6 x 1 MB at 100 MB/s.
    auto t = make_topology("ring", 4, 2);
    in.ring_efficiency = 1;
    const double with_ring = predict_gossip(*t, in).step_ms;
    in.ring_efficiency = 0;
    CHECK(predict_gossip(*t, in).step_ms == Approx(with_ring));
    CHECK(with_ring == Approx((4.0 / 25 * 1e3 + 50) / 2));
    in.node_aware = false;
    in.ring_efficiency = 0.25;
    CHECK(predict_allreduce(4, 2, in).step_ms == Approx(110.0));
  }
  SECTION("buckets: all-reduce overlaps the earlier buckets with the backward") {
    // Two equal buckets of 2 MB on one node of 4 (3 ms each), 100 ms compute: the first
    // all-reduce runs during the second half of the backward, only the second one is exposed.
    in.compute_ms = 100;
    in.bucket_bytes = {2e6, 2e6};
    CHECK(predict_allreduce(4, 4, in).step_ms == Approx(103.0));
    CHECK(buckets_of(10, 4, 16.0 / 1048576.0) == std::vector<double>{16, 16, 8});
  }
  SECTION("a step's exchanges sharing the links finish together") {
    // ring on 2 nodes of 2, buckets of 3 MB and 1 MB: across, two flows share each NIC
    // (50 MB/s per pair). One after another, the first bucket is done 60 ms after its launch
    // and the second 20 ms later. Sharing the pair's link, the small one finishes first and
    // the large one only with the whole 80 ms, so the next step's first update waits longer.
    // With one bucket the two models agree.
    in.compute_ms = 50;
    in.bucket_bytes = {3e6, 1e6};
    auto t = make_topology("ring", 4, 2);
    const double shared = predict_gossip(*t, in).step_ms;
    in.shared_exchanges = false;
    const double fifo = predict_gossip(*t, in).step_ms;
    CHECK(shared > fifo);
    in.bucket_bytes = {4e6};
    const double one_fifo = predict_gossip(*t, in).step_ms;
    in.shared_exchanges = true;
    CHECK(predict_gossip(*t, in).step_ms == Approx(one_fifo));
  }
  SECTION("flows are counted while they are in flight, not per slot") {
    // Slot 0 pairs 0 and 2 across (1 and 3 alone), slot 1 pairs 1 and 3 across. Each slot has
    // one flow per NIC, but an 8 MB exchange (80 ms alone at 100 MB/s) outlasts the 50 ms
    // step, so the next slot's pair starts while it runs and the two share the NIC (50 MB/s
    // each). Steady state, for every pair: 5 MB alone (50 ms), 3 MB sharing (60 ms) while
    // the other pair moves its first 3 MB, then 50 ms for the other pair's last 5 MB; the
    // pair launches again then: 160 ms per two steps. Busy 110 ms of them; the rank whose
    // exchange ran waits 60 ms in the step after it.
    register_topology("staggered", SlotsFn([](int, int) {
                        return std::vector<Slot>{
                            Slot{Group{{0, 2}, 0.5}, Group{{1}, 1.0}, Group{{3}, 1.0}},
                            Slot{Group{{1, 3}, 0.5}, Group{{0}, 1.0}, Group{{2}, 1.0}}};
                      }));
    auto t = make_topology("staggered", 4, 2);
    in.compute_ms = 50;
    in.bucket_bytes = {8e6};
    const Prediction g = predict_gossip(*t, in);
    CHECK(g.step_ms == Approx(80.0));
    CHECK(g.comm_ms == Approx(55.0));
    CHECK(g.wait_ms == Approx(30.0));
    // With a longer step the exchanges never overlap: 80 ms each, hidden behind 100 ms.
    in.compute_ms = 100;
    CHECK(predict_gossip(*t, in).step_ms == Approx(100.0));
    CHECK(predict_gossip(*t, in).comm_ms == Approx(40.0));
  }
  SECTION("bad inputs are named") {
    in.compute_ms = 10;
    in.inter_bw = 0;
    auto t = make_topology("complete", 4, 2);
    CHECK_THROWS_WITH(predict_gossip(*t, in), Catch::Contains("inter_bw (bytes/s) must be > 0"));
    in.inter_bw = 1e8;
    in.bucket_bytes.clear();
    CHECK_THROWS_WITH(predict_allreduce(4, 2, in), Catch::Contains("bucket_bytes must list"));
    CHECK_THROWS_WITH(buckets_of(0, 4, 25), Catch::Contains("params must be >= 1"));
    CHECK_THROWS_WITH(buckets_of(1e12, 4, 1e-3), Catch::Contains("use a larger bucket cap"));
    CHECK(buckets_of(8, 4, 16.0 / 1048576.0) == std::vector<double>{16, 16});  // exact fit
    in.bucket_bytes = {1e6};
    in.shared_efficiency = 0;
    CHECK_THROWS_WITH(predict_allreduce(4, 2, in),
                      Catch::Contains("shared_efficiency must be in (0, 1]"));
    in.shared_efficiency = 1;
    in.ring_efficiency = 1.5;
    CHECK_THROWS_WITH(predict_allreduce(4, 2, in),
                      Catch::Contains("ring_efficiency must be in (0, 1] (0: shared_efficiency)"));
  }
}
