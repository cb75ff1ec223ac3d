// Note [NCCL backend]
// One NcclCommunicator per rank and device:
// - The world communicator: rank 0 calls ncclGetUniqueId and broadcasts the 128 bytes over
//   the control communicator (MPI); every rank then calls ncclCommInitRankConfig.
// - Groups (make_groups): ncclCommSplit from the world communicator, collective over it.
//   One split partitions the world, so the groups are dealt into rounds of disjoint groups
//   (in the order given, the same on every rank) and each round is one split: colour = the
//   index of this rank's group in the round, or NCCL_SPLIT_NOCOLOR; key = the world rank,
//   so a group communicator's ranks are the group's members in ascending order.
// - Every operation: the communication stream (one per communicator, from the pool, high
//   priority) waits for an event recorded on the caller's current stream; the NCCL call is
//   enqueued on the communication stream; the tensors are recorded on that stream with the
//   caching allocator; an end event is recorded; the Work handle's synchronize() makes the
//   caller's current stream wait on the end event, its wait() blocks the host until the
//   watchdog (Note [NCCL watchdog]) has seen the event complete.
// - Non-blocking communicators (the default): NCCL calls may return ncclInProgress; the
//   communicator is polled with ncclCommGetAsyncError until it is ready, and the watchdog
//   polls the same call for asynchronous errors and aborts every communicator
//   (ncclCommAbort) on an error or a missed deadline.
// - Every NCCL call is checked: a failure throws CommError with the call, NCCL's error
//   string, its last error message (ncclGetLastError), the rank, host, device and call site.
#include "decent_dp/nccl_communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#if __has_include(<c10/cuda/CUDAEvent.h>)
#include <c10/cuda/CUDAEvent.h>
using CudaEvent = c10::cuda::CUDAEvent;
#else
#include <ATen/cuda/CUDAEvent.h>
using CudaEvent = at::cuda::CUDAEvent;
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "decent_dp/backend.h"
#include "decent_dp/detail/watchdog.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the NCCL backend needs NCCL >= 2.18 (ncclCommSplit)"
#endif

namespace decent_dp {

namespace {

// NCCL's data type for a tensor's dtype; throws InvalidArgument for the others.
ncclDataType_t nccl_type(const at::Tensor& t, const char* who) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      throw InvalidArgument(
          detail::cat(who,
                      ": the NCCL backend takes float32, float64, float16, bfloat16, int32, int64, "
                      "uint8 and int8 tensors, got ",
                      t.scalar_type()));
  }
}

}  // namespace

struct NcclCommunicator::Impl {
  std::shared_ptr<Communicator> control;
  NcclOptions options;
  int rank = 0;
  int size = 1;
  int device = 0;
  std::string host;
  std::chrono::milliseconds timeout{0};
  ncclComm_t world = nullptr;
  std::map<std::vector<int>, ncclComm_t> groups;  // more than one rank, not the world
  std::vector<ncclComm_t> all;                    // world first: what abort and destroy visit
  std::mutex comms_mutex;                         // `all` against the watchdog's polls
  std::atomic<bool> aborted{false};
  std::unique_ptr<c10::cuda::CUDAStream> stream;
  std::unique_ptr<detail::Watchdog> watchdog;
  mutable std::mutex stats_mutex;
  NcclStats stats;

  std::string where() const {
    return detail::cat("rank ", rank, " (host ", host, ", cuda:", device, ")");
  }

  [[noreturn]] void throw_nccl(const char* call, ncclResult_t rc, ncclComm_t comm, const char* file,
                               int line) const {
    const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
    throw CommError(detail::cat(
        call, " failed on ", where(), " at ", file, ":", line, ": ", ncclGetErrorString(rc),
        (last != nullptr && last[0] != '\0') ? std::string(" (") + last + ")" : std::string()));
  }

  void check(ncclResult_t rc, const char* call, ncclComm_t comm, const char* file, int line) const {
    if (rc != ncclSuccess && rc != ncclInProgress) {
      throw_nccl(call, rc, comm, file, line);
    }
  }

