#include "decent_dp/mpi_communicator.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include <unistd.h>

#include "decent_dp/detail/allgather.h"
#include "decent_dp/detail/mpi_check.h"
#include "decent_dp/detail/op_header.h"
#include "decent_dp/detail/progress_engine.h"
#include "decent_dp/detail/ring_allreduce.h"
#include "decent_dp/detail/shm.h"
#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {
namespace {

using detail::cat;

// ---- one-time MPI initialisation ----

std::mutex g_runtime_mutex;
bool g_initialised_by_us = false;
int g_live_communicators = 0;
bool g_abandoned = false;  // a communicator gave up on pending operations

void finalize_at_exit() {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || !g_initialised_by_us) {
    return;
  }
  if (g_live_communicators > 0 || g_abandoned || !detail::graveyard_empty()) {
    // Finalising with operations in flight can block forever (Note [abandoned requests]);
    // the launcher reports the missing finalize instead.
    return;
  }
  MPI_Finalize();
}

void acquire_mpi() {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  int initialised = 0;
  int finalized = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalized);
  if (finalized) {
    throw CommError("MpiCommunicator: MPI has already been finalized in this process");
  }
  int provided = MPI_THREAD_SINGLE;
  if (!initialised) {
    DECENT_DP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    g_initialised_by_us = true;
    std::atexit(finalize_at_exit);
  } else {
    DECENT_DP_MPI_CHECK(MPI_Query_thread(&provided));
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    throw CommError(cat("MpiCommunicator needs MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
                        "), the MPI library provides thread level ", provided,
                        "; initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                        "or let the communicator initialise it"));
  }
  int world_rank = 0;
  DECENT_DP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  detail::set_mpi_world_rank(world_rank);
  ++g_live_communicators;
}

void release_mpi(bool abandoned) {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  --g_live_communicators;
  g_abandoned = g_abandoned || abandoned;
}

// ---- tensors ----

std::string dtype_name(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type()));
}

void check_reduce_dtype(const at::Tensor& t, const char* op_name) {
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
      return;
    default:
      throw InvalidArgument(cat(op_name,
                                ": the MPI backend reduces tensors of dtype float32, "
                                "float64, bfloat16, float16, int32 or int64; got ",
                                dtype_name(t)));
  }
}

void check_cpu_tensor(const at::Tensor& t, const char* op_name, const char* arg) {
  DECENT_DP_CHECK_ARG(t.defined(), op_name, ": ", arg, " must be a defined tensor");
  DECENT_DP_CHECK_ARG(t.device().is_cpu(), op_name, ": the MPI backend takes CPU tensors; ", arg,
                      " is on ", t.device().str(), " (CUDA tensors go through the NCCL backend)");
  DECENT_DP_CHECK_ARG(t.layout() == at::kStrided, op_name, ": ", arg,
                      " must be a dense (strided) tensor");
  DECENT_DP_CHECK_ARG(t.is_contiguous(), op_name, ": ", arg, " must be contiguous; got sizes ",
                      t.sizes(), " strides ", t.strides(),
                      " (call .contiguous() on it, or use a contiguous buffer)");
}

constexpr int64_t kMaxChunk = INT_MAX;

}  // namespace

// ---------------------------------------------------------------------------------------

class MpiWork final : public Work {
 public:
  MpiWork(std::string description, std::vector<at::Tensor> tensors,
          std::chrono::milliseconds timeout, std::shared_ptr<detail::ProgressEngine> engine)
      : Work(std::move(description), std::move(tensors), timeout), engine_(std::move(engine)) {}

  // The operation's number on its group (assigned when it starts; -1 before).
  void set_sequence(int64_t s) { sequence_.store(s); }
  int64_t sequence() const { return sequence_.load(); }
  // Called from every blocked wait: checks the peers' departure notices (Note [departure
  // notices]) and throws when a member will never take part.
  std::function<void()> check_peers;

 protected:
  // Note [MPI progress engine]: a waiting caller advances the operations itself.
  bool drive_progress() override {
    if (check_peers) {
      check_peers();
    }
    switch (engine_->try_progress()) {
      case detail::ProgressEngine::PollResult::kPolled:
        back_off();
        return true;
      case detail::ProgressEngine::PollResult::kBusy:
        std::this_thread::yield();  // the holder is polling; try again soon
        return true;
      case detail::ProgressEngine::PollResult::kStopped:
        break;
    }
    return false;
  }
  void on_wait_begin() override {
    engine_->add_driver();
    last_steps_.store(engine_->steps_completed());
    last_step_ns_.store(now_ns());
    backoff_us_.store(0);
  }
  void on_wait_end() override { engine_->remove_driver(); }

 private:
  // Note [waiting caller backoff]: a caller blocked on an operation polls it itself. While
  // polls keep completing steps, or for kSpinNs after the last one, it polls again at once
  // (small messages and the steps of a fast ring stay at polling latency); after that it
  // sleeps between polls, 20 us doubling up to the progress thread's 1 ms, until a step
  // completes. A long wait (a large exchange on a slow link) then no longer spins a core:
  // with more ranks than cores, the spinning caller took the CPU that the ranks moving the
  // data needed (on an emulated 4-node cluster at 400 Mbit/s, 8 ranks on 2 cores, about
  // 200 ms of CPU per step and rank went to waiting). The state is atomic: two threads may
  // wait on one operation.
  static constexpr int64_t kSpinNs = 200000;
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void back_off() {
    const uint64_t steps = engine_->steps_completed();
    const int64_t now = now_ns();
    if (steps != last_steps_.exchange(steps)) {
      last_step_ns_.store(now);
      backoff_us_.store(0);
      return;
    }
    if (now - last_step_ns_.load() < kSpinNs) {
      return;
    }
    const int64_t previous = backoff_us_.load();
    const int64_t next =
        previous == 0
            ? 20
            : std::min<int64_t>(previous * 2, detail::ProgressEngine::max_backoff().count());
    backoff_us_.store(next);
    std::this_thread::sleep_for(std::chrono::microseconds(next));
  }

