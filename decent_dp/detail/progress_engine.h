// Note [MPI progress engine]
// Non-blocking MPI operations progress only inside MPI calls. The engine owns every MPI
// operation a communicator has in flight and advances them in poll_once(): it starts queued
// operations in submission order (which is program order, the same on every rank, as MPI
// requires), tests their requests with MPI_Testsome and moves multi-step operations (the
// ring all-reduce) to their next step.
//
// Note [lanes]: an operation may run several independent sequences of steps at once (the
// lanes of a large all-reduce, Note [ring lanes] in ring_allreduce.h); the engine tracks each
// lane's requests apart and advances a lane as soon as its own requests completed.
//
// Only the holder of the engine's token polls. Two kinds of thread take it:
//  - the engine's progress thread, which polls while operations are in flight, sleeping in
//    between so it leaves the core to the computation it overlaps: `interval` after
//    progress, doubling up to kMaxBackoff (1 ms) while polls complete nothing. It sleeps
//    without polling while there are no operations or while a caller drives;
//  - a caller blocked in Work::wait(), which polls continuously instead of sleeping, so a
//    wait costs no thread hand-offs and runs at the speed of a blocking MPI call.
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "decent_dp/detail/ring_allreduce.h"
#include "decent_dp/work.h"

namespace decent_dp {
namespace detail {

// Note [abandoned requests]
// MPI keeps writing into a receive's buffer and reading a send's until the request completes,
// so a request is never just dropped: when an operation ends in an error with requests in
// flight (a step that throws after posting some of its messages, the drain timeout at
// shutdown, an engine failure) each one is cancelled (MPI_Cancel: receives end at once;
// sends a peer never takes may not) and the operation, which owns its buffers, its Work and
// so the tensors, moves to a process-wide graveyard instead of being destroyed. Later polls
// of any engine test the graveyard and free what has completed; MPI is not finalized while
// it holds anything (finalizing with requests in flight can block forever).
//
// Steps report what they posted as they post it (track_posted), so a step that throws
// halfway still hands its requests over.
void track_posted(MPI_Request request);
// True when the graveyard holds nothing (tested first); false also once MPI is finalized.
bool graveyard_empty();

class ProgressEngine {
 public:
  struct Op {
    std::shared_ptr<Work> work;
    // Called by the token holder for lane 0 when the operation starts, and for a lane again
    // each time all the requests that lane returned have completed: issues the lane's next
    // MPI calls and returns their requests, or none when the lane is done. The operation is
    // done when all its lanes are.
    std::function<std::vector<MPI_Request>(int lane)> next;
    // Note [lanes]: how many lanes the operation has opened so far, asked after each step
    // (empty: one). Lanes advance independently of one another, so a lane's step is not held
    // back by another lane's messages; each new lane starts at once.
    std::function<int()> lanes;
    // Runs once every step of every lane completed (e.g. the division of an average).
    std::function<void()> complete;
    std::vector<size_t> remaining;  // per started lane: its requests still in flight
    size_t finished_lanes = 0;
    bool done = false;
    std::exception_ptr failed;  // a request of the current step failed: finish with it
    // Requests still in flight when the operation ended in an error: the operation goes to
    // the graveyard instead of being destroyed (Note [abandoned requests]).
    std::vector<MPI_Request> orphans;
  };

  // `drain_timeout`: how long stop() lets in-flight operations finish.
  ProgressEngine(std::chrono::microseconds interval, std::chrono::milliseconds drain_timeout,
                 int rank);
  ~ProgressEngine();

  void start_thread();
  // Finishes (or, after drain_timeout, fails) every operation and joins the thread.
  // Returns false when operations had to be abandoned in flight.
  bool stop();
  // As stop(), letting operations finish for at most `drain` (for when a peer is known to
  // have left, so some never will).
  bool stop(std::chrono::milliseconds drain);

  void enqueue(std::unique_ptr<Op> op);
  enum class PollResult { kPolled, kBusy, kStopped };
  // Polls once unless another thread holds the token (kBusy) or the engine stopped.
  PollResult try_progress();
  // A caller blocked in Work::wait() polls through try_progress() between these two calls;
  // meanwhile the progress thread sleeps instead of competing for the core.
  void add_driver();
  void remove_driver();
  // Steps advanced so far (a waiting caller's backoff resets when this moves).
  uint64_t steps_completed() const { return completed_.load(); }
  static constexpr std::chrono::microseconds max_backoff() { return kMaxBackoff; }

  // Scratch buffers for operations; used only by the token holder.
  ScratchPool& scratch() { return scratch_; }

 private:
  void thread_main();
  void poll_once();   // requires the token; fails every operation on an internal error
  void poll_steps();  // poll_once's work
  void start(Op& op);
  void advance(Op& op, int lane);
  // Finishes `op`; with an error, its requests still in flight (other lanes') become its
  // orphans first (Note [abandoned requests]).
  void end(Op& op, std::exception_ptr error);
  // Removes the requests whose owner_ entry was cleared (completed or handed to orphans).
  void drop_released();
  // Moves the finished operations out of active_: to the graveyard those with orphans.
  void retire_done();
  void fail_all(std::exception_ptr error);

  const std::chrono::microseconds interval_;
  std::chrono::milliseconds drain_timeout_;  // guarded by queue_mutex_ once the thread runs
  const int rank_;

  std::mutex token_;
  // Token holder only.
  std::vector<std::unique_ptr<Op>> active_;
  std::vector<MPI_Request> requests_;
  std::vector<Op*> owner_;
  std::vector<int> lane_;  // of requests_[i] in owner_[i]
  std::vector<int> indices_;
  std::vector<MPI_Status> statuses_;
  std::vector<std::pair<Op*, int>> ready_;  // lanes whose step completed
  ScratchPool scratch_;

  std::mutex queue_mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;  // guarded by queue_mutex_
  bool stop_ = false;                      // guarded by queue_mutex_
  std::atomic<size_t> in_flight_{0};       // queued + active
  std::atomic<int> drivers_{0};
  std::atomic<uint64_t> completed_{0};  // steps advanced, for the progress thread's backoff
  static constexpr std::chrono::microseconds kMaxBackoff{1000};
  std::atomic<bool> stopped_{false};
  bool abandoned_ = false;
  std::thread thread_;
};

}  // namespace detail
}  // namespace decent_dp
