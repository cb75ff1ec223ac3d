#include "decent_dp/detail/progress_engine.h"

#include <algorithm>
#include <mutex>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "decent_dp/detail/mpi_check.h"
#include "decent_dp/errors.h"
#include "decent_dp/logging.h"

namespace decent_dp {
namespace detail {
namespace {

// Note [abandoned requests].
thread_local std::vector<MPI_Request>* t_posting = nullptr;

struct Graveyard {
  std::mutex mutex;
  // Never destroyed: an operation's destructor may release the last reference to its engine,
  // whose thread may be the one burying it. Error paths only, so what it keeps is small.
  std::vector<std::unique_ptr<ProgressEngine::Op>> ops;
};

Graveyard& graveyard() {
  static Graveyard* g = new Graveyard;
  return *g;
}

void bury(std::unique_ptr<ProgressEngine::Op> op) {
  for (MPI_Request& r : op->orphans) {
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
    }
  }
  Graveyard& g = graveyard();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.ops.push_back(std::move(op));
}

void finish_op(ProgressEngine::Op& op, std::exception_ptr error) {
  op.done = true;
  if (!error && op.complete) {
    try {
      op.complete();
    } catch (...) {
      error = std::current_exception();
    }
  }
  op.work->finish(error);
}

}  // namespace

void track_posted(MPI_Request request) {
  if (t_posting != nullptr && request != MPI_REQUEST_NULL) {
    t_posting->push_back(request);
  }
}

bool graveyard_empty() {
  Graveyard& g = graveyard();
  std::lock_guard<std::mutex> lock(g.mutex);
  int finalized = 0;
  MPI_Finalized(&finalized);
  bool empty = true;
  for (auto& op : g.ops) {
    for (MPI_Request& r : op->orphans) {
      int done = 0;
      if (r != MPI_REQUEST_NULL && !finalized) {
        MPI_Test(&r, &done, MPI_STATUS_IGNORE);  // a completed request becomes null
      }
      empty = empty && r == MPI_REQUEST_NULL;
    }
  }
  return empty && !finalized;
}

ProgressEngine::ProgressEngine(std::chrono::microseconds interval,
                               std::chrono::milliseconds drain_timeout, int rank)
    : interval_(interval), drain_timeout_(drain_timeout), rank_(rank) {}

ProgressEngine::~ProgressEngine() {
  stop();
}

void ProgressEngine::start_thread() {
  thread_ = std::thread([this] { thread_main(); });
}

void ProgressEngine::enqueue(std::unique_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (stop_) {
      throw CommError(
          "MpiCommunicator: operation submitted while the communicator is being "
          "destroyed");
    }
    queue_.push_back(std::move(op));
    in_flight_.fetch_add(1);
  }
  // Start it right away from the submitting thread when no one else polls, so its first
  // messages leave without waiting for the progress thread to be scheduled.
  if (try_progress() == PollResult::kPolled && in_flight_.load() == 0) {
    return;  // done already (e.g. a tiny message whose peer was waiting)
  }
  if (drivers_.load() == 0) {
    cv_.notify_all();
  }
}

ProgressEngine::PollResult ProgressEngine::try_progress() {
  if (stopped_.load()) {
    return PollResult::kStopped;
  }
  std::unique_lock<std::mutex> token(token_, std::try_to_lock);
  if (!token.owns_lock()) {
    return PollResult::kBusy;
  }
  poll_once();
  return PollResult::kPolled;
}

void ProgressEngine::add_driver() {
  drivers_.fetch_add(1);
}

void ProgressEngine::remove_driver() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    drivers_.fetch_sub(1);
  }
  if (in_flight_.load() > 0) {
    cv_.notify_all();  // operations are left that the progress thread must advance
  }
}

void ProgressEngine::start(Op& op) {
  op.remaining.assign(1, 0);
  advance(op, 0);
}

void ProgressEngine::end(Op& op, std::exception_ptr error) {
  if (error) {
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (owner_[i] == &op) {
        op.orphans.push_back(requests_[i]);
        owner_[i] = nullptr;
      }
    }
    drop_released();
  }
  finish_op(op, error);
}