  // Non-blocking communicators: polls until `comm` has finished its last call (init, split
  // or enqueue), within the timeout; aborts and throws otherwise.
  void wait_ready(ncclComm_t comm, const char* what, const char* file, int line) {
    if (comm == nullptr) {
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ncclResult_t state = ncclInProgress;
    for (;;) {
      const ncclResult_t rc = guarded([&] { return ncclCommGetAsyncError(comm, &state); });
      check(rc, "ncclCommGetAsyncError", comm, file, line);
      if (state != ncclInProgress) {
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abort_all();
        throw TimeoutError(detail::cat(what, " on ", where(), " did not complete within ",
                                       timeout.count(), " ms; the communicators were aborted"));
      }
      std::this_thread::yield();
    }
    if (state != ncclSuccess) {
      throw_nccl(what, state, comm, file, line);
    }
  }

  // Runs an NCCL call on the communicators unless the watchdog has aborted them (it frees
  // them: a call after the abort would use freed memory); the two never overlap.
  template <typename F>
  ncclResult_t guarded(F&& call) {
    std::lock_guard<std::mutex> lock(comms_mutex);
    if (aborted.load()) {
      throw CommError(detail::cat("the NCCL communicators of ", where(),
                                  " were aborted after an earlier failure",
                                  watchdog ? " (" + watchdog->failure() + ")" : std::string(),
                                  "; they take no new operations"));
    }
    return call();
  }

  ncclConfig_t config() const {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = options.nonblocking ? 0 : 1;
    return c;
  }

  void abort_all() {
    if (aborted.exchange(true)) {
      return;
    }
    std::lock_guard<std::mutex> lock(comms_mutex);
    for (ncclComm_t c : all) {
      ncclCommAbort(c);
    }
  }

  std::string async_error() {
    if (aborted.load()) {
      return {};
    }
    std::lock_guard<std::mutex> lock(comms_mutex);
    for (ncclComm_t c : all) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(c, &state) != ncclSuccess) {
        return "ncclCommGetAsyncError failed";
      }
      if (state != ncclSuccess && state != ncclInProgress) {
        const char* last = ncclGetLastError(c);
        return detail::cat(
            ncclGetErrorString(state), " on ", where(),
            (last != nullptr && last[0] != '\0') ? std::string(": ") + last : std::string());
      }
    }
    return {};
  }

  ncclComm_t comm_for(const std::vector<int>& ranks, const char* who) const {
    if (ranks.empty() || static_cast<int>(ranks.size()) == size) {
      if (!ranks.empty()) {
        for (int i = 0; i < size; ++i) {
          DECENT_DP_CHECK_ARG(ranks[i] == i, who, ": group ", ranks_to_string(ranks),
                              " is not ascending");
        }
      }
      return world;
    }
    auto it = groups.find(ranks);
    DECENT_DP_CHECK_ARG(it != groups.end(), who, ": group ", ranks_to_string(ranks),
                        " was not created by make_groups on the NCCL communicator of ", where());
    return it->second;
  }

  void check_tensor(const at::Tensor& t, const char* who, const char* name) const {
    DECENT_DP_CHECK_ARG(t.defined(), who, ": ", name, " must be defined");
    DECENT_DP_CHECK_ARG(t.is_cuda() && t.device().index() == device, who, ": ", name, " is on ",
                        t.device().str(), "; the NCCL communicator of ", where(),
                        " takes tensors on cuda:", device);
    DECENT_DP_CHECK_ARG(t.is_contiguous(), who, ": ", name, " must be contiguous");
  }

  // Orders the communication stream after the caller's current stream.
  void begin() {
    watchdog->check();
    auto current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    CudaEvent ready(cudaEventDisableTiming);
    ready.record(current);
    ready.block(*stream);
  }

  // Records the tensors on the communication stream, then the end event, and hands the
  // Work to the watchdog.
  std::shared_ptr<Work> end(std::string description, std::vector<at::Tensor> tensors);
};

