// Topologies: who mixes with whom at each step of decentralized training.
//
// A topology is a periodic list of slots. Each slot partitions the ranks 0..n-1 into
// groups; inside a group every member mixes its parameters with the group using the
// group's self weight w (see spec §1):
//
//   mix_R(x)_i = w * x_i + (1 - w) / (k - 1) * sum_{j in R, j != i} x_j,   k = |R|.
//
// The exchange after update u uses slot u mod P. This header has no dependency on
// LibTorch or MPI.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace topology {

// One group of a slot: its member ranks in ascending order and their self weight.
struct Group {
  std::vector<int> ranks;
  double self_weight = 1.0;

  int size() const { return static_cast<int>(ranks.size()); }
  bool contains(int rank) const;
  // Weight of every other member in the mixing: (1 - w) / (k - 1), 0 for k = 1.
  double peer_weight() const;
  bool operator==(const Group& other) const {
    return ranks == other.ranks && self_weight == other.self_weight;
  }
};

// One entry of the periodic schedule: a partition of all ranks into groups.
using Slot = std::vector<Group>;

// Base class of every topology. Subclasses describe their schedule in make_slots();
// the base materialises it once (thread-safe, on first use), validates it and answers
// every query from that cache.
class Topology {
 public:
  // world_size >= 1; local_world_size in [1, world_size] (ranks per node).
  Topology(std::string name, int world_size, int local_world_size);
  virtual ~Topology() = default;

  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  const std::string& name() const { return name_; }
  int world_size() const { return world_size_; }
  int local_world_size() const { return local_world_size_; }

  // Number of slots in one period.
  int period() const;
  // All slots of one period.
  const std::vector<Slot>& slots() const;
  // Slot s, 0 <= s < period().
  const Slot& slot(int s) const;
  // Slot used by the exchange after update `step` (step mod period).
  int slot_index(int64_t step) const;
  // The group holding `rank` in slot `step mod period()`.
  const Group& group_of(int rank, int64_t step) const;
  // Every distinct group (by member list) over all slots, in first-appearance order.
  // Communicators create one sub-communicator per entry, collectively and in this order.
  std::vector<std::vector<int>> distinct_groups() const;

  // The largest world size mixing_matrix() and spectral_gap() accept (dense n x n
  // matrices: 128 MiB each at this size).
  static constexpr int kMaxDenseWorldSize = 4096;
  // Row-major n*n mixing matrix W of slot s: x(after) = W x(before).
  std::vector<double> mixing_matrix(int s) const;
  // Spectral gap 1 - |lambda_2| of the product of one period's mixing matrices: 1 means
  // exact consensus after one period, 0 means the ranks never agree. Dense: O(n^3) per
  // squaring (about a second at n = 256, minutes beyond 1000).
  double spectral_gap() const;

  // Checks the world-size constraints and that every slot is a partition of 0..n-1 with
  // weights in (0, 1]; throws TopologyError naming the topology, constraint and numbers.
  void validate() const;

 protected:
  // The schedule of one period. Called once, after check_world_size().
  virtual std::vector<Slot> make_slots() const = 0;
  // Throws TopologyError when the topology cannot be built for this world size.
  virtual void check_world_size() const {}

 private:
  void materialise() const;
  void check_slots(const std::vector<Slot>& slots) const;

  std::string name_;
  int world_size_;
  int local_world_size_;
  mutable std::once_flag once_;
  mutable std::vector<Slot> slots_;
  // slot_group_[s * n + r] = index of rank r's group in slot s.
  mutable std::vector<int> slot_group_;
};

// A topology whose slots come from a function (for user registration).
using SlotsFn = std::function<std::vector<Slot>(int world_size, int local_world_size)>;

class FunctionTopology : public Topology {
 public:
  FunctionTopology(std::string name, int world_size, int local_world_size, SlotsFn fn);

 protected:
  std::vector<Slot> make_slots() const override;

 private:
  SlotsFn fn_;
};

// ---- built-ins (spec §5). With world_size 1 each degenerates to one slot {[0]}. ----

class CompleteTopology : public Topology {
 public:
  CompleteTopology(int world_size, int local_world_size);

 protected:
  std::vector<Slot> make_slots() const override;
};

class RingTopology : public Topology {
 public:
  RingTopology(int world_size, int local_world_size);

 protected:
  void check_world_size() const override;
  std::vector<Slot> make_slots() const override;
};

class OnePeerExpTopology : public Topology {
 public:
  OnePeerExpTopology(int world_size, int local_world_size);

 protected:
  void check_world_size() const override;
  std::vector<Slot> make_slots() const override;
};

class AlternatingExpRingTopology : public Topology {
 public:
  AlternatingExpRingTopology(int world_size, int local_world_size);

 protected:
  void check_world_size() const override;
  std::vector<Slot> make_slots() const override;
};

// Every slot a seeded random partition of the ranks into floor(n / k) groups, as even as
// possible (so each has between k and 2k - 1 members), each mixing uniformly; the
// `period` slots then repeat. The same on every rank: it depends on the seed, not the rank.
// Groups larger than pairs are what robust aggregation needs (a trimmed mean dropping b
// values at each end needs more than 2b members). With n < 2k: one group of all ranks.
// make_topology() builds it for the names "random-<k>" and "random-<k>:<seed>" (seed 0 by
// default), e.g. "random-5" or "random-5:7".
class RandomGroupsTopology : public Topology {
 public:
  static constexpr int kDefaultPeriod = 16;
  RandomGroupsTopology(int world_size, int local_world_size, int group_size, uint64_t seed = 0,
                       int period = kDefaultPeriod);
  int group_size() const { return group_size_; }
  uint64_t seed() const { return seed_; }

 protected:
  std::vector<Slot> make_slots() const override;

 private:
  int group_size_;
  uint64_t seed_;
  int period_;
};

// ---- registry ----

using TopologyFactory =
    std::function<std::unique_ptr<Topology>(int world_size, int local_world_size)>;

// Registers (or replaces) a topology under `name`. Names are case-sensitive.
void register_topology(const std::string& name, TopologyFactory factory);
// Registers a topology whose slots come from `fn`.
void register_topology(const std::string& name, SlotsFn fn);
// Registers `alias` as another name for the already registered `target`.
void register_alias(const std::string& alias, const std::string& target);
// True when `name` (or an alias) is registered.
bool is_registered(const std::string& name);
// Canonical names of every registered topology, sorted.
std::vector<std::string> registered_topologies();
// Builds and validates a topology; throws InvalidArgument for an unknown name or bad
// sizes and TopologyError when the world size violates the topology's constraint. Besides
// the registered names it takes the family "random-<k>[:<seed>]" (RandomGroupsTopology).
std::unique_ptr<Topology> make_topology(const std::string& name, int world_size,
                                        int local_world_size);

// Human-readable "[0,1] [2,3]" form of a slot.
std::string to_string(const Slot& slot);

}  // namespace topology
}  // namespace decent_dp
