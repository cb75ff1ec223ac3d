#include "decent_dp/mpi_communicator.h"

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <thread>

#include "decent_dp/env.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {
namespace {

using detail::cat;

std::atomic<int> g_world_rank{-1};

std::string mpi_error_string(int code) {
  char buffer[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS) {
    return cat("MPI error code ", code);
  }
  return std::string(buffer, static_cast<size_t>(length));
}

[[noreturn]] void throw_mpi_error(const char* call, int code, const char* file, int line) {
  throw CommError(cat(call, " failed on rank ", g_world_rank.load(), " at ", file, ":", line,
                      ": ", mpi_error_string(code)));
}

#define DECENT_DP_MPI_CHECK(call)                            \
  do {                                                       \
    const int decent_dp_rc_ = (call);                        \
    if (decent_dp_rc_ != MPI_SUCCESS) {                      \
      throw_mpi_error(#call, decent_dp_rc_, __FILE__, __LINE__); \
    }                                                        \
  } while (0)

// ---- MPI datatypes and sum operations for 16-bit floats (MPI has none) ----

template <typename T>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    // Each partial sum is rounded to T: the reduction happens in the tensor's own dtype.
    b[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
}

struct Mpi16BitTypes {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op f16_sum = MPI_OP_NULL;
};
Mpi16BitTypes g_types;

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
  if (g_live_communicators > 0 || g_abandoned) {
    // Finalising with operations in flight can block forever; the launcher reports the
    // missing finalize instead.
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
  if (g_types.bf16 == MPI_DATATYPE_NULL) {
    DECENT_DP_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_types.bf16));
    DECENT_DP_MPI_CHECK(MPI_Type_commit(&g_types.bf16));
    DECENT_DP_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_types.f16));
    DECENT_DP_MPI_CHECK(MPI_Type_commit(&g_types.f16));
    DECENT_DP_MPI_CHECK(MPI_Op_create(&sum_16bit<c10::BFloat16>, 1, &g_types.bf16_sum));
    DECENT_DP_MPI_CHECK(MPI_Op_create(&sum_16bit<c10::Half>, 1, &g_types.f16_sum));
  }
  int world_rank = 0;
  DECENT_DP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  g_world_rank.store(world_rank);
  ++g_live_communicators;
}

void release_mpi(bool abandoned) {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  --g_live_communicators;
  g_abandoned = g_abandoned || abandoned;
}

// ---- tensors ----

struct ReduceType {
  MPI_Datatype type;
  MPI_Op sum;
};

std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

ReduceType reduce_type(const at::Tensor& t, const char* op_name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return {MPI_FLOAT, MPI_SUM};
    case at::kDouble:
      return {MPI_DOUBLE, MPI_SUM};
    case at::kBFloat16:
      return {g_types.bf16, g_types.bf16_sum};
    case at::kHalf:
      return {g_types.f16, g_types.f16_sum};
    case at::kInt:
      return {MPI_INT32_T, MPI_SUM};
    case at::kLong:
      return {MPI_INT64_T, MPI_SUM};
    default:
      throw InvalidArgument(cat(op_name, ": the MPI backend reduces tensors of dtype float32, "
                                         "float64, bfloat16, float16, int32 or int64; got ",
                                dtype_name(t)));
  }
}

void check_cpu_tensor(const at::Tensor& t, const char* op_name, const char* arg) {
  DECENT_DP_CHECK_ARG(t.defined(), op_name, ": ", arg, " must be a defined tensor");
  DECENT_DP_CHECK_ARG(t.device().is_cpu(), op_name, ": the MPI backend takes CPU tensors; ", arg,
                      " is on ", t.device().str(),
                      " (CUDA tensors go through the NCCL backend)");
  DECENT_DP_CHECK_ARG(t.layout() == at::kStrided, op_name, ": ", arg,
                      " must be a dense (strided) tensor");
  DECENT_DP_CHECK_ARG(t.is_contiguous(), op_name, ": ", arg,
                      " must be contiguous; got sizes ", t.sizes(), " strides ", t.strides(),
                      " (call .contiguous() on it, or use a contiguous buffer)");
}

template <typename T>
void divide(void* data, int64_t n, int64_t k) {
  T* p = static_cast<T*>(data);
  const float divisor = static_cast<float>(k);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<T>(static_cast<float>(p[i]) / divisor);
  }
}

template <>
void divide<double>(void* data, int64_t n, int64_t k) {
  double* p = static_cast<double*>(data);
  const double divisor = static_cast<double>(k);
  for (int64_t i = 0; i < n; ++i) {
    p[i] /= divisor;
  }
}