  std::shared_ptr<detail::ProgressEngine> engine_;
  std::atomic<uint64_t> last_steps_{0};
  std::atomic<int64_t> last_step_ns_{0};
  std::atomic<int64_t> backoff_us_{0};
  std::atomic<int64_t> sequence_{-1};
};

struct MpiCommunicator::Impl {
  using Op = detail::ProgressEngine::Op;

  std::chrono::milliseconds timeout{0};
  std::chrono::microseconds interval{0};
  std::shared_ptr<detail::ProgressEngine> engine;

  // Written once by the init task, read-only afterwards.
  MPI_Comm world = MPI_COMM_NULL;
  int rank = -1;
  int size = 0;
  int local_rank = -1;
  int local_size = 0;
  std::vector<int> world_ranks;  // 0 .. size - 1: the group of options with no ranks
  std::vector<int> node_of;      // per world rank: the world rank of its node's first rank
  bool shared_memory = false;
  int64_t shared_memory_min_bytes = 0;
  int64_t node_aware_min_bytes = -1;
  int ring_lanes = 1;  // Note [ring lanes]
  int64_t ring_lane_min_bytes = 1 << 20;
  int ranks_per_node = 0;
  detail::PeerSegmentCache peers;  // engine token holder only
  std::atomic<bool> warned_allocation{false};
  std::atomic<uint64_t> ring_allreduces{0};
  std::atomic<uint64_t> shared_allreduces{0};
  std::atomic<uint64_t> node_aware_allreduces{0};
  std::atomic<uint64_t> allreduce_lanes{0};
  std::atomic<uint64_t> allreduce_bytes_sent{0};
  std::atomic<uint64_t> allreduce_bytes_received{0};
  std::atomic<uint64_t> p2p_allgathers{0};
  std::atomic<uint64_t> shared_allgathers{0};
  std::atomic<uint64_t> allgather_bytes_sent{0};
  std::atomic<uint64_t> allgather_bytes_received{0};

  // True when every rank of `ranks` is on this rank's node.
  bool same_node(const std::vector<int>& ranks) const {
    for (int r : ranks) {
      if (node_of[r] != node_of[rank]) {
        return false;
      }
    }
    return true;
  }

  // A communicator of one group. `sequence` numbers the ring all-reduces started on it
  // (by the engine's token holder only) and gives each its own message tag.
  struct GroupComm {
    MPI_Comm comm = MPI_COMM_NULL;
    int index = 0;  // this rank's position in the group
    int size = 0;
    uint32_t sequence = 0;
    std::vector<int> ranks;  // the members, ascending
  };
  // Sub-communicators by member list, written under groups_mutex by make_groups. Entries
  // are never erased while the communicator lives, so pointers to them stay valid.
  mutable std::mutex groups_mutex;
  std::map<std::vector<int>, GroupComm> groups;
  GroupComm world_group;

  std::shared_ptr<Work> submit(std::shared_ptr<Work> work,
                               std::function<std::vector<MPI_Request>()> next,
                               std::function<void()> complete = nullptr) {
    return submit_lanes(
        std::move(work), [next = std::move(next)](int) { return next(); }, nullptr,
        std::move(complete));
  }

  // An operation of several lanes (Note [lanes] in detail/progress_engine.h).
  std::shared_ptr<Work> submit_lanes(std::shared_ptr<Work> work,
                                     std::function<std::vector<MPI_Request>(int)> next,
                                     std::function<int()> lanes,
                                     std::function<void()> complete = nullptr) {
    auto op = std::make_unique<Op>();
    op->work = work;
    op->next = std::move(next);
    op->lanes = std::move(lanes);
    op->complete = std::move(complete);
    engine->enqueue(std::move(op));
    return work;
  }

  // Submits an operation whose MPI calls are all issued at once by `start`.
  std::shared_ptr<Work> submit_once(std::shared_ptr<Work> work,
                                    std::function<std::vector<MPI_Request>()> start,
                                    std::function<void()> complete = nullptr) {
    return submit(
        std::move(work),
        [start = std::move(start), started = false]() mutable {
          if (started) {
            return std::vector<MPI_Request>{};
          }
          started = true;
          return start();
        },
        std::move(complete));
  }

  std::shared_ptr<MpiWork> make_work(std::string description, std::vector<at::Tensor> tensors,
                                     std::chrono::milliseconds op_timeout = {}) {
    return std::make_shared<MpiWork>(std::move(description), std::move(tensors),
                                     op_timeout.count() > 0 ? op_timeout : timeout, engine);
  }
  // Its waits fail as soon as a member of `group` has left for good (Note [departure
  // notices]).
  void watch(MpiWork& work, const GroupComm* group) {
    MpiWork* w = &work;
    work.check_peers = [this, group, w] { check_departed(group, *w); };
  }

  // Checks that `ranks` is a group this rank can use in `op_name`: distinct ascending ranks
  // containing this rank, created by make_groups unless it is the world or this rank alone.
  // Returns its communicator (null for this rank alone).
  GroupComm* checked_group(const std::vector<int>& ranks, const char* op_name) {
    bool ranks_ok = !ranks.empty() && ranks.front() >= 0 && ranks.back() < size;
    for (size_t i = 1; i < ranks.size() && ranks_ok; ++i) {
      ranks_ok = ranks[i] > ranks[i - 1];
    }
    DECENT_DP_CHECK_ARG(ranks_ok && std::binary_search(ranks.begin(), ranks.end(), rank), op_name,
                        ": ranks ", ranks_to_string(ranks), " must be distinct ranks in [0, ",
                        size - 1, "] in ascending order that contain this rank (", rank, ")");
    if (ranks.size() == 1) {
      return nullptr;
    }
    GroupComm* group = group_for(ranks);
    DECENT_DP_CHECK_ARG(group != nullptr, op_name, ": no communicator for group ",
                        ranks_to_string(ranks), " on rank ", rank,
                        "; create it first with make_groups() on every rank");
    return group;
  }