namespace {

class NcclWork final : public Work {
 public:
  NcclWork(std::string description, std::vector<at::Tensor> tensors,
           std::chrono::milliseconds timeout, std::shared_ptr<CudaEvent> end, int device)
      : Work(std::move(description), std::move(tensors), timeout),
        end_(std::move(end)),
        device_(device) {}

  // The caller's current stream waits for the operation; the host does not.
  void synchronize() override {
    if (is_completed()) {
      wait();  // rethrows the operation's error
      return;
    }
    end_->block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)));
  }

 private:
  std::shared_ptr<CudaEvent> end_;
  int device_;
};

}  // namespace

std::shared_ptr<Work> NcclCommunicator::Impl::end(std::string description,
                                                  std::vector<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream);
  }
  auto done = std::make_shared<CudaEvent>(cudaEventDisableTiming);
  done->record(*stream);
  auto work =
      std::make_shared<NcclWork>(std::move(description), std::move(tensors), timeout, done, device);
  watchdog->track(
      work, [done] { return done->query(); }, timeout);
  return work;
}

#define DECENT_DP_NCCL_CHECK(call, comm) impl_->check((call), #call, (comm), __FILE__, __LINE__)

NcclCommunicator::NcclCommunicator(std::shared_ptr<Communicator> control, NcclOptions options)
    : impl_(std::make_unique<Impl>()) {
  DECENT_DP_CHECK_ARG(control != nullptr, "NcclCommunicator: control must not be null");
  DECENT_DP_CHECK_ARG(control->supports(c10::Device(c10::kCPU)),
                      "NcclCommunicator: control must be a CPU communicator (e.g. MPI), got the ",
                      to_string(control->backend()), " one");
  DECENT_DP_CHECK_ARG(options.poll_interval.count() > 0,
                      "NcclCommunicator: poll_interval must be > 0 us, got ",
                      options.poll_interval.count());
  Impl& m = *impl_;
  m.control = std::move(control);
  m.options = options;
  m.rank = m.control->rank();
  m.size = m.control->size();
  m.host = detail::host_name();
  m.timeout = options.timeout.count() > 0 ? options.timeout : m.control->timeout();
  const int count = c10::cuda::device_count();
  DECENT_DP_CHECK_ARG(count > 0, "NcclCommunicator: rank ", m.rank, " (host ", m.host,
                      ") sees no CUDA device");
  m.device = options.device >= 0 ? options.device : m.control->local_rank() % count;
  DECENT_DP_CHECK_ARG(m.device < count, "NcclCommunicator: device must be in [0, ", count,
                      ") on host ", m.host, ", got ", m.device);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));

  // Every rank learns every rank's (host, device): two ranks on one GPU are refused here,
  // naming them, instead of by NCCL's "duplicate GPU" during init.
  {
    const auto devices = detail::rank_devices(*m.control, m.device);
    const auto shared = detail::first_shared_device(devices);
    if (shared.first >= 0) {
      throw InvalidArgument(detail::cat(
          "NcclCommunicator: ranks ", shared.first, " and ", shared.second, " both use ",
          devices[shared.first],
          " (host#device); NCCL needs one device per rank (pass "
          "NcclOptions::device, or let the wrappers exchange through the MPI backend with "
          "host staging)"));
    }
  }

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (m.rank == 0) {
    DECENT_DP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  }
  auto id_bytes =
      at::empty({static_cast<int64_t>(sizeof(id))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
  m.control->broadcast(id_bytes, 0)->wait();
  std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));
  ncclConfig_t config = m.config();
  DECENT_DP_NCCL_CHECK(ncclCommInitRankConfig(&m.world, m.size, id, m.rank, &config), m.world);
  m.wait_ready(m.world, "ncclCommInitRankConfig", __FILE__, __LINE__);
  m.all.push_back(m.world);
  m.stream = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(
      /*isHighPriority=*/true, static_cast<c10::DeviceIndex>(m.device)));
  Impl* raw = impl_.get();
  m.watchdog = std::make_unique<detail::Watchdog>(
      detail::cat("NCCL communicator of ", m.where()),
      detail::Watchdog::Hooks{[raw] { return raw->async_error(); }, [raw] { raw->abort_all(); }},
      options.poll_interval);
  if (m.rank == 0) {
    DECENT_DP_LOG_INFO(detail::cat("NCCL ", runtime_version(), ": ", m.size, " ranks, ",
                                   options.nonblocking ? "non-blocking" : "blocking",
                                   " communicators, timeout ", m.timeout.count(), " ms"));
  }
}