constexpr int64_t kMaxChunk = INT_MAX;

}  // namespace

// ---------------------------------------------------------------------------------------

// Shared between the communicator, its progress thread and the Work handles (which may
// outlive the communicator).
struct ProgressState {
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<int> waiters{0};
};

class MpiWork final : public Work {
 public:
  MpiWork(std::string description, std::vector<at::Tensor> tensors,
          std::chrono::milliseconds timeout, std::shared_ptr<ProgressState> state)
      : Work(std::move(description), std::move(tensors), timeout), state_(std::move(state)) {}

 protected:
  void on_wait_begin() override {
    state_->waiters.fetch_add(1);
    state_->cv.notify_all();
  }
  void on_wait_end() override { state_->waiters.fetch_sub(1); }

 private:
  std::shared_ptr<ProgressState> state_;
};

struct MpiCommunicator::Impl {
  // One queued or running operation.
  struct Op {
    std::shared_ptr<Work> work;
    // Issues the MPI calls (on the progress thread) and returns the requests to poll;
    // blocking operations return none.
    std::function<std::vector<MPI_Request>()> start;
    // Runs on the progress thread once every request completed (e.g. the division of kAvg).
    std::function<void()> complete;
    size_t remaining = 0;
  };

  MpiOptions options;
  std::chrono::milliseconds timeout{0};
  std::chrono::microseconds interval{0};
  std::shared_ptr<ProgressState> state = std::make_shared<ProgressState>();

  // Written once by the init task, read-only afterwards.
  MPI_Comm world = MPI_COMM_NULL;
  int rank = -1;
  int size = 0;
  int local_rank = -1;
  int local_size = 0;

  // Sub-communicators by member list; written by the progress thread under groups_mutex.
  mutable std::mutex groups_mutex;
  std::map<std::vector<int>, MPI_Comm> groups;

  // Guarded by state->mutex.
  std::deque<std::unique_ptr<Op>> queue;
  bool stop = false;
  bool abandoned = false;

  std::thread thread;