void ProgressEngine::drop_released() {
  size_t kept = 0;
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (owner_[i] != nullptr) {
      requests_[kept] = requests_[i];
      owner_[kept] = owner_[i];
      lane_[kept] = lane_[i];
      ++kept;
    }
  }
  requests_.resize(kept);
  owner_.resize(kept);
  lane_.resize(kept);
}

void ProgressEngine::advance(Op& op, int lane) {
  std::vector<MPI_Request> posted;
  std::vector<MPI_Request> tracked;
  std::vector<MPI_Request>* outer = t_posting;
  t_posting = &tracked;
  try {
    posted = op.next(lane);
  } catch (...) {
    t_posting = outer;
    // What the step posted before it threw stays in flight: Note [abandoned requests].
    op.orphans.insert(op.orphans.end(), tracked.begin(), tracked.end());
    end(op, std::current_exception());
    return;
  }
  t_posting = outer;
  completed_.fetch_add(1);  // a step of the operation finished (or it started)
  if (posted.empty()) {
    ++op.finished_lanes;
  } else {
    op.remaining[static_cast<size_t>(lane)] = posted.size();
    for (MPI_Request r : posted) {
      requests_.push_back(r);
      owner_.push_back(&op);
      lane_.push_back(lane);
    }
  }
  // Note [lanes]: lanes the step opened start now.
  int wanted = 1;
  try {
    wanted = op.lanes ? op.lanes() : 1;
  } catch (...) {
    end(op, std::current_exception());
    return;
  }
  while (!op.done && op.remaining.size() < static_cast<size_t>(wanted)) {
    op.remaining.push_back(0);
    advance(op, static_cast<int>(op.remaining.size()) - 1);
  }
  if (!op.done && op.finished_lanes == op.remaining.size()) {
    finish_op(op, nullptr);
  }
}

void ProgressEngine::fail_all(std::exception_ptr error) {
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (owner_[i] != nullptr) {
      owner_[i]->orphans.push_back(requests_[i]);
    }
  }
  requests_.clear();
  owner_.clear();
  lane_.clear();
  for (auto& op : active_) {
    if (!op->done) {
      finish_op(*op, error);
    }
  }
  retire_done();
}

void ProgressEngine::retire_done() {
  const size_t before = active_.size();
  auto kept = active_.begin();
  for (auto it = active_.begin(); it != active_.end(); ++it) {
    if (!(*it)->done) {
      if (kept != it) {
        *kept = std::move(*it);
      }
      ++kept;
    } else if (!(*it)->orphans.empty()) {
      bury(std::move(*it));
    }
  }
  active_.erase(kept, active_.end());
  in_flight_.fetch_sub(before - active_.size());
}

void ProgressEngine::poll_once() {
  try {
    poll_steps();
  } catch (...) {
    // An internal error (e.g. out of memory while queueing requests) must not escape into
    // the progress thread, which would terminate the process: every operation fails with it.
    fail_all(std::current_exception());
  }
}