NcclCommunicator::~NcclCommunicator() {
  Impl& m = *impl_;
  m.watchdog.reset();  // fails what is still in flight
  if (m.aborted.load()) {
    return;
  }
  std::lock_guard<std::mutex> lock(m.comms_mutex);
  for (auto it = m.all.rbegin(); it != m.all.rend(); ++it) {
    ncclComm_t c = *it;
    ncclResult_t rc = ncclCommFinalize(c);
    ncclResult_t state = rc;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (rc == ncclSuccess || rc == ncclInProgress) {
      if (ncclCommGetAsyncError(c, &state) != ncclSuccess || state != ncclInProgress ||
          std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::yield();
    }
    if ((rc != ncclSuccess && rc != ncclInProgress) || state != ncclSuccess) {
      DECENT_DP_LOG_WARN(detail::cat("NCCL communicator of ", m.where(), ": finalize failed (",
                                     ncclGetErrorString(state), "); aborting it"));
      ncclCommAbort(c);
    } else {
      ncclCommDestroy(c);
    }
  }
}

int NcclCommunicator::rank() const {
  return impl_->rank;
}
int NcclCommunicator::size() const {
  return impl_->size;
}
int NcclCommunicator::local_rank() const {
  return impl_->control->local_rank();
}
int NcclCommunicator::local_size() const {
  return impl_->control->local_size();
}
int NcclCommunicator::device_index() const {
  return impl_->device;
}
std::chrono::milliseconds NcclCommunicator::timeout() const {
  return impl_->timeout;
}

bool NcclCommunicator::supports(const c10::Device& device) const {
  return device.is_cuda() && device.index() == impl_->device;
}

int NcclCommunicator::runtime_version() {
  int version = 0;
  ncclGetVersion(&version);
  return version;
}

NcclStats NcclCommunicator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->stats;
}

void NcclCommunicator::make_groups(const std::vector<std::vector<int>>& groups) {
  Impl& m = *impl_;
  const uint64_t hash = detail::check_groups(groups, m.size);
  // Every rank must pass the same list: compare a hash of it across ranks.
  auto mine = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  *mine.data_ptr<int64_t>() = static_cast<int64_t>(hash);
  auto hashes = at::empty({m.size}, mine.options());
  m.control->allgather(hashes, mine, AllgatherOptions{{}, {}, "make_groups check"})->wait();
  for (int r = 0; r < m.size; ++r) {
    DECENT_DP_CHECK_ARG(hashes.data_ptr<int64_t>()[r] == *mine.data_ptr<int64_t>(),
                        "make_groups: rank ", r, " passed a different list of groups than rank ",
                        m.rank, "; every rank must pass the same list in the same order");
  }
  // Deal the new groups into rounds of disjoint groups; one split per round.
  std::vector<std::vector<std::vector<int>>> rounds;
  std::vector<std::vector<bool>> used;
  std::vector<std::vector<int>> seen;
  for (const auto& g : groups) {
    if (static_cast<int>(g.size()) <= 1 || static_cast<int>(g.size()) == m.size ||
        m.groups.count(g) > 0 || std::find(seen.begin(), seen.end(), g) != seen.end()) {
      continue;
    }
    seen.push_back(g);
    size_t k = 0;
    for (; k < rounds.size(); ++k) {
      if (std::none_of(g.begin(), g.end(), [&](int r) { return used[k][r]; })) {
        break;
      }
    }
    if (k == rounds.size()) {
      rounds.emplace_back();
      used.emplace_back(m.size, false);
    }
    rounds[k].push_back(g);
    for (int r : g) {
      used[k][r] = true;
    }
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));
  for (const auto& round : rounds) {
    int color = NCCL_SPLIT_NOCOLOR;
    const std::vector<int>* mine_g = nullptr;
    for (size_t i = 0; i < round.size(); ++i) {
      if (std::binary_search(round[i].begin(), round[i].end(), m.rank)) {
        color = static_cast<int>(i);
        mine_g = &round[i];
      }
    }
    ncclComm_t comm = nullptr;
    ncclConfig_t config = m.config();
    DECENT_DP_NCCL_CHECK(
        m.guarded([&] { return ncclCommSplit(m.world, color, m.rank, &comm, &config); }), m.world);
    m.wait_ready(m.world, "ncclCommSplit", __FILE__, __LINE__);
    m.wait_ready(comm, "ncclCommSplit", __FILE__, __LINE__);
    if (mine_g != nullptr) {
      DECENT_DP_CHECK_ARG(comm != nullptr, "make_groups: ncclCommSplit gave no communicator for ",
                          ranks_to_string(*mine_g), " on ", m.where());
      m.groups.emplace(*mine_g, comm);
      std::lock_guard<std::mutex> lock(m.comms_mutex);
      m.all.push_back(comm);
    }
  }
}

