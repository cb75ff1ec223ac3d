#include "decent_dp/detail/shm.h"

#include <ATen/ops/from_blob.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "decent_dp/detail/allgather.h"
#include "decent_dp/errors.h"

extern char** environ;  // for posix_spawn

namespace decent_dp {
namespace detail {
namespace {

struct Segment {
  size_t bytes;
  std::string name;
};

// This process's segments by base address.
std::mutex g_segments_mutex;
std::map<uintptr_t, Segment>& segments() {
  static auto* map = new std::map<uintptr_t, Segment>();  // outlives static tensors
  return *map;
}

std::string errno_text(int code) {
  return std::string(std::strerror(code));
}

size_t page_round(size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

// Note [shared-memory janitor]
// A segment is unlinked when its tensor is freed, but a process that dies by a signal
// (SIGKILL, or SIGTERM from mpirun stopping a failed job) frees nothing. So with its first
// segment a process starts a janitor: `/bin/sh -c 'cat >/dev/null; rm -f
// /dev/shm/decent_dp.<pid>.*'` reading a pipe whose only write end this process holds
// (close-on-exec). However the process ends, the kernel closes that end, cat sees end of
// file and the janitor removes whatever the process left. It runs in a session of its own,
// so signals sent to the job's process groups do not stop it first, and with every other
// descriptor closed, so it holds none of the process's sockets open.
void start_janitor() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return;  // best effort: segments are still unlinked when freed
  }
  const std::string script = cat("cat >/dev/null; rm -f /dev/shm/decent_dp.", getpid(), ".*");
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[0], 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  const char* argv[] = {"sh", "-c", script.c_str(), nullptr};
  pid_t pid = 0;
  posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char**>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[0]);
  // fds[1] stays open (close-on-exec) for the life of the process: its end is the signal.
}

}  // namespace

at::Tensor allocate_shared(int64_t numel, c10::ScalarType dtype, std::string& why) {
  static std::atomic<uint64_t> counter{0};
  static std::once_flag janitor;
  std::call_once(janitor, start_janitor);
  const size_t bytes = page_round(static_cast<size_t>(numel) * c10::elementSize(dtype));
  const std::string name = cat("/decent_dp.", getpid(), ".", counter.fetch_add(1));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    why = cat("shm_open(", name, "): ", errno_text(errno));
    return {};
  }
  // Reserve the pages now: a full /dev/shm then fails here instead of faulting later.
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    close(fd);
    shm_unlink(name.c_str());
    why = cat("reserving ", bytes, " bytes in ", name, ": ", errno_text(rc));
    return {};
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    why = cat("mmap of ", name, ": ", errno_text(map_errno));
    return {};
  }
  {
    std::lock_guard<std::mutex> lock(g_segments_mutex);
    segments()[reinterpret_cast<uintptr_t>(base)] = Segment{bytes, name};
  }
  auto release = [bytes, name](void* p) {
    {
      std::lock_guard<std::mutex> lock(g_segments_mutex);
      segments().erase(reinterpret_cast<uintptr_t>(p));
    }
    munmap(p, bytes);
    shm_unlink(name.c_str());
  };
  return at::from_blob(base, {numel}, release, at::TensorOptions().dtype(dtype));
}

bool find_shared(const void* ptr, size_t bytes, std::string& name, uint64_t& offset) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_segments_mutex);
  auto& map = segments();
  auto it = map.upper_bound(p);
  if (it == map.begin()) {
    return false;
  }
  --it;
  if (p + bytes > it->first + it->second.bytes) {
    return false;
  }
  name = it->second.name;
  offset = p - it->first;
  return true;
}

PeerSegment::PeerSegment(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) {
    throw CommError(cat("cannot open the shared-memory segment ", name,
                        " of a group member: ", errno_text(errno),
                        " (set DECENT_DP_SHM=0 on every rank to use MPI messages only)"));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    throw CommError(cat("fstat of shared-memory segment ", name, ": ", errno_text(e)));
  }
  size_ = static_cast<size_t>(st.st_size);
  base_ = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    throw CommError(cat("mmap of shared-memory segment ", name, ": ", errno_text(e)));
  }
}