  // Runs a blocking task in the engine, after every operation submitted before it started.
  void run_blocking(const std::string& description, std::function<void()> task) {
    auto work = make_work(description, {});
    submit(work, [task = std::move(task)] {
      task();
      return std::vector<MPI_Request>{};
    });
    work->wait();
  }

  // The communicator of group `ranks` (ascending, containing this rank), or null.
  GroupComm* group_for(const std::vector<int>& ranks) {
    if (static_cast<int>(ranks.size()) == size) {
      return &world_group;
    }
    std::lock_guard<std::mutex> lock(groups_mutex);
    auto it = groups.find(ranks);
    return it == groups.end() ? nullptr : &it->second;
  }

  // Note [departure notices]
  // A rank whose communicator shuts down (the process finishes, or leaves the training loop
  // and exits) sends every other rank one small message on a communicator of their own:
  // for each of its groups, how many operations it has started there. A peer blocked on
  // an operation of such a group that the departed rank never started (its number on the
  // group is at least that count) fails at once, naming the rank, the group and what it
  // waited for, instead of waiting out the timeout. Operations it did start complete as
  // usual. Waiting threads look for notices (at most every 10 ms) while they wait.
  // A communicator freed with notices still unreceived may hand its context to the next one
  // made, so each notice carries the identity all ranks agreed on at construction and a
  // notice of another communicator is dropped.
  static constexpr int kNoticeTag = 7;
  MPI_Comm notices = MPI_COMM_NULL;
  int64_t identity = 0;
  std::mutex notices_mutex;  // one prober at a time
  std::chrono::steady_clock::time_point next_probe{};
  std::mutex departed_mutex;
  std::map<int, std::map<std::vector<int>, uint32_t>> departed;  // rank -> group -> started
  std::atomic<bool> any_departed{false};

  void poll_notices() {
    std::unique_lock<std::mutex> lock(notices_mutex, std::try_to_lock);
    if (!lock.owns_lock() || notices == MPI_COMM_NULL) {
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now < next_probe) {
      return;
    }
    next_probe = now + std::chrono::milliseconds(10);
    for (;;) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, notices, &flag, &status) != MPI_SUCCESS ||
          flag == 0) {
        return;
      }
      int count = 0;
      MPI_Get_count(&status, MPI_INT64_T, &count);
      std::vector<int64_t> msg(static_cast<size_t>(std::max(count, 0)));
      if (MPI_Recv(msg.data(), count, MPI_INT64_T, status.MPI_SOURCE, kNoticeTag, notices,
                   MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        return;
      }
      if (msg.size() < 2 || msg[0] != identity) {
        continue;  // a notice of an earlier communicator (see above)
      }
      std::map<std::vector<int>, uint32_t> started;
      size_t i = 2;
      for (int64_t g = 0; g < msg[1] && i < msg.size(); ++g) {
        const auto k = static_cast<size_t>(msg[i++]);
        if (i + k + 1 > msg.size()) {
          break;
        }
        std::vector<int> members(msg.begin() + static_cast<int64_t>(i),
                                 msg.begin() + static_cast<int64_t>(i + k));
        i += k;
        started[members] = static_cast<uint32_t>(msg[i++]);
      }
      {
        std::lock_guard<std::mutex> guard(departed_mutex);
        departed[status.MPI_SOURCE] = std::move(started);
      }
      any_departed.store(true);
      DECENT_DP_LOG_DEBUG(cat("rank ", status.MPI_SOURCE, " has left"));
    }
  }

  void check_departed(const GroupComm* group, const MpiWork& work) {
    poll_notices();
    if (!any_departed.load() || group == nullptr) {
      return;
    }
    const int64_t seq = work.sequence();
    if (seq < 0) {
      return;  // not started yet: checked once it is
    }
    std::lock_guard<std::mutex> guard(departed_mutex);
    for (int m : group->ranks) {
      const auto it = departed.find(m);
      if (it == departed.end()) {
        continue;
      }
      const auto g = it->second.find(group->ranks);
      const uint32_t started = g == it->second.end() ? 0 : g->second;
      if (static_cast<uint32_t>(seq) >= started) {
        throw CommError(
            cat("rank ", m,
                " has left: its communicator shut down (the process finished, or left "
                "the training loop and exited) after starting ",
                started, " operation(s) on group ", ranks_to_string(group->ranks),
                ", and this rank waits for ", work.description(), ", operation ", seq,
                " there, which rank ", m,
                " will never start. Every rank must run the same number of steps (stop all ranks "
                "at the smallest number of batches, or pad the data)"));
      }
    }
  }

  // At shutdown, with the engine stopped: this rank's notice to every other rank.
  void announce_departure() {
    if (notices == MPI_COMM_NULL || size <= 1) {
      return;
    }
    std::vector<int64_t> msg = {identity, 0};
    auto add = [&msg](const GroupComm& g) {
      ++msg[1];
      msg.push_back(static_cast<int64_t>(g.ranks.size()));
      msg.insert(msg.end(), g.ranks.begin(), g.ranks.end());
      msg.push_back(static_cast<int64_t>(g.sequence));
    };
    add(world_group);
    {
      std::lock_guard<std::mutex> lock(groups_mutex);
      for (const auto& kv : groups) {
        add(kv.second);
      }
    }
    std::vector<MPI_Request> requests;
    for (int r = 0; r < size; ++r) {
      MPI_Request req = MPI_REQUEST_NULL;
      if (r != rank && MPI_Isend(msg.data(), static_cast<int>(msg.size()), MPI_INT64_T, r,
                                 kNoticeTag, notices, &req) == MPI_SUCCESS) {
        requests.push_back(req);
      }
    }
    // Small messages leave at once; a peer that is gone must not hold this exit up.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (!requests.empty() &&
           MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                       MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
           done == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (MPI_Request& req : requests) {
      if (req != MPI_REQUEST_NULL) {
        MPI_Request_free(&req);
      }
    }
    next_probe = {};
    poll_notices();  // take the notices that arrived (every rank leaves at the end of a run)
  }

  // The notices communicator is never freed: peers that leave later still send to it, and a
  // message arriving for a freed communicator can meet the next communicator that reuses
  // its context (Open MPI then crashes creating that one). It lives until MPI_Finalize.
  void free_communicators() {
    std::lock_guard<std::mutex> lock(groups_mutex);
    for (auto& kv : groups) {
      MPI_Comm_free(&kv.second.comm);
    }
    groups.clear();
    if (world != MPI_COMM_NULL) {
      MPI_Comm_free(&world);
    }
  }
};