bool NcclCommunicator::has_group(const std::vector<int>& ranks) const {
  const Impl& m = *impl_;
  if (ranks.empty() || static_cast<int>(ranks.size()) == m.size) {
    return ranks.empty() || (ranks.front() == 0 && ranks.back() == m.size - 1);
  }
  if (ranks.size() == 1) {
    return ranks[0] == m.rank;
  }
  return m.groups.count(ranks) > 0;
}

std::shared_ptr<Work> NcclCommunicator::allreduce(const at::Tensor& input, const at::Tensor& output,
                                                  const AllreduceOptions& options) {
  Impl& m = *impl_;
  const char* who = "allreduce";
  m.check_tensor(input, who, "input");
  m.check_tensor(output, who, "output");
  DECENT_DP_CHECK_ARG(
      input.scalar_type() == output.scalar_type() && input.numel() == output.numel(), who,
      ": output must match input (", input.numel(), " x ", input.scalar_type(), "), got ",
      output.numel(), " x ", output.scalar_type());
  const ncclDataType_t type = nccl_type(input, who);
  DECENT_DP_CHECK_ARG(options.op == ReduceOp::kSum || input.is_floating_point(), who,
                      ": kAvg takes floating-point tensors (", input.scalar_type(), " takes kSum)");
  const std::vector<int>& ranks = options.ranks;
  DECENT_DP_CHECK_ARG(ranks.empty() || std::binary_search(ranks.begin(), ranks.end(), m.rank), who,
                      ": group ", ranks_to_string(ranks), " does not contain rank ", m.rank);
  const auto timeout = options.timeout.count() > 0 ? options.timeout : m.timeout;
  std::string description = detail::cat(
      "allreduce(", to_string(options.op), ", ", input.numel(), " x ", input.scalar_type(),
      ") on group ", ranks.empty() ? std::string("world") : ranks_to_string(ranks),
      options.label.empty() ? std::string() : " (" + options.label + ")");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));
  const int k = ranks.empty() ? m.size : static_cast<int>(ranks.size());
  if (k == 1 && m.size > 1) {  // a group of one; a world of one runs NCCL
    if (!output.is_same(input)) {
      output.copy_(input);  // on the caller's stream: ordered for its readers already
    }
    auto work = std::make_shared<Work>(std::move(description),
                                       std::vector<at::Tensor>{input, output}, timeout);
    work->finish();
    return work;
  }
  ncclComm_t comm = m.comm_for(ranks, who);
  m.begin();
  const ncclRedOp_t op = options.op == ReduceOp::kAvg ? ncclAvg : ncclSum;
  DECENT_DP_NCCL_CHECK(m.guarded([&] {
    return ncclAllReduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                         type, op, comm, m.stream->stream());
  }),
                       comm);
  m.wait_ready(comm, "ncclAllReduce", __FILE__, __LINE__);
  {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    ++m.stats.allreduces;
    m.stats.bytes_sent += 2 * (k - 1) * static_cast<uint64_t>(input.nbytes()) / k;
  }
  return m.end(std::move(description), {input, output});
}