PeerSegment::~PeerSegment() {
  if (base_ != nullptr) {
    munmap(base_, size_);
  }
}

std::shared_ptr<PeerSegment> PeerSegmentCache::get(const std::string& name) {
  ++clock_;
  auto it = mapped_.find(name);
  if (it != mapped_.end()) {
    it->second.first = clock_;
    return it->second.second;
  }
  // A miss means a new segment: drop mappings of segments their owners have freed since
  // (the name is gone), so freed memory is not kept alive here.
  for (auto stale = mapped_.begin(); stale != mapped_.end();) {
    if (stale->second.second.use_count() == 1) {
      const int fd = shm_open(stale->first.c_str(), O_RDONLY, 0);
      if (fd < 0 && errno == ENOENT) {
        stale = mapped_.erase(stale);
        continue;
      }
      if (fd >= 0) {
        close(fd);
      }
    }
    ++stale;
  }
  if (mapped_.size() >= kMaxMapped) {
    auto oldest = std::min_element(
        mapped_.begin(), mapped_.end(),
        [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
    mapped_.erase(oldest);
  }
  auto segment = std::make_shared<PeerSegment>(name);
  mapped_[name] = {clock_, segment};
  return segment;
}

ShmAllreduce::ShmAllreduce(const char* input, char* output, int64_t numel, c10::ScalarType dtype,
                           bool average, MPI_Comm comm, int index, int size, int tag,
                           ScratchPool& pool, PeerSegmentCache& peers, const OpHeader& header,
                           bool try_shared, const std::vector<int>& ranks, int64_t sequence,
                           std::vector<int> nodes, int max_lanes, int64_t lane_min_bytes)
    : input_(input),
      output_(output),
      numel_(numel),
      dtype_(dtype),
      average_(average),
      comm_(comm),
      index_(index),
      size_(size),
      tag_(tag),
      pool_(pool),
      peers_(peers),
      element_size_(static_cast<int64_t>(c10::elementSize(dtype))),
      mine_(header),
      ranks_(ranks),
      sequence_(sequence),
      nodes_(std::move(nodes)),
      max_lanes_(max_lanes),
      lane_min_bytes_(lane_min_bytes) {
  offsets_.resize(size_ + 1);
  const int64_t base = numel / size_;
  const int64_t extra = numel % size_;
  for (int c = 0; c < size_; ++c) {
    offsets_[c + 1] = offsets_[c] + base + (c < extra ? 1 : 0);
  }
  const auto bytes = static_cast<size_t>(numel * element_size_);
  std::string in_name, out_name;
  uint64_t in_offset = 0, out_offset = 0;
  const bool shared = try_shared && find_shared(input, bytes, in_name, in_offset) &&
                      find_shared(output, bytes, out_name, out_offset);
  const std::string names = shared ? in_name + "|" + out_name : std::string();
  mine_.shared = shared && names.size() < sizeof(mine_.segment) ? 1 : 0;
  if (mine_.shared) {
    std::memcpy(mine_.segment, names.c_str(), names.size() + 1);
  }
  mine_.input_offset = in_offset;
  mine_.output_offset = out_offset;
  signal_in_.resize(size_);
}

std::vector<MPI_Request> ShmAllreduce::post_all(int stage) {
  if (stage == 0) {
    return post_op_headers(mine_, theirs_, comm_, index_, size_, tag_);
  }
  return post_member_exchange(&signal_out_, signal_in_.data(), sizeof(int32_t), sizeof(int32_t),
                              comm_, index_, size_, tag_);
}

const char* ShmAllreduce::peer_input(int m) const {
  return m == index_ ? input_ : segments_[2 * m]->data() + theirs_[m].input_offset;
}

const char* ShmAllreduce::peer_output(int m) const {
  return m == index_ ? output_ : segments_[2 * m + 1]->data() + theirs_[m].output_offset;
}

// Each peer reads this member's input for the chunk it owns and copies this member's reduced
// chunk; this member does the same with every peer: both directions move
// (n - own chunk) + (k - 1) * own chunk elements.
int64_t ShmAllreduce::bytes_sent() const {
  if (!lanes_.empty()) {
    int64_t sum = 0;
    for (const Lane& lane : lanes_) {
      sum += lane.bytes_sent();
    }
    return sum;
  }
  return (numel_ - chunk_size(index_) + (size_ - 1) * chunk_size(index_)) * element_size_;
}

int64_t ShmAllreduce::bytes_received() const {
  if (!lanes_.empty()) {
    int64_t sum = 0;
    for (const Lane& lane : lanes_) {
      sum += lane.bytes_received();
    }
    return sum;
  }
  return bytes_sent();
}

std::vector<MPI_Request> ShmAllreduce::next(int lane) {
  if (!lanes_.empty()) {
    return lanes_.at(static_cast<size_t>(lane)).next();
  }
  if (lane != 0) {
    throw CommError(cat("all-reduce: lane ", lane, " advanced before the lanes were opened"));
  }
  switch (stage_++) {
    case 0:
      return post_all(0);  // headers, with the segment descriptors
    case 1: {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      check_op_headers(theirs_, index_, ranks_, sequence_);
      bool shared = true;
      for (int m = 0; m < size_; ++m) {
        shared = shared && theirs_[m].shared == 1;
      }
      if (!shared) {
        // Some member's buffers are private: every member sees the same descriptors and
        // takes the ring, or the node-aware path where the caller found one.
        // Note [ring lanes]: contiguous segments, one ring each; the engine opens lanes 1
        // and up once this step returns.
        const int count =
            ring_lane_count(numel_ * element_size_, numel_, size_, max_lanes_, lane_min_bytes_);
        lanes_.resize(static_cast<size_t>(count));
        for (int j = 0; j < count; ++j) {
          const int64_t begin = numel_ * j / count;
          const int64_t n = numel_ * (j + 1) / count - begin;
          const char* in = input_ + begin * element_size_;
          char* out = output_ + begin * element_size_;
          if (!nodes_.empty()) {
            lanes_[j].node_aware = std::make_unique<NodeAwareAllreduce>(
                in, out, n, dtype_, average_, comm_, index_, nodes_, tag_ + j, pool_);
          } else {
            lanes_[j].ring = std::make_unique<RingAllreduce>(in, out, n, dtype_, average_, comm_,
                                                             index_, size_, tag_ + j, pool_);
          }
        }
        return next(0);
      }
      segments_.resize(2 * size_);
      const auto bytes = static_cast<uint64_t>(numel_ * element_size_);
      for (int m = 0; m < size_; ++m) {
        if (m == index_) {
          continue;
        }
        const std::string names(theirs_[m].segment,
                                strnlen(theirs_[m].segment, sizeof(theirs_[m].segment)));
        const size_t bar = names.find('|');
        segments_[2 * m] = peers_.get(names.substr(0, bar));
        segments_[2 * m + 1] = peers_.get(names.substr(bar + 1));
        if (theirs_[m].input_offset + bytes > segments_[2 * m]->size() ||
            theirs_[m].output_offset + bytes > segments_[2 * m + 1]->size()) {
          throw CommError(cat("all-reduce: member ", m, "'s buffer lies outside its segment"));
        }
      }
      // Reduce the chunk this member owns: its own input first (so an in-place buffer is
      // read before it is written), then the others in member order.
      const int c = index_;
      const int64_t offset = chunk_begin(c) * element_size_;
      const int64_t n = chunk_size(c);
      char* out = output_ + offset;
      int added = 0;
      for (int m = 0; m < size_; ++m) {
        if (m == index_) {
          continue;
        }
        ++added;
        add_out(out, added == 1 ? input_ + offset : out, peer_input(m) + offset, n, dtype_,
                added == size_ - 1 && average_ ? size_ : 1);
      }
      return post_all(1);  // "reduced"
    }
    case 2: {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      for (int m = 0; m < size_; ++m) {
        if (m == index_) {
          continue;
        }
        const int64_t offset = chunk_begin(m) * element_size_;
        std::memcpy(output_ + offset, peer_output(m) + offset,
                    static_cast<size_t>(chunk_size(m) * element_size_));
      }
      return post_all(2);  // "copied"
    }
    default:
      segments_.clear();
      return {};
  }
}

}  // namespace detail
}  // namespace decent_dp