  std::shared_ptr<Work> submit(std::shared_ptr<Work> work,
                               std::function<std::vector<MPI_Request>()> start,
                               std::function<void()> complete = nullptr) {
    auto op = std::make_unique<Op>();
    op->work = work;
    op->start = std::move(start);
    op->complete = std::move(complete);
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (stop) {
        throw CommError("MpiCommunicator: operation submitted while the communicator is "
                        "being destroyed");
      }
      queue.push_back(std::move(op));
    }
    state->cv.notify_all();
    return work;
  }

  std::shared_ptr<Work> make_work(std::string description, std::vector<at::Tensor> tensors) {
    return std::make_shared<MpiWork>(std::move(description), std::move(tensors), timeout, state);
  }

  // Runs a blocking task on the progress thread and waits for it.
  void run_blocking(const std::string& description, std::function<void()> task) {
    auto work = make_work(description, {});
    submit(work, [task = std::move(task)] {
      task();
      return std::vector<MPI_Request>{};
    });
    work->wait();
  }

  void progress_loop() {
    std::vector<std::unique_ptr<Op>> active;
    std::vector<MPI_Request> requests;
    std::vector<Op*> owner;
    std::vector<int> indices;
    const auto finish_op = [](Op& op, std::exception_ptr error) {
      if (!error && op.complete) {
        try {
          op.complete();
        } catch (...) {
          error = std::current_exception();
        }
      }
      op.work->finish(error);
    };
    std::chrono::steady_clock::time_point stop_deadline{};
    bool stopping = false;
    while (true) {
      std::deque<std::unique_ptr<Op>> incoming;
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        if (active.empty() && queue.empty() && !stop) {
          state->cv.wait(lock, [this] { return stop || !queue.empty(); });
        }
        if (stop && !stopping) {
          stopping = true;
          stop_deadline = std::chrono::steady_clock::now() + timeout;
        }
        incoming.swap(queue);
        if (stopping && incoming.empty() && active.empty()) {
          break;
        }
      }
      for (auto& op : incoming) {
        std::vector<MPI_Request> started;
        try {
          started = op->start();
        } catch (...) {
          finish_op(*op, std::current_exception());
          continue;
        }
        if (started.empty()) {
          finish_op(*op, nullptr);
          continue;
        }
        op->remaining = started.size();
        for (MPI_Request r : started) {
          requests.push_back(r);
          owner.push_back(op.get());
        }
        active.push_back(std::move(op));
      }
      if (requests.empty()) {
        continue;
      }
      indices.resize(requests.size());
      int count = 0;
      const int rc = MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &count,
                                  indices.data(), MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        auto error = std::make_exception_ptr(
            CommError(cat("MPI_Testsome failed on rank ", rank, ": ", mpi_error_string(rc))));
        for (auto& op : active) {
          finish_op(*op, error);
        }
        active.clear();
        requests.clear();
        owner.clear();
        continue;
      }
      if (count > 0 && count != MPI_UNDEFINED) {
        for (int i = 0; i < count; ++i) {
          Op* op = owner[indices[i]];
          owner[indices[i]] = nullptr;
          if (--op->remaining == 0) {
            finish_op(*op, nullptr);
          }
        }
        size_t kept = 0;
        for (size_t i = 0; i < requests.size(); ++i) {
          if (owner[i] != nullptr) {
            requests[kept] = requests[i];
            owner[kept] = owner[i];
            ++kept;
          }
        }
        requests.resize(kept);
        owner.resize(kept);
        active.erase(std::remove_if(active.begin(), active.end(),
                                    [](const std::unique_ptr<Op>& op) { return op->remaining == 0; }),
                     active.end());
        continue;
      }
      if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
        auto error = std::make_exception_ptr(CommError(
            cat("MpiCommunicator on rank ", rank, " was destroyed with ", active.size(),
                " operation(s) still in flight after waiting ", timeout.count(), " ms")));
        DECENT_DP_LOG_ERROR(cat("destroying the communicator with ", active.size(),
                                " operation(s) in flight; MPI will not be finalized"));
        for (auto& op : active) {
          finish_op(*op, error);
        }
        std::lock_guard<std::mutex> lock(state->mutex);
        abandoned = true;
        break;
      }
      if (state->waiters.load() > 0 || interval.count() == 0) {
        std::this_thread::yield();
      } else {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->cv.wait_for(lock, interval,
                           [this] { return stop || !queue.empty() || state->waiters.load() > 0; });
      }
    }
    if (!abandoned) {
      std::lock_guard<std::mutex> lock(groups_mutex);
      for (auto& kv : groups) {
        MPI_Comm_free(&kv.second);
      }
      groups.clear();
      if (world != MPI_COMM_NULL) {
        MPI_Comm_free(&world);
      }
    }
  }

  MPI_Comm comm_for(const std::vector<int>& ranks) const {
    if (static_cast<int>(ranks.size()) == size) {
      return world;
    }
    std::lock_guard<std::mutex> lock(groups_mutex);
    auto it = groups.find(ranks);
    return it == groups.end() ? MPI_COMM_NULL : it->second;
  }
};

MpiCommunicator::MpiCommunicator(MpiOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.options = options;
  d.timeout = options.timeout.count() > 0 ? options.timeout
                                           : std::chrono::milliseconds(env::timeout_ms());
  d.interval = options.progress_interval.count() >= 0
                   ? options.progress_interval
                   : std::chrono::microseconds(env::progress_interval_us());
  acquire_mpi();
  d.thread = std::thread([&d] { d.progress_loop(); });
  try {
    d.run_blocking("MpiCommunicator initialisation", [&d] {
      DECENT_DP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &d.world));
      DECENT_DP_MPI_CHECK(MPI_Comm_set_errhandler(d.world, MPI_ERRORS_RETURN));
      DECENT_DP_MPI_CHECK(MPI_Comm_rank(d.world, &d.rank));
      DECENT_DP_MPI_CHECK(MPI_Comm_size(d.world, &d.size));
      MPI_Comm local = MPI_COMM_NULL;
      DECENT_DP_MPI_CHECK(
          MPI_Comm_split_type(d.world, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &local));
      DECENT_DP_MPI_CHECK(MPI_Comm_rank(local, &d.local_rank));
      DECENT_DP_MPI_CHECK(MPI_Comm_size(local, &d.local_size));
      DECENT_DP_MPI_CHECK(MPI_Comm_free(&local));
    });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(d.state->mutex);
      d.stop = true;
    }
    d.state->cv.notify_all();
    d.thread.join();
    release_mpi(false);
    throw;
  }
  set_log_rank(d.rank, d.size);
  DECENT_DP_LOG_DEBUG(cat("MPI communicator ready: rank ", d.rank, "/", d.size, ", local rank ",
                          d.local_rank, "/", d.local_size, ", timeout ", d.timeout.count(),
                          " ms, progress interval ", d.interval.count(), " us"));
}