std::shared_ptr<Work> NcclCommunicator::broadcast(const at::Tensor& tensor, int root) {
  Impl& m = *impl_;
  const char* who = "broadcast";
  m.check_tensor(tensor, who, "tensor");
  DECENT_DP_CHECK_ARG(root >= 0 && root < m.size, who, ": root must be in [0, ", m.size, "), got ",
                      root);
  const ncclDataType_t type = nccl_type(tensor, who);
  std::string description =
      detail::cat("broadcast(", tensor.numel(), " x ", tensor.scalar_type(), ") from rank ", root);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));
  m.begin();
  DECENT_DP_NCCL_CHECK(m.guarded([&] {
    return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                         type, root, m.world, m.stream->stream());
  }),
                       m.world);
  m.wait_ready(m.world, "ncclBroadcast", __FILE__, __LINE__);
  {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    ++m.stats.broadcasts;
    if (m.rank == root) {
      m.stats.bytes_sent += static_cast<uint64_t>(tensor.nbytes());
    }
  }
  return m.end(std::move(description), {tensor});
}

std::shared_ptr<Work> NcclCommunicator::allgather(const at::Tensor& output, const at::Tensor& input,
                                                  const AllgatherOptions& options) {
  Impl& m = *impl_;
  const char* who = "allgather";
  m.check_tensor(input, who, "input");
  m.check_tensor(output, who, "output");
  const std::vector<int>& ranks = options.ranks;
  const int k = ranks.empty() ? m.size : static_cast<int>(ranks.size());
  DECENT_DP_CHECK_ARG(ranks.empty() || std::binary_search(ranks.begin(), ranks.end(), m.rank), who,
                      ": group ", ranks_to_string(ranks), " does not contain rank ", m.rank);
  DECENT_DP_CHECK_ARG(
      output.scalar_type() == input.scalar_type() && output.numel() == k * input.numel(), who,
      ": output must hold ", k, " x ", input.numel(), " elements of ", input.scalar_type(),
      ", got ", output.numel(), " x ", output.scalar_type());
  const ncclDataType_t type = nccl_type(input, who);
  const auto timeout = options.timeout.count() > 0 ? options.timeout : m.timeout;
  std::string description =
      detail::cat("allgather(", input.numel(), " x ", input.scalar_type(), ") on group ",
                  ranks.empty() ? std::string("world") : ranks_to_string(ranks),
                  options.label.empty() ? std::string() : " (" + options.label + ")");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));
  if (k == 1 && m.size > 1) {  // a group of one; a world of one runs NCCL
    output.copy_(input.reshape({-1}).view_as(output));
    auto work = std::make_shared<Work>(std::move(description),
                                       std::vector<at::Tensor>{input, output}, timeout);
    work->finish();
    return work;
  }
  ncclComm_t comm = m.comm_for(ranks, who);
  m.begin();
  DECENT_DP_NCCL_CHECK(m.guarded([&] {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                         type, comm, m.stream->stream());
  }),
                       comm);
  m.wait_ready(comm, "ncclAllGather", __FILE__, __LINE__);
  {
    std::lock_guard<std::mutex> lock(m.stats_mutex);
    ++m.stats.allgathers;
    m.stats.bytes_sent += (k - 1) * static_cast<uint64_t>(input.nbytes());
  }
  return m.end(std::move(description), {input, output});
}

void NcclCommunicator::barrier() {
  Impl& m = *impl_;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(m.device));
  auto one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(c10::kCUDA, m.device));
  allreduce(one, one, AllreduceOptions{ReduceOp::kSum, {}, {}, "barrier"})->wait();
}

at::Tensor NcclCommunicator::allocate(int64_t numel, const at::TensorOptions& options) {
  DECENT_DP_CHECK_ARG(numel >= 0, "allocate: numel must be >= 0, got ", numel);
  return at::zeros({numel}, options.device(c10::Device(c10::kCUDA, impl_->device)));
}

}  // namespace decent_dp