MpiCommunicator::MpiCommunicator(MpiOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.timeout =
      options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(env::timeout_ms());
  d.interval = options.progress_interval.count() >= 0
                   ? options.progress_interval
                   : std::chrono::microseconds(env::progress_interval_us());
  d.shared_memory = options.shared_memory < 0 ? env::shared_memory() : options.shared_memory != 0;
  d.shared_memory_min_bytes = std::max<int64_t>(0, options.shared_memory_min_bytes);
  const bool node_aware = options.node_aware < 0 ? env::node_aware() : options.node_aware != 0;
  DECENT_DP_CHECK_ARG(options.node_aware_min_bytes >= 0,
                      "MpiCommunicator: MpiOptions::node_aware_min_bytes must be >= 0 (node_aware "
                      "= 0 turns the path off), got ",
                      options.node_aware_min_bytes);
  d.node_aware_min_bytes = node_aware ? options.node_aware_min_bytes : -1;
  d.ring_lanes = options.ring_lanes < 0 ? env::ring_lanes() : options.ring_lanes;
  DECENT_DP_CHECK_ARG(d.ring_lanes >= 1 && d.ring_lanes <= detail::kMaxLanes,
                      "MpiCommunicator: MpiOptions::ring_lanes must be in [1, ", detail::kMaxLanes,
                      "] (or -1: DECENT_DP_RING_LANES), got ", options.ring_lanes);
  DECENT_DP_CHECK_ARG(options.ring_lane_min_bytes >= 1,
                      "MpiCommunicator: MpiOptions::ring_lane_min_bytes must be >= 1, got ",
                      options.ring_lane_min_bytes);
  d.ring_lane_min_bytes = options.ring_lane_min_bytes;
  DECENT_DP_CHECK_ARG(options.ranks_per_node >= 0,
                      "MpiCommunicator: MpiOptions::ranks_per_node must be >= 0 (0: nodes as MPI "
                      "finds them), got ",
                      options.ranks_per_node);
  d.ranks_per_node = options.ranks_per_node;
  acquire_mpi();
  d.engine = std::make_shared<detail::ProgressEngine>(
      d.interval, std::chrono::milliseconds(env::shutdown_timeout_ms()), detail::mpi_world_rank());
  d.engine->start_thread();
  try {
    d.run_blocking("MpiCommunicator initialisation", [&d] {
      DECENT_DP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &d.world));
      DECENT_DP_MPI_CHECK(MPI_Comm_set_errhandler(d.world, MPI_ERRORS_RETURN));
      DECENT_DP_MPI_CHECK(MPI_Comm_rank(d.world, &d.rank));
      DECENT_DP_MPI_CHECK(MPI_Comm_size(d.world, &d.size));
      d.world_group.comm = d.world;
      d.world_group.index = d.rank;
      d.world_group.size = d.size;
      for (int r = 0; r < d.size; ++r) {
        d.world_ranks.push_back(r);
      }
      d.world_group.ranks = d.world_ranks;
      DECENT_DP_MPI_CHECK(MPI_Comm_dup(d.world, &d.notices));
      DECENT_DP_MPI_CHECK(MPI_Comm_set_errhandler(d.notices, MPI_ERRORS_RETURN));
      if (d.rank == 0) {
        std::random_device entropy;
        d.identity = static_cast<int64_t>((static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^
                                          static_cast<uint64_t>(getpid()));
      }
      DECENT_DP_MPI_CHECK(MPI_Bcast(&d.identity, 1, MPI_INT64_T, 0, d.world));
      MPI_Comm local = MPI_COMM_NULL;
      DECENT_DP_MPI_CHECK(
          MPI_Comm_split_type(d.world, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &local));
      DECENT_DP_MPI_CHECK(MPI_Comm_rank(local, &d.local_rank));
      DECENT_DP_MPI_CHECK(MPI_Comm_size(local, &d.local_size));
      int leader = d.rank;
      DECENT_DP_MPI_CHECK(MPI_Bcast(&leader, 1, MPI_INT, 0, local));
      DECENT_DP_MPI_CHECK(MPI_Comm_free(&local));
      d.node_of.assign(d.size, -1);
      DECENT_DP_MPI_CHECK(
          MPI_Allgather(&leader, 1, MPI_INT, d.node_of.data(), 1, MPI_INT, d.world));
      // The transport choices must agree (Note [shared-memory transport], Note [node-aware
      // all-reduce]): every rank sees the same table and fails the same way.
      constexpr int kSettings = 6;
      const int64_t mine[kSettings] = {d.shared_memory ? 1 : 0,
                                       d.shared_memory_min_bytes,
                                       d.node_aware_min_bytes,
                                       d.ranks_per_node,
                                       d.ring_lanes,
                                       d.ring_lane_min_bytes};
      std::vector<int64_t> all(kSettings * static_cast<size_t>(d.size));
      DECENT_DP_MPI_CHECK(
          MPI_Allgather(mine, kSettings, MPI_INT64_T, all.data(), kSettings, MPI_INT64_T, d.world));
      for (int r = 1; r < d.size; ++r) {
        const int64_t* theirs = &all[kSettings * static_cast<size_t>(r)];
        if (theirs[0] != all[0] || theirs[1] != all[1]) {
          throw InvalidArgument(cat(
              "MpiCommunicator: shared-memory settings must be the same on every rank (MpiOptions::"
              "shared_memory / DECENT_DP_SHM and shared_memory_min_bytes): rank 0 has ",
              all[0], " / ", all[1], ", rank ", r, " has ", theirs[0], " / ", theirs[1]));
        }
        if (theirs[2] != all[2] || theirs[3] != all[3]) {
          throw InvalidArgument(
              cat("MpiCommunicator: the node-aware all-reduce's settings (MpiOptions::node_aware / "
                  "DECENT_DP_NODE_AWARE and node_aware_min_bytes; -1: off) and ranks_per_node must "
                  "be the same on every rank: rank 0 has ",
                  all[2], " and ", all[3], ", rank ", r, " has ", theirs[2], " and ", theirs[3]));
        }
        if (theirs[4] != all[4] || theirs[5] != all[5]) {
          throw InvalidArgument(
              cat("MpiCommunicator: MpiOptions::ring_lanes (DECENT_DP_RING_LANES) and "
                  "ring_lane_min_bytes must be the same on every rank: rank 0 has ",
                  all[4], " and ", all[5], ", rank ", r, " has ", theirs[4], " and ", theirs[5]));
        }
      }
      if (d.ranks_per_node > 0) {
        const int per = d.ranks_per_node;
        if (d.size % per != 0) {
          throw InvalidArgument(
              cat("MpiCommunicator: MpiOptions::ranks_per_node must divide the "
                  "world size ",
                  d.size, ", got ", per));
        }
        for (int r = 0; r < d.size; ++r) {
          if (d.node_of[r] != d.node_of[r - r % per]) {
            throw InvalidArgument(cat("MpiCommunicator: MpiOptions::ranks_per_node = ", per,
                                      " puts ranks ", r - r % per, " and ", r,
                                      " on one node, but they run on different machines"));
          }
        }
        for (int r = 0; r < d.size; ++r) {
          d.node_of[r] = r - r % per;
        }
        d.local_rank = d.rank % per;
        d.local_size = per;
      }
    });
  } catch (...) {
    const bool clean = d.engine->stop();
    if (clean && d.world != MPI_COMM_NULL) {
      MPI_Comm_free(&d.world);
    }
    release_mpi(!clean);
    throw;
  }
  set_log_rank(d.rank, d.size);
  DECENT_DP_LOG_DEBUG(cat("MPI communicator ready: rank ", d.rank, "/", d.size, ", local rank ",
                          d.local_rank, "/", d.local_size, ", timeout ", d.timeout.count(),
                          " ms, progress interval ", d.interval.count(), " us"));
}