MpiCommunicator::~MpiCommunicator() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.state->mutex);
    d.stop = true;
  }
  d.state->cv.notify_all();
  if (d.thread.joinable()) {
    d.thread.join();
  }
  release_mpi(d.abandoned);
}

int MpiCommunicator::rank() const { return impl_->rank; }
int MpiCommunicator::size() const { return impl_->size; }
int MpiCommunicator::local_rank() const { return impl_->local_rank; }
int MpiCommunicator::local_size() const { return impl_->local_size; }
std::chrono::milliseconds MpiCommunicator::timeout() const { return impl_->timeout; }

bool MpiCommunicator::has_group(const std::vector<int>& ranks) const {
  const Impl& d = *impl_;
  if (ranks.size() == 1 && ranks[0] == d.rank) {
    return true;
  }
  return d.comm_for(ranks) != MPI_COMM_NULL;
}

void MpiCommunicator::make_groups(const std::vector<std::vector<int>>& groups) {
  Impl& d = *impl_;
  // Local validation first, so malformed input fails on every rank the same way.
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the lists
  auto mix = [&hash](uint64_t v) {
    hash ^= v;
    hash *= 1099511628211ULL;
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& g = groups[i];
    DECENT_DP_CHECK_ARG(!g.empty(), "make_groups: group ", i, " is empty");
    for (size_t j = 0; j < g.size(); ++j) {
      DECENT_DP_CHECK_ARG(g[j] >= 0 && g[j] < d.size, "make_groups: group ", i, " ",
                          ranks_to_string(g), " names rank ", g[j], ", expected ranks in [0, ",
                          d.size - 1, "]");
      DECENT_DP_CHECK_ARG(j == 0 || g[j] > g[j - 1], "make_groups: group ", i, " ",
                          ranks_to_string(g),
                          " must list distinct ranks in ascending order");
      mix(static_cast<uint64_t>(g[j]));
    }
    mix(0xFFFFFFFFULL);
  }
  mix(groups.size());

  std::vector<int64_t> all_hashes(d.size, 0);
  const int64_t my_hash = static_cast<int64_t>(hash);
  d.run_blocking("make_groups", [&] {
    DECENT_DP_MPI_CHECK(
        MPI_Allgather(&my_hash, 1, MPI_INT64_T, all_hashes.data(), 1, MPI_INT64_T, d.world));
    for (int r = 0; r < d.size; ++r) {
      if (all_hashes[r] != all_hashes[0]) {
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
      std::lock_guard<std::mutex> lock(d.groups_mutex);
      d.groups[g] = comm;
    }
    MPI_Group_free(&world_group);
  });
}

std::shared_ptr<Work> MpiCommunicator::allreduce(const at::Tensor& tensor,
                                                 const std::vector<int>& ranks, ReduceOp op) {
  Impl& d = *impl_;
  check_cpu_tensor(tensor, "allreduce", "tensor");
  const ReduceType rt = reduce_type(tensor, "allreduce");
  DECENT_DP_CHECK_ARG(!(op == ReduceOp::kAvg && !tensor.is_floating_point()),
                      "allreduce: ReduceOp::kAvg needs a floating-point tensor, got ",
                      dtype_name(tensor), " (use kSum for integers)");
  bool ranks_ok = !ranks.empty() && ranks.front() >= 0 && ranks.back() < d.size;
  for (size_t i = 1; i < ranks.size() && ranks_ok; ++i) {
    ranks_ok = ranks[i] > ranks[i - 1];
  }
  DECENT_DP_CHECK_ARG(ranks_ok && std::binary_search(ranks.begin(), ranks.end(), d.rank),
                      "allreduce: ranks ", ranks_to_string(ranks),
                      " must be distinct ranks in [0, ", d.size - 1,
                      "] in ascending order that contain this rank (", d.rank, ")");
  const int64_t k = static_cast<int64_t>(ranks.size());
  const MPI_Comm comm = k == 1 ? MPI_COMM_NULL : d.comm_for(ranks);
  DECENT_DP_CHECK_ARG(k == 1 || comm != MPI_COMM_NULL, "allreduce: no communicator for group ",
                      ranks_to_string(ranks), " on rank ", d.rank,
                      "; create it first with make_groups() on every rank");
  auto work = d.make_work(cat("allreduce(", to_string(op), ", ", tensor.numel(), " x ",
                              dtype_name(tensor), ") on group ", ranks_to_string(ranks),
                              " (rank ", d.rank, ")"),
                          {tensor});
  if (k == 1) {
    work->finish();  // the mean of one value is the value itself
    return work;
  }
  const int64_t numel = tensor.numel();
  const int64_t element_size = static_cast<int64_t>(tensor.element_size());
  char* data = static_cast<char*>(tensor.data_ptr());
  std::function<void()> complete;
  if (op == ReduceOp::kAvg) {
    const at::ScalarType dtype = tensor.scalar_type();
    complete = [data, numel, k, dtype] {
      switch (dtype) {
        case at::kFloat:
          divide<float>(data, numel, k);
          break;
        case at::kDouble:
          divide<double>(data, numel, k);
          break;
        case at::kBFloat16:
          divide<c10::BFloat16>(data, numel, k);
          break;
        case at::kHalf:
          divide<c10::Half>(data, numel, k);
          break;
        default:
          break;
      }
    };
  }
  return d.submit(
      work,
      [data, numel, element_size, rt, comm] {
        std::vector<MPI_Request> requests;
        int64_t offset = 0;
        do {
          const int64_t count = std::min(kMaxChunk, numel - offset);
          MPI_Request request = MPI_REQUEST_NULL;
          DECENT_DP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + offset * element_size,
                                             static_cast<int>(count), rt.type, rt.sum, comm,
                                             &request));
          requests.push_back(request);
          offset += count;
        } while (offset < numel);
        return requests;
      },
      std::move(complete));
}