void ProgressEngine::poll_steps() {
  std::deque<std::unique_ptr<Op>> incoming;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    incoming.swap(queue_);
  }
  bool any_done = false;
  for (auto& op : incoming) {
    Op& raw = *op;
    active_.push_back(std::move(op));
    start(raw);
    any_done = any_done || raw.done;
  }
  if (!requests_.empty()) {
    indices_.resize(requests_.size());
    statuses_.resize(requests_.size());
    int count = 0;
    const int rc = MPI_Testsome(static_cast<int>(requests_.size()), requests_.data(), &count,
                                indices_.data(), statuses_.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
      try {
        throw_mpi_error("MPI_Testsome", rc, __FILE__, __LINE__);
      } catch (const CommError&) {
        fail_all(std::current_exception());
      }
      return;
    }
    if (count > 0 && count != MPI_UNDEFINED) {
      ready_.clear();
      for (int i = 0; i < count; ++i) {
        Op* op = owner_[indices_[i]];
        const int lane = lane_[indices_[i]];
        owner_[indices_[i]] = nullptr;
        const MPI_Status& st = statuses_[i];
        if (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR != MPI_SUCCESS && !op->failed) {
          // Report the request's own error at once (the waiter need not sit out the
          // timeout); the operation stays here until its other requests are done with
          // its buffers.
          op->failed = std::make_exception_ptr(CommError(cat(
              op->work->description(), ": a message ",
              st.MPI_SOURCE >= 0 ? cat("from rank ", st.MPI_SOURCE, " ") : std::string(),
              "failed: ", mpi_error_string(st.MPI_ERROR),
              " (do all members pass tensors of the same size and dtype, in the same order?)")));
          op->work->finish(op->failed);
        }
        if (--op->remaining[static_cast<size_t>(lane)] == 0) {
          ready_.emplace_back(op, lane);
        }
      }
      drop_released();
      for (const auto& [op, lane] : ready_) {
        if (op->done) {
          // Another lane of it failed in this poll: its requests are already orphans.
        } else if (op->failed) {
          end(*op, op->failed);
        } else {
          advance(*op, lane);
        }
        any_done = any_done || op->done;
      }
    }
  }
  if (any_done) {
    retire_done();
  }
}

constexpr std::chrono::microseconds ProgressEngine::kMaxBackoff;

void ProgressEngine::thread_main() {
#ifdef __linux__
  // SCHED_BATCH: a fair share of the core, but a wake-up never preempts the thread that is
  // running (the caller that just submitted work and is about to wait or compute).
  sched_param param{};
  param.sched_priority = 0;
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
  bool stopping = false;
  std::chrono::steady_clock::time_point deadline{};
  std::chrono::microseconds sleep = interval_;
  uint64_t last_completed = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      // Nothing to do, or a waiting caller polls: sleep until that changes.
      cv_.wait(lock, [this] { return stop_ || (in_flight_.load() > 0 && drivers_.load() == 0); });
      if (stop_ && !stopping) {
        stopping = true;
        deadline = std::chrono::steady_clock::now() + drain_timeout_;
      }
    }
    {
      std::unique_lock<std::mutex> token(token_, std::try_to_lock);
      if (token.owns_lock()) {
        poll_once();
        if (stopping && in_flight_.load() == 0) {
          break;
        }
        if (stopping && std::chrono::steady_clock::now() > deadline) {
          const size_t n = in_flight_.load();
          DECENT_DP_LOG_ERROR(cat("destroying the communicator with ", n,
                                  " operation(s) in flight; MPI will not be finalized"));
          {
            std::lock_guard<std::mutex> lock(queue_mutex_);
            for (auto& op : queue_) {
              active_.push_back(std::move(op));
            }
            queue_.clear();
          }
          fail_all(std::make_exception_ptr(CommError(
              cat("MpiCommunicator on rank ", rank_, " was destroyed with ", n,
                  " operation(s) in flight after waiting ", drain_timeout_.count(), " ms"))));
          abandoned_ = true;
          break;
        }
      }
    }
    if (in_flight_.load() == 0) {
      continue;
    }
    // Back off while polls complete nothing (large messages move in few progress calls, and
    // every wake-up costs the computation a context switch); start again from `interval_`
    // after a completed step or a new submission.
    const uint64_t completed = completed_.load();
    if (completed != last_completed) {
      last_completed = completed;
      sleep = interval_;
    } else {
      sleep = std::min(sleep * 2, std::max(interval_, kMaxBackoff));
    }
    if (sleep.count() == 0) {
      std::this_thread::yield();
    } else {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      if (cv_.wait_for(lock, sleep, [this] { return stop_ || !queue_.empty(); })) {
        sleep = interval_;
      }
    }
  }
}

bool ProgressEngine::stop() {
  std::chrono::milliseconds drain{};
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    drain = drain_timeout_;
  }
  return stop(drain);
}

bool ProgressEngine::stop(std::chrono::milliseconds drain) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    drain_timeout_ = std::min(drain_timeout_, drain);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
  stopped_.store(true);
  return !abandoned_;
}

}  // namespace detail
}  // namespace decent_dp
