#include "decent_dp/topology/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

namespace decent_dp {
namespace topology {
namespace {

bool is_power_of_two(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

int log2_exact(int n) {
  int s = 0;
  while ((1 << s) < n) {
    ++s;
  }
  return s;
}

Group make_group(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  Group g;
  g.self_weight = 1.0 / static_cast<double>(ranks.size());
  g.ranks = std::move(ranks);
  return g;
}

}  // namespace

bool Group::contains(int rank) const {
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

double Group::peer_weight() const {
  return ranks.size() <= 1 ? 0.0 : (1.0 - self_weight) / static_cast<double>(ranks.size() - 1);
}

std::string to_string(const Slot& slot) {
  std::string out;
  for (const auto& g : slot) {
    if (!out.empty()) {
      out += ' ';
    }
    out += fmt::format("[{}]", fmt::join(g.ranks, ","));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Topology

Topology::Topology(std::string name, int world_size, int local_world_size)
    : name_(std::move(name)), world_size_(world_size), local_world_size_(local_world_size) {
  if (world_size_ < 1) {
    throw InvalidArgument(
        fmt::format("topology '{}': world_size must be >= 1, got {}", name_, world_size_));
  }
  if (local_world_size_ < 1 || local_world_size_ > world_size_) {
    throw InvalidArgument(
        fmt::format("topology '{}': local_world_size must be in [1, world_size = {}], got {}",
                    name_, world_size_, local_world_size_));
  }
}

void Topology::materialise() const {
  std::call_once(once_, [this] {
    std::vector<Slot> slots;
    if (world_size_ == 1) {
      // Spec §5: with one rank every topology is local training.
      slots = {Slot{Group{{0}, 1.0}}};
    } else {
      check_world_size();
      slots = make_slots();
    }
    check_slots(slots);
    const int n = world_size_;
    std::vector<int> slot_group(slots.size() * n, -1);
    for (size_t s = 0; s < slots.size(); ++s) {
      for (size_t g = 0; g < slots[s].size(); ++g) {
        for (int r : slots[s][g].ranks) {
          slot_group[s * n + r] = static_cast<int>(g);
        }
      }
    }
    slots_ = std::move(slots);
    slot_group_ = std::move(slot_group);
  });
}

void Topology::check_slots(const std::vector<Slot>& slots) const {
  const int n = world_size_;
  if (slots.empty()) {
    throw TopologyError(
        fmt::format("topology '{}' (n = {}) has no slots; expected at least one", name_, n));
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    std::vector<int> seen(n, 0);
    if (slots[s].empty()) {
      throw TopologyError(
          fmt::format("topology '{}' (n = {}): slot {} has no groups", name_, n, s));
    }
    for (const auto& g : slots[s]) {
      if (g.ranks.empty()) {
        throw TopologyError(
            fmt::format("topology '{}' (n = {}): slot {} has an empty group", name_, n, s));
      }
      if (!std::is_sorted(g.ranks.begin(), g.ranks.end())) {
        throw TopologyError(fmt::format(
            "topology '{}' (n = {}): slot {} group [{}] must list its ranks in ascending order",
            name_, n, s, fmt::join(g.ranks, ",")));
      }
      if (!(g.self_weight > 0.0 && g.self_weight <= 1.0)) {
        throw TopologyError(fmt::format(
            "topology '{}' (n = {}): slot {} group [{}] has self weight {}, expected a value in "
            "(0, 1]",
            name_, n, s, fmt::join(g.ranks, ","), g.self_weight));
      }
      for (int r : g.ranks) {
        if (r < 0 || r >= n) {
          throw TopologyError(fmt::format(
              "topology '{}' (n = {}): slot {} names rank {}, expected ranks in [0, {}]", name_, n,
              s, r, n - 1));
        }
        if (++seen[r] > 1) {
          throw TopologyError(fmt::format(
              "topology '{}' (n = {}): slot {} is not a partition: rank {} appears in more than "
              "one place",
              name_, n, s, r));
        }
      }
    }
    for (int r = 0; r < n; ++r) {
      if (seen[r] == 0) {
        throw TopologyError(fmt::format(
            "topology '{}' (n = {}): slot {} is not a partition: rank {} is in no group", name_, n,
            s, r));
      }
    }
  }
}

void Topology::validate() const {
  materialise();
}

int Topology::period() const {
  materialise();
  return static_cast<int>(slots_.size());
}

const std::vector<Slot>& Topology::slots() const {
  materialise();
  return slots_;
}

const Slot& Topology::slot(int s) const {
  materialise();
  if (s < 0 || s >= static_cast<int>(slots_.size())) {
    throw InvalidArgument(fmt::format("topology '{}': slot index must be in [0, {}), got {}", name_,
                                      slots_.size(), s));
  }
  return slots_[s];
}

int Topology::slot_index(int64_t step) const {
  if (step < 0) {
    throw InvalidArgument(fmt::format("topology '{}': step must be >= 0, got {}", name_, step));
  }
  return static_cast<int>(step % period());
}

const Group& Topology::group_of(int rank, int64_t step) const {
  if (rank < 0 || rank >= world_size_) {
    throw InvalidArgument(
        fmt::format("topology '{}': rank must be in [0, {}), got {}", name_, world_size_, rank));
  }
  const int s = slot_index(step);
  return slots_[s][slot_group_[static_cast<size_t>(s) * world_size_ + rank]];
}

std::vector<std::vector<int>> Topology::distinct_groups() const {
  materialise();
  std::vector<std::vector<int>> out;
  for (const auto& slot : slots_) {
    for (const auto& g : slot) {
      if (std::find(out.begin(), out.end(), g.ranks) == out.end()) {
        out.push_back(g.ranks);
      }
    }
  }
  return out;
}

std::vector<double> Topology::mixing_matrix(int s) const {
  const Slot& sl = slot(s);
  const int n = world_size_;
  if (n > kMaxDenseWorldSize) {
    throw InvalidArgument(fmt::format(
        "topology '{}': mixing matrices and the spectral gap are dense n x n; n must be <= {}, "
        "got {}",
        name_, kMaxDenseWorldSize, n));
  }
  std::vector<double> w(static_cast<size_t>(n) * n, 0.0);
  for (const auto& g : sl) {
    const double peer = g.peer_weight();
    for (int i : g.ranks) {
      for (int j : g.ranks) {
        w[static_cast<size_t>(i) * n + j] = (i == j) ? g.self_weight : peer;
      }
    }
  }
  return w;
}

// Note [spectral gap by repeated squaring]
// The product M of one period's mixing matrices is doubly stochastic, so with
// J = 11^T / n we have MJ = JM = J and the eigenvalues of M - J are those of M with the
// consensus eigenvalue 1 replaced by 0. Hence |lambda_2(M)| = rho(M - J). We compute the
// spectral radius with Gelfand's formula rho(A) = lim ||A^k||^(1/k), taking k = 2^60 by
// squaring a normalised copy of A sixty times and tracking the logarithm of the scale.
// This needs no eigen-solver, handles complex eigenvalue pairs and is exact (0) when one
// period reaches exact consensus, as complete and one-peer-exp do.
double Topology::spectral_gap() const {
  const int n = world_size_;
  if (n == 1) {
    return 1.0;
  }
  const size_t nn = static_cast<size_t>(n) * n;
  auto matmul = [n, nn](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> c(nn, 0.0);
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k < n; ++k) {
        const double aik = a[static_cast<size_t>(i) * n + k];
        if (aik == 0.0) {
          continue;
        }
        for (int j = 0; j < n; ++j) {
          c[static_cast<size_t>(i) * n + j] += aik * b[static_cast<size_t>(k) * n + j];
        }
      }
    }
    return c;
  };
  // Later slots act after earlier ones: M = W_{P-1} ... W_1 W_0.
  std::vector<double> m = mixing_matrix(0);
  for (int s = 1; s < period(); ++s) {
    m = matmul(mixing_matrix(s), m);
  }
  for (auto& v : m) {
    v -= 1.0 / n;
  }
  auto frobenius = [](const std::vector<double>& a) {
    double sum = 0.0;
    for (double v : a) {
      sum += v * v;
    }
    return std::sqrt(sum);
  };
  double norm = frobenius(m);
  if (norm < 1e-14) {
    return 1.0;
  }
  double log_scale = std::log(norm);  // log ||A^(2^k)|| = log_scale + log ||m||
  for (auto& v : m) {
    v /= norm;
  }
  constexpr int kSquarings = 60;
  double power = 1.0;  // 2^k
  for (int k = 0; k < kSquarings; ++k) {
    m = matmul(m, m);
    log_scale *= 2.0;
    power *= 2.0;
    norm = frobenius(m);
    if (norm == 0.0) {
      return 1.0;
    }
    log_scale += std::log(norm);
    for (auto& v : m) {
      v /= norm;
    }
  }
  const double rho = std::exp(log_scale / power);
  return std::clamp(1.0 - rho, 0.0, 1.0);
}

// ---------------------------------------------------------------------------------------
// FunctionTopology

FunctionTopology::FunctionTopology(std::string name, int world_size, int local_world_size,
                                   SlotsFn fn)
    : Topology(std::move(name), world_size, local_world_size), fn_(std::move(fn)) {
  if (!fn_) {
    throw InvalidArgument(fmt::format("topology '{}': the slot function is empty", this->name()));
  }
}

std::vector<Slot> FunctionTopology::make_slots() const {
  return fn_(world_size(), local_world_size());
}

// ---------------------------------------------------------------------------------------
// Built-ins

CompleteTopology::CompleteTopology(int world_size, int local_world_size)
    : Topology("complete", world_size, local_world_size) {}

std::vector<Slot> CompleteTopology::make_slots() const {
  std::vector<int> all(world_size());
  for (int r = 0; r < world_size(); ++r) {
    all[r] = r;
  }
  return {Slot{make_group(std::move(all))}};
}

RingTopology::RingTopology(int world_size, int local_world_size)
    : Topology("ring", world_size, local_world_size) {}

void RingTopology::check_world_size() const {
  if (world_size() % 2 != 0) {
    throw TopologyError(
        fmt::format("ring topology needs an even world size, got {}", world_size()));
  }
}

std::vector<Slot> RingTopology::make_slots() const {
  const int n = world_size();
  Slot first, second;
  for (int i = 0; i < n; i += 2) {
    first.push_back(make_group({i, i + 1}));
    second.push_back(make_group({i, (i - 1 + n) % n}));
  }
  return {first, second};
}

namespace {

// splitmix64: a small, fully specified generator, so every rank (and every standard library)
// draws the same partitions from one seed.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), without modulo bias.
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t v = next();
    while (v >= limit) {
      v = next();
    }
    return v % bound;
  }
};

}  // namespace

RandomGroupsTopology::RandomGroupsTopology(int world_size, int local_world_size, int group_size,
                                           uint64_t seed, int period)
    : Topology(seed == 0 ? fmt::format("random-{}", group_size)
                         : fmt::format("random-{}:{}", group_size, seed),
               world_size, local_world_size),
      group_size_(group_size),
      seed_(seed),
      period_(period) {
  if (group_size < 2) {
    throw InvalidArgument(
        fmt::format("random-<k> topology: the group size k must be >= 2, got {}", group_size));
  }
  if (period < 1) {
    throw InvalidArgument(fmt::format("random-<k> topology: period must be >= 1, got {}", period));
  }
}

std::vector<Slot> RandomGroupsTopology::make_slots() const {
  const int n = world_size();
  const int groups = std::max(1, n / group_size_);
  SplitMix64 gen{seed_ ^ (static_cast<uint64_t>(group_size_) << 32) ^ static_cast<uint64_t>(n)};
  std::vector<Slot> slots;
  for (int s = 0; s < period_; ++s) {
    std::vector<int> order(n);
    for (int r = 0; r < n; ++r) {
      order[r] = r;
    }
    for (int i = n - 1; i > 0; --i) {  // Fisher-Yates
      std::swap(order[i], order[gen.below(static_cast<uint64_t>(i) + 1)]);
    }
    Slot slot;
    int next = 0;
    for (int g = 0; g < groups; ++g) {
      const int size = n / groups + (g < n % groups ? 1 : 0);
      slot.push_back(
          make_group(std::vector<int>(order.begin() + next, order.begin() + next + size)));
      next += size;
    }
    std::sort(slot.begin(), slot.end(),
              [](const Group& a, const Group& b) { return a.ranks.front() < b.ranks.front(); });
    slots.push_back(std::move(slot));
  }
  return slots;
}

OnePeerExpTopology::OnePeerExpTopology(int world_size, int local_world_size)
    : Topology("one-peer-exp", world_size, local_world_size) {}

void OnePeerExpTopology::check_world_size() const {
  if (!is_power_of_two(world_size())) {
    throw TopologyError(fmt::format(
        "one-peer-exp topology needs a world size that is a power of two, got {}", world_size()));
  }
}

std::vector<Slot> OnePeerExpTopology::make_slots() const {
  const int n = world_size();
  std::vector<Slot> slots;
  for (int s = 0; s < log2_exact(n); ++s) {
    Slot slot;
    for (int j = 0; j < n; ++j) {
      if ((j & (1 << s)) == 0) {
        slot.push_back(make_group({j, (j + (1 << s)) % n}));
      }
    }
    slots.push_back(std::move(slot));
  }
  return slots;
}

AlternatingExpRingTopology::AlternatingExpRingTopology(int world_size, int local_world_size)
    : Topology("alternating-exp-ring", world_size, local_world_size) {}

void AlternatingExpRingTopology::check_world_size() const {
  const int n = world_size();
  const int lws = local_world_size();
  if (lws <= 1) {
    throw TopologyError(fmt::format(
        "alternating-exp-ring topology needs local_world_size > 1 (ranks per node), got {}", lws));
  }
  if (n % lws != 0) {
    throw TopologyError(
        fmt::format("alternating-exp-ring topology needs world size {} to be a multiple of "
                    "local_world_size {}",
                    n, lws));
  }
  const int m = n / lws;
  if (m < 2 || !is_power_of_two(m)) {
    throw TopologyError(fmt::format(
        "alternating-exp-ring topology needs a node count (world size / local_world_size = "
        "{} / {}) that is a power of two >= 2, got {}",
        n, lws, m));
  }
}

std::vector<Slot> AlternatingExpRingTopology::make_slots() const {
  const int lws = local_world_size();
  const int m = world_size() / lws;
  auto node_ranks = [lws](int node) {
    std::vector<int> r(lws);
    for (int i = 0; i < lws; ++i) {
      r[i] = node * lws + i;
    }
    return r;
  };
  std::vector<Slot> slots;
  int counter = 0;
  for (int s = 0; s < log2_exact(m); ++s) {
    std::vector<bool> paired(m, false);
    Slot first, second;
    for (int j = 0; j < m; ++j) {
      const int p = (j + (1 << s)) % m;
      if (paired[j] || paired[p] || p == j) {
        continue;
      }
      paired[j] = paired[p] = true;
      std::vector<int> both = node_ranks(j);
      const std::vector<int> other = node_ranks(p);
      both.insert(both.end(), other.begin(), other.end());
      Slot& intra_slot = (counter % 2 == 0) ? first : second;
      Slot& union_slot = (counter % 2 == 0) ? second : first;
      intra_slot.push_back(make_group(node_ranks(j)));
      intra_slot.push_back(make_group(node_ranks(p)));
      union_slot.push_back(make_group(std::move(both)));
      ++counter;
    }
    slots.push_back(std::move(first));
    slots.push_back(std::move(second));
  }
  return slots;
}

// ---------------------------------------------------------------------------------------
// Registry

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, TopologyFactory> factories;
  std::map<std::string, std::string> aliases;