std::shared_ptr<Work> MpiCommunicator::broadcast(const at::Tensor& tensor, int root) {
  Impl& d = *impl_;
  check_cpu_tensor(tensor, "broadcast", "tensor");
  DECENT_DP_CHECK_ARG(root >= 0 && root < d.size, "broadcast: root must be in [0, ", d.size - 1,
                      "], got ", root);
  auto work = d.make_work(cat("broadcast(", tensor.numel(), " x ", dtype_name(tensor),
                              ", root ", root, ") over all ", d.size, " ranks (rank ", d.rank, ")"),
                          {tensor});
  char* data = static_cast<char*>(tensor.data_ptr());
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  MPI_Comm comm = d.world;
  return d.submit(work, [data, bytes, root, comm] {
    std::vector<MPI_Request> requests;
    int64_t offset = 0;
    do {
      const int64_t count = std::min(kMaxChunk, bytes - offset);
      MPI_Request request = MPI_REQUEST_NULL;
      DECENT_DP_MPI_CHECK(
          MPI_Ibcast(data + offset, static_cast<int>(count), MPI_BYTE, root, comm, &request));
      requests.push_back(request);
      offset += count;
    } while (offset < bytes);
    return requests;
  });
}

std::shared_ptr<Work> MpiCommunicator::allgather(const at::Tensor& output, const at::Tensor& input) {
  Impl& d = *impl_;
  check_cpu_tensor(input, "allgather", "input");
  check_cpu_tensor(output, "allgather", "output");
  DECENT_DP_CHECK_ARG(output.scalar_type() == input.scalar_type(),
                      "allgather: output dtype must equal input dtype ", dtype_name(input),
                      ", got ", dtype_name(output));
  DECENT_DP_CHECK_ARG(output.numel() == input.numel() * d.size,
                      "allgather: output must hold world size * input.numel() = ", d.size, " * ",
                      input.numel(), " = ", input.numel() * d.size, " elements, got ",
                      output.numel());
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  DECENT_DP_CHECK_ARG(bytes <= kMaxChunk, "allgather: input must be at most ", kMaxChunk,
                      " bytes, got ", bytes);
  auto work = d.make_work(cat("allgather(", input.numel(), " x ", dtype_name(input), ") over all ",
                              d.size, " ranks (rank ", d.rank, ")"),
                          {output, input});
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  MPI_Comm comm = d.world;
  return d.submit(work, [in, out, bytes, comm] {
    MPI_Request request = MPI_REQUEST_NULL;
    DECENT_DP_MPI_CHECK(MPI_Iallgather(in, static_cast<int>(bytes), MPI_BYTE, out,
                                       static_cast<int>(bytes), MPI_BYTE, comm, &request));
    return std::vector<MPI_Request>{request};
  });
}

void MpiCommunicator::barrier() {
  Impl& d = *impl_;
  auto work = d.make_work(cat("barrier over all ", d.size, " ranks (rank ", d.rank, ")"), {});
  MPI_Comm comm = d.world;
  d.submit(work, [comm] {
    MPI_Request request = MPI_REQUEST_NULL;
    DECENT_DP_MPI_CHECK(MPI_Ibarrier(comm, &request));
    return std::vector<MPI_Request>{request};
  });
  work->wait();
}

}  // namespace decent_dp