MpiCommunicator::~MpiCommunicator() {
  Impl& d = *impl_;
  // Once a peer has left, operations it never started will not finish: do not wait the
  // whole shutdown timeout for them.
  const bool clean =
      d.any_departed.load() ? d.engine->stop(std::chrono::milliseconds(2000)) : d.engine->stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    // The program finalized MPI itself before this communicator went away: no MPI call is
    // allowed any more, and nothing is left to free.
    release_mpi(false);
    return;
  }
  d.announce_departure();
  if (clean) {
    d.free_communicators();
  }
  release_mpi(!clean);
}

int MpiCommunicator::rank() const {
  return impl_->rank;
}
int MpiCommunicator::size() const {
  return impl_->size;
}
int MpiCommunicator::local_rank() const {
  return impl_->local_rank;
}
int MpiCommunicator::local_size() const {
  return impl_->local_size;
}
std::chrono::milliseconds MpiCommunicator::timeout() const {
  return impl_->timeout;
}

bool MpiCommunicator::has_group(const std::vector<int>& ranks) const {
  Impl& d = *impl_;
  if (ranks.size() == 1 && ranks[0] == d.rank) {
    return true;
  }
  return d.group_for(ranks) != nullptr;
}

void MpiCommunicator::make_groups(const std::vector<std::vector<int>>& groups) {
  Impl& d = *impl_;
  // Local validation first, so malformed input fails on every rank the same way.
  const uint64_t hash = detail::check_groups(groups, d.size);

  // First every rank's hash, without blocking (a rank that never arrives, for example
  // because its constructor threw first, then costs the timeout instead of a hang); once all
  // agree, the members of each group create its communicator together.
  struct State {
    int64_t mine = 0;
    std::vector<int64_t> all;
    int stage = 0;
  };
  auto st = std::make_shared<State>();
  st->mine = static_cast<int64_t>(hash);
  st->all.assign(d.size, 0);
  Impl* impl = &d;
  auto work = d.make_work(cat("make_groups(", groups.size(), " groups) over all ", d.size,
                              " ranks (rank ", d.rank, ")"),
                          {});
  d.submit(work, [st, impl, groups] {
    Impl& d = *impl;
    std::vector<MPI_Request> requests;
    if (st->stage++ == 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      DECENT_DP_MPI_CHECK(
          MPI_Iallgather(&st->mine, 1, MPI_INT64_T, st->all.data(), 1, MPI_INT64_T, d.world, &r));
      requests.push_back(r);
      return requests;
    }
    if (st->stage > 2) {
      return requests;
    }
    for (int r = 0; r < d.size; ++r) {
      if (st->all[r] != st->all[0]) {
        throw InvalidArgument(cat("make_groups: rank ", r,
                                  " passed a different list of groups than rank 0; every rank "
                                  "must pass the same lists in the same order"));
      }
    }
    MPI_Group world_group = MPI_GROUP_NULL;
    DECENT_DP_MPI_CHECK(MPI_Comm_group(d.world, &world_group));
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto& g = groups[i];
      if (static_cast<int>(g.size()) == d.size || g.size() == 1 ||
          !std::binary_search(g.begin(), g.end(), d.rank)) {
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(d.groups_mutex);
        if (d.groups.count(g) != 0) {
          continue;
        }
      }
      MPI_Group sub = MPI_GROUP_NULL;
      DECENT_DP_MPI_CHECK(MPI_Group_incl(world_group, static_cast<int>(g.size()), g.data(), &sub));
      MPI_Comm comm = MPI_COMM_NULL;
      const int tag = static_cast<int>(i % 32000);
      DECENT_DP_MPI_CHECK(MPI_Comm_create_group(d.world, sub, tag, &comm));
      MPI_Group_free(&sub);
      DECENT_DP_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
      Impl::GroupComm entry;
      entry.comm = comm;
      entry.size = static_cast<int>(g.size());
      entry.index = static_cast<int>(std::lower_bound(g.begin(), g.end(), d.rank) - g.begin());
      entry.ranks = g;
      std::lock_guard<std::mutex> lock(d.groups_mutex);
      d.groups[g] = entry;
    }
    MPI_Group_free(&world_group);
    return requests;
  });
  work->wait();
}