  Registry() {
    factories["complete"] = [](int n, int lws) {
      return std::make_unique<CompleteTopology>(n, lws);
    };
    factories["ring"] = [](int n, int lws) { return std::make_unique<RingTopology>(n, lws); };
    factories["one-peer-exp"] = [](int n, int lws) {
      return std::make_unique<OnePeerExpTopology>(n, lws);
    };
    factories["alternating-exp-ring"] = [](int n, int lws) {
      return std::make_unique<AlternatingExpRingTopology>(n, lws);
    };
    aliases["exp"] = "one-peer-exp";
    aliases["aer"] = "alternating-exp-ring";
  }

  std::string resolve(const std::string& name) const {
    auto it = aliases.find(name);
    return it == aliases.end() ? name : it->second;
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

void check_name(const std::string& name) {
  if (name.empty()) {
    throw InvalidArgument("register_topology: name must be a non-empty string");
  }
}

}  // namespace

void register_topology(const std::string& name, TopologyFactory factory) {
  check_name(name);
  if (!factory) {
    throw InvalidArgument(
        fmt::format("register_topology('{}'): factory must be a non-empty function", name));
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.aliases.erase(name);
  r.factories[name] = std::move(factory);
}

void register_topology(const std::string& name, SlotsFn fn) {
  if (!fn) {
    throw InvalidArgument(
        fmt::format("register_topology('{}'): slot function must be a non-empty function", name));
  }
  register_topology(name, TopologyFactory([name, fn](int n, int lws) {
                      return std::make_unique<FunctionTopology>(name, n, lws, fn);
                    }));
}

void register_alias(const std::string& alias, const std::string& target) {
  check_name(alias);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const std::string resolved = r.resolve(target);
  if (r.factories.count(resolved) == 0) {
    throw InvalidArgument(fmt::format(
        "register_alias('{}'): target '{}' is not a registered topology", alias, target));
  }
  if (r.factories.count(alias) != 0) {
    throw InvalidArgument(fmt::format(
        "register_alias('{}'): a topology with that name is already registered", alias));
  }
  r.aliases[alias] = resolved;
}

namespace {

// "random-<k>" or "random-<k>:<seed>" -> a RandomGroupsTopology factory; InvalidArgument
// naming the expected form otherwise.
TopologyFactory random_groups_factory(const std::string& name) {
  auto number = [&name](const std::string& text, uint64_t max) {
    if (text.empty() || text.size() > 19 ||
        text.find_first_not_of("0123456789") != std::string::npos || std::stoull(text) > max) {
      throw InvalidArgument(fmt::format(
          "unknown topology '{}'; the random-groups family is random-<k> or random-<k>:<seed> "
          "with integers k >= 2 and seed >= 0, e.g. random-5 or random-5:7",
          name));
    }
    return std::stoull(text);
  };
  const std::string rest = name.substr(7);
  const size_t colon = rest.find(':');
  const auto k = static_cast<int>(number(rest.substr(0, colon), 1u << 30));
  const uint64_t seed = colon == std::string::npos ? 0 : number(rest.substr(colon + 1), UINT64_MAX);
  if (k < 2) {
    throw InvalidArgument(
        fmt::format("topology '{}': the group size k must be >= 2, got {}", name, k));
  }
  return [k, seed](int n, int lws) {
    return std::unique_ptr<Topology>(new RandomGroupsTopology(n, lws, k, seed));
  };
}

}  // namespace

bool is_registered(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.factories.count(r.resolve(name)) != 0;
}

std::vector<std::string> registered_topologies() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& kv : r.factories) {
    names.push_back(kv.first);
  }
  return names;
}

std::unique_ptr<Topology> make_topology(const std::string& name, int world_size,
                                        int local_world_size) {
  TopologyFactory factory;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(r.resolve(name));
    if (it == r.factories.end() && name.rfind("random-", 0) == 0) {
      factory = random_groups_factory(name);
    } else if (it == r.factories.end()) {
      std::vector<std::string> known;
      for (const auto& kv : r.factories) {
        known.push_back(kv.first);
      }
      for (const auto& kv : r.aliases) {
        known.push_back(kv.first);
      }
      std::sort(known.begin(), known.end());
      throw InvalidArgument(
          fmt::format("unknown topology '{}'; expected one of: {}, or random-<k>[:<seed>]", name,
                      fmt::join(known, ", ")));
    } else {
      factory = it->second;
    }
  }
  std::unique_ptr<Topology> topo = factory(world_size, local_world_size);
  if (!topo) {
    throw InvalidArgument(
        fmt::format("the factory registered for topology '{}' returned null", name));
  }
  if (topo->world_size() != world_size || topo->local_world_size() != local_world_size) {
    throw InvalidArgument(fmt::format(
        "the factory registered for topology '{}' built a topology for world size {} / "
        "local_world_size {}, expected {} / {}",
        name, topo->world_size(), topo->local_world_size(), world_size, local_world_size));
  }
  topo->validate();
  return topo;
}

}  // namespace topology
}  // namespace decent_dp