std::shared_ptr<Work> MpiCommunicator::allreduce(const at::Tensor& tensor, const at::Tensor& output,
                                                 const AllreduceOptions& options) {
  Impl& d = *impl_;
  const ReduceOp op = options.op;
  const std::vector<int>& ranks = options.ranks.empty() ? d.world_ranks : options.ranks;
  check_cpu_tensor(tensor, "allreduce", "tensor");
  const bool in_place = output.defined() && output.is_same(tensor);
  if (!in_place) {
    check_cpu_tensor(output, "allreduce", "output");
    DECENT_DP_CHECK_ARG(
        output.scalar_type() == tensor.scalar_type() && output.numel() == tensor.numel(),
        "allreduce: output must have the input's dtype and size (", dtype_name(tensor), ", ",
        tensor.numel(), " elements), got ", dtype_name(output), ", ", output.numel(), " elements");
  }
  check_reduce_dtype(tensor, "allreduce");
  DECENT_DP_CHECK_ARG(!(op == ReduceOp::kAvg && !tensor.is_floating_point()),
                      "allreduce: ReduceOp::kAvg needs a floating-point tensor, got ",
                      dtype_name(tensor), " (use kSum for integers)");
  Impl::GroupComm* group = d.checked_group(ranks, "allreduce");
  const int64_t k = static_cast<int64_t>(ranks.size());
  auto work = d.make_work(
      cat("allreduce(", to_string(op), ", ", tensor.numel(), " x ", dtype_name(tensor),
          ") on group ", ranks_to_string(ranks), " (rank ", d.rank,
          options.label.empty() ? "" : ", ", options.label, ")"),
      in_place ? std::vector<at::Tensor>{tensor} : std::vector<at::Tensor>{tensor, output},
      options.timeout);
  if (k == 1) {
    if (!in_place && tensor.nbytes() > 0) {  // an empty tensor may have no data at all
      std::memcpy(output.data_ptr(), tensor.data_ptr(), tensor.nbytes());
    }
    work->finish();  // the mean of one value is the value itself
    return work;
  }
  const int64_t numel = tensor.numel();
  const at::ScalarType dtype = tensor.scalar_type();
  const char* input = static_cast<const char*>(tensor.data_ptr());
  char* data = static_cast<char*>(output.data_ptr());
  const bool average = op == ReduceOp::kAvg;
  // Note [shared-memory transport]: groups inside this node take it when buffers are large
  // enough; the operation itself falls back to the ring unless every member's buffers are
  // shared. The decision here depends only on the group and the size, the same on every
  // member.
  const bool try_shared =
      d.shared_memory && d.same_node(ranks) &&
      numel * static_cast<int64_t>(tensor.element_size()) >= d.shared_memory_min_bytes;
  // Note [node-aware all-reduce]: the node of each member when the group qualifies.
  std::vector<int> nodes;
  if (d.node_aware_min_bytes >= 0 &&
      numel * static_cast<int64_t>(tensor.element_size()) >= d.node_aware_min_bytes) {
    for (int r : ranks) {
      nodes.push_back(d.node_of[static_cast<size_t>(r)]);
    }
    if (!detail::NodeAwareAllreduce::applies(nodes)) {
      nodes.clear();
    }
  }
  // Note [operation header]: what every member compares before any payload moves.
  const detail::OpHeader header = detail::make_op_header(
      detail::OpKind::kAllreduce, static_cast<int32_t>(op), numel, dtype, -1, options.label,
      cat("allreduce(", to_string(op), ", ", numel, " x ", dtype_name(tensor),
          options.label.empty() ? "" : ", ", options.label, ")"));
  // Note [ring all-reduce over point-to-point]: the operation is created when it starts, by
  // the engine's token holder, which also assigns its tag in submission order.
  // Lanes (Note [ring lanes]) advance independently; the operation's accounting runs once
  // all of them are done.
  auto state = std::make_shared<std::unique_ptr<detail::ShmAllreduce>>();
  detail::ProgressEngine* engine = d.engine.get();
  detail::PeerSegmentCache* peers = &d.peers;
  std::atomic<uint64_t>* counter_ring = &d.ring_allreduces;
  std::atomic<uint64_t>* counter_shared = &d.shared_allreduces;
  std::atomic<uint64_t>* counter_node_aware = &d.node_aware_allreduces;
  std::atomic<uint64_t>* counter_sent = &d.allreduce_bytes_sent;
  std::atomic<uint64_t>* counter_received = &d.allreduce_bytes_received;
  MpiWork* started = work.get();
  d.watch(*work, group);
  // Lanes fill network links; inside a node the copies are bound by the cores and lanes
  // measured mixed (Note [ring lanes]). The same choice on every member: the group and where
  // its ranks run.
  const int max_lanes = d.same_node(ranks) ? 1 : d.ring_lanes;
  std::atomic<uint64_t>* counter_lanes = &d.allreduce_lanes;
  const int64_t lane_min_bytes = d.ring_lane_min_bytes;
  auto next = [state, engine, peers, group, input, data, numel, dtype, average, try_shared, started,
               header, nodes = std::move(nodes), max_lanes,
               lane_min_bytes](int lane) -> std::vector<MPI_Request> {
    auto& reduce = *state;
    if (!reduce) {
      const int64_t sequence = group->sequence;
      started->set_sequence(sequence);
      // Lane j's messages carry tag + j (Note [ring lanes]).
      const int tag = detail::operation_tag(group->sequence++, 0);
      reduce = std::make_unique<detail::ShmAllreduce>(
          input, data, numel, dtype, average, group->comm, group->index, group->size, tag,
          engine->scratch(), *peers, header, try_shared, group->ranks, sequence, nodes, max_lanes,
          lane_min_bytes);
    }
    return reduce->next(lane);
  };
  auto lanes = [state] { return *state ? (*state)->lanes() : 1; };
  auto complete = [state, counter_ring, counter_shared, counter_node_aware, counter_sent,
                   counter_received, counter_lanes] {
    auto& reduce = *state;
    if (reduce->fell_back()) {
      counter_lanes->fetch_add(static_cast<uint64_t>(reduce->lanes()));
    }
    (reduce->node_aware()  ? counter_node_aware
     : reduce->fell_back() ? counter_ring
                           : counter_shared)
        ->fetch_add(1);
    counter_sent->fetch_add(static_cast<uint64_t>(reduce->bytes_sent()));
    counter_received->fetch_add(static_cast<uint64_t>(reduce->bytes_received()));
    reduce.reset();  // returns the scratch buffers to the pool
  };
  return d.submit_lanes(work, std::move(next), std::move(lanes), std::move(complete));
}

std::shared_ptr<Work> MpiCommunicator::broadcast(const at::Tensor& tensor, int root) {
  Impl& d = *impl_;
  check_cpu_tensor(tensor, "broadcast", "tensor");
  DECENT_DP_CHECK_ARG(root >= 0 && root < d.size, "broadcast: root must be in [0, ", d.size - 1,
                      "], got ", root);
  auto work = d.make_work(cat("broadcast(", tensor.numel(), " x ", dtype_name(tensor), ", root ",
                              root, ") over all ", d.size, " ranks (rank ", d.rank, ")"),
                          {tensor});
  char* data = static_cast<char*>(tensor.data_ptr());
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  // Note [checked broadcast]: point-to-point messages on the world group under one tag,
  // assigned when the operation starts (in submission order, as for the all-reduce), so
  // concurrent broadcasts never cross. Stage 0 is the header stage of every collective (Note
  // [operation header]): each rank learns every rank's (elements, dtype, root), so a tensor
  // that differs from another rank's is the same error on every rank instead of a silent
  // partial copy on some. Stage 1: the root sends the payload to each rank (a broadcast is a
  // setup operation: n - 1 copies from the root are fine).
  struct State {
    std::vector<detail::OpHeader> headers;
    int tag = 0;
    int64_t sequence = 0;
    int stage = 0;
  };
  auto st = std::make_shared<State>();
  Impl::GroupComm* group = &d.world_group;
  const detail::OpHeader header = detail::make_op_header(
      detail::OpKind::kBroadcast, -1, tensor.numel(), tensor.scalar_type(), root, "",
      cat("broadcast(", tensor.numel(), " x ", dtype_name(tensor), ", root ", root, ")"));
  MpiWork* started = work.get();
  d.watch(*work, group);
  return d.submit(work, [st, group, data, bytes, root, header, started] {
    std::vector<MPI_Request> requests;
    const int me = group->index;
    const int n = group->size;
    MPI_Comm comm = group->comm;
    switch (st->stage++) {
      case 0:
        st->sequence = group->sequence;
        started->set_sequence(st->sequence);
        st->tag = detail::operation_tag(group->sequence++, 0);
        return detail::post_op_headers(header, st->headers, comm, me, n, st->tag);
      case 1:
        detail::check_op_headers(st->headers, me, group->ranks, st->sequence);
        for (int m = 0; m < n; ++m) {
          if (m == me || (me != root && m != root)) {
            continue;
          }
          int64_t offset = 0;
          do {
            const int64_t count = std::min(kMaxChunk, bytes - offset);
            MPI_Request r = MPI_REQUEST_NULL;
            if (me == root) {
              DECENT_DP_MPI_CHECK(MPI_Isend(data + offset, static_cast<int>(count), MPI_BYTE, m,
                                            st->tag, comm, &r));
            } else {
              DECENT_DP_MPI_CHECK(MPI_Irecv(data + offset, static_cast<int>(count), MPI_BYTE, root,
                                            st->tag, comm, &r));
            }
            requests.push_back(r);
            detail::track_posted(r);  // Note [abandoned requests]
            offset += count;
          } while (offset < bytes);
        }
        return requests;
      default:
        return requests;
    }
  });
}

std::shared_ptr<Work> MpiCommunicator::allgather(const at::Tensor& output, const at::Tensor& input,
                                                 const AllgatherOptions& options) {
  return gather(output, input, at::Tensor(), options);
}

std::shared_ptr<Work> MpiCommunicator::allgather_varying(const at::Tensor& output,
                                                         const at::Tensor& input,
                                                         const at::Tensor& lengths,
                                                         const AllgatherOptions& options) {
  DECENT_DP_CHECK_ARG(lengths.defined(), "allgather_varying: lengths must be a tensor");
  return gather(output, input, lengths, options);
}

std::shared_ptr<Work> MpiCommunicator::gather(const at::Tensor& output, const at::Tensor& input,
                                              const at::Tensor& lengths,
                                              const AllgatherOptions& options) {
  Impl& d = *impl_;
  const bool varying = lengths.defined();
  const char* who = varying ? "allgather_varying" : "allgather";
  const std::vector<int>& ranks = options.ranks.empty() ? d.world_ranks : options.ranks;
  check_cpu_tensor(input, who, "input");
  check_cpu_tensor(output, who, "output");
  DECENT_DP_CHECK_ARG(output.scalar_type() == input.scalar_type(), who,
                      ": output dtype must equal input dtype ", dtype_name(input), ", got ",
                      dtype_name(output));
  Impl::GroupComm* group = d.checked_group(ranks, who);
  const int64_t k = static_cast<int64_t>(ranks.size());
  int64_t capacity = input.numel();
  if (varying) {
    check_cpu_tensor(lengths, who, "lengths");
    DECENT_DP_CHECK_ARG(lengths.scalar_type() == at::kLong && lengths.numel() == k, who,
                        ": lengths must be an int64 tensor of ", k, " elements (the group), got ",
                        lengths.numel(), " x ", dtype_name(lengths));
    DECENT_DP_CHECK_ARG(output.numel() % k == 0, who, ": output must hold ", k,
                        " blocks of equal capacity, got ", output.numel(), " elements");
    capacity = output.numel() / k;
    DECENT_DP_CHECK_ARG(input.numel() <= capacity, who, ": input has ", input.numel(),
                        " elements, more than the capacity of ", capacity, " per member");
  } else {
    DECENT_DP_CHECK_ARG(output.numel() == input.numel() * k, "allgather: output must hold ",
                        options.ranks.empty() ? "world size" : "group size",
                        " * input.numel() = ", k, " * ", input.numel(), " = ", input.numel() * k,
                        " elements, got ", output.numel());
  }
  const std::string what =
      cat(who, "(", varying ? "capacity " : "", capacity, " x ", dtype_name(input),
          options.label.empty() ? "" : ", ", options.label, ")");
  auto work = d.make_work(cat(what, " on group ", ranks_to_string(ranks), " (rank ", d.rank, ")"),
                          {output, input, lengths.defined() ? lengths : input}, options.timeout);
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  const size_t elem = static_cast<size_t>(input.element_size());
  const auto bytes = static_cast<size_t>(capacity) * elem;
  const auto input_bytes = static_cast<size_t>(input.nbytes());
  int64_t* lens = varying ? lengths.data_ptr<int64_t>() : nullptr;
  if (k == 1) {
    if (out != in && input_bytes > 0) {
      std::memmove(out, in, input_bytes);
    }
    if (lens != nullptr) {
      lens[0] = input.numel();
    }
    work->finish();
    return work;
  }
  const bool try_shared = d.shared_memory && d.same_node(ranks) &&
                          static_cast<int64_t>(bytes) >= d.shared_memory_min_bytes;
  const detail::OpHeader header =
      detail::make_op_header(detail::OpKind::kAllgather, varying ? 1 : -1, capacity,
                             input.scalar_type(), -1, options.label, what);
  auto op = std::make_shared<std::unique_ptr<detail::GroupAllgather>>();
  detail::PeerSegmentCache* peers = &d.peers;
  Impl* impl = &d;
  MpiWork* started = work.get();
  d.watch(*work, group);
  return d.submit(work, [op, impl, peers, group, in, out, bytes, input_bytes, elem, lens,
                         try_shared, started, header] {
    auto& gather = *op;
    if (!gather) {
      const int64_t sequence = group->sequence;
      started->set_sequence(sequence);
      const int tag = detail::operation_tag(group->sequence++, 0);
      gather = std::make_unique<detail::GroupAllgather>(
          in, out, bytes, group->comm, group->index, group->size, tag, try_shared, *peers, header,
          group->ranks, sequence, lens, input_bytes);
    }
    std::vector<MPI_Request> requests = gather->next();
    if (requests.empty()) {
      (gather->used_shared_memory() ? impl->shared_allgathers : impl->p2p_allgathers).fetch_add(1);
      impl->allgather_bytes_sent.fetch_add(static_cast<uint64_t>(gather->bytes_sent()));
      impl->allgather_bytes_received.fetch_add(static_cast<uint64_t>(gather->bytes_received()));
      if (lens != nullptr) {
        for (int m = 0; m < group->size; ++m) {
          lens[m] /= static_cast<int64_t>(elem);  // bytes -> elements
        }
      }
      gather.reset();
    }
    return requests;
  });
}

void MpiCommunicator::barrier() {
  Impl& d = *impl_;
  auto work = d.make_work(cat("barrier over all ", d.size, " ranks (rank ", d.rank, ")"), {});
  MPI_Comm comm = d.world;
  d.submit_once(work, [comm] {
    MPI_Request request = MPI_REQUEST_NULL;
    DECENT_DP_MPI_CHECK(MPI_Ibarrier(comm, &request));
    return std::vector<MPI_Request>{request};
  });
  work->wait();
}

at::Tensor MpiCommunicator::allocate(int64_t numel, const at::TensorOptions& options) {
  Impl& d = *impl_;
  DECENT_DP_CHECK_ARG(numel >= 0, "allocate: numel must be >= 0, got ", numel);
  if (d.shared_memory && d.local_size > 1 && options.device().is_cpu() &&
      options.layout() == at::kStrided) {
    std::string why;
    at::Tensor t = detail::allocate_shared(numel, options.dtype().toScalarType(), why);
    if (t.defined()) {
      return t;
    }
    if (!d.warned_allocation.exchange(true)) {
      DECENT_DP_LOG_WARN(cat("could not allocate a shared-memory buffer (", why,
                             "); exchanges of private buffers take MPI messages"));
    }
  }
  return Communicator::allocate(numel, options);
}

MpiStats MpiCommunicator::stats() const {
  MpiStats out;
  out.ring_allreduces = impl_->ring_allreduces.load();
  out.shared_memory_allreduces = impl_->shared_allreduces.load();
  out.node_aware_allreduces = impl_->node_aware_allreduces.load();
  out.allreduce_lanes = impl_->allreduce_lanes.load();
  out.allreduce_bytes_sent = impl_->allreduce_bytes_sent.load();
  out.allreduce_bytes_received = impl_->allreduce_bytes_received.load();
  out.p2p_allgathers = impl_->p2p_allgathers.load();
  out.shared_memory_allgathers = impl_->shared_allgathers.load();
  out.allgather_bytes_sent = impl_->allgather_bytes_sent.load();
  out.allgather_bytes_received = impl_->allgather_bytes_received.load();
  return out;
}

}  // namespace decent_dp
