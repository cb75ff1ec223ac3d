// The watchdog of the NCCL backend (Note [NCCL watchdog]) with fake device queries: it needs
// no GPU, so its failure handling is tested on every machine.
#include "torch_catch.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "decent_dp/detail/watchdog.h"
#include "decent_dp/errors.h"

using namespace decent_dp;
using namespace std::chrono_literals;
using detail::Watchdog;

namespace {

struct FakeBackend {
  std::atomic<int> aborts{0};
  std::string error;  // set before the watchdog polls it (tests poll by hand)
  std::mutex mutex;

  Watchdog::Hooks hooks() {
    return Watchdog::Hooks{[this] {
                             std::lock_guard<std::mutex> lock(mutex);
                             return error;
                           },
                           [this] { ++aborts; }};
  }
  void set_error(std::string e) {
    std::lock_guard<std::mutex> lock(mutex);
    error = std::move(e);
  }
};

std::shared_ptr<Work> make_work(const std::string& what) {
  return std::make_shared<Work>(what, std::vector<at::Tensor>{}, 10s);
}

bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit = 5s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) {
      return true;
    }
    std::this_thread::sleep_for(1ms);
  }
  return cond();
}

}  // namespace

TEST_CASE("the watchdog finishes an operation once the device reports it done", "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("test communicator", backend.hooks(), 100us);
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto work = make_work("allreduce(avg, 4 x float32) on group [0,1]");
  dog.track(
      work, [done] { return done->load(); }, 5s);
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(work->is_completed());
  CHECK(dog.pending() == 1);
  done->store(true);
  // wait() returns through the watchdog thread's finish(), without a poll of its own.
  work->wait(2s);
  CHECK(work->is_completed());
  CHECK_FALSE(work->has_error());
  CHECK(dog.pending() == 0);
  CHECK(backend.aborts == 0);
  CHECK(dog.failure().empty());
}

TEST_CASE("operations finish out of launch order", "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("test communicator", backend.hooks(), 100us);
  auto first_done = std::make_shared<std::atomic<bool>>(false);
  auto first = make_work("first");
  auto second = make_work("second");
  dog.track(
      first, [first_done] { return first_done->load(); }, 5s);
  dog.track(
      second, [] { return true; }, 5s);
  CHECK(eventually([&] { return second->is_completed(); }));
  CHECK_FALSE(first->is_completed());
  first_done->store(true);
  CHECK(eventually([&] { return first->is_completed(); }));
}

TEST_CASE("a missed deadline aborts the backend and fails every pending operation, named",
          "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("NCCL communicator of rank 3 (host n7, cuda:1)", backend.hooks(), 100us);
  auto stuck = make_work("allreduce(avg, 1024 x float32) on group [2,3] (bucket 1, update 7)");
  auto other = make_work("allgather(16 x float32) on group [3,4]");
  auto finished = make_work("broadcast(8 x float32) from rank 0");
  dog.track(
      finished, [] { return true; }, 5s);
  CHECK(eventually([&] { return finished->is_completed(); }));
  dog.track(
      stuck, [] { return false; }, 30ms);
  dog.track(
      other, [] { return false; }, 10s);
  CHECK(eventually([&] { return stuck->is_completed() && other->is_completed(); }));
  CHECK(backend.aborts == 1);
  CHECK_THROWS_AS(stuck->wait(1s), TimeoutError);
  CHECK_THROWS_WITH(stuck->wait(1s),
                    Catch::Contains("allreduce(avg, 1024 x float32) on group [2,3] (bucket 1, "
                                    "update 7) did not complete within the timeout of 30 ms"));
  // The other one is a CommError (not a timeout) that says why it was failed.
  try {
    other->wait(1s);
    FAIL("the pending operation should have failed");
  } catch (const TimeoutError&) {
    FAIL("only the late operation is a timeout");
  } catch (const CommError& e) {
    CHECK_THAT(e.what(), Catch::Contains("allgather(16 x float32) on group [3,4] failed"));
    CHECK_THAT(e.what(), Catch::Contains("was aborted because"));
    CHECK_THAT(e.what(), Catch::Contains("group [2,3]"));
  }
  CHECK_FALSE(finished->has_error());
  // New operations are refused, naming the first failure.
  CHECK_THROWS_AS(dog.track(
                      make_work("next"), [] { return true; }, 1s),
                  CommError);
  CHECK_THROWS_WITH(dog.check(), Catch::Contains("takes no new operations"));
  CHECK_THROWS_WITH(dog.check(), Catch::Contains("rank 3 (host n7, cuda:1)"));
  // It aborts once, however often it is polled afterwards.
  dog.poll();
  dog.poll();
  CHECK(backend.aborts == 1);
}

TEST_CASE("an asynchronous backend error fails everything in flight with that error",
          "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("test communicator", backend.hooks(), 100us);
  auto a = make_work("allreduce a");
  auto b = make_work("allreduce b");
  dog.track(
      a, [] { return false; }, 10s);
  dog.track(
      b, [] { return false; }, 10s);
  backend.set_error("remote process exited or there was a network error (ncclRemoteError)");
  CHECK(eventually([&] { return a->is_completed() && b->is_completed(); }));
  CHECK(backend.aborts == 1);
  for (auto& w : {a, b}) {
    CHECK_THROWS_AS(w->wait(1s), CommError);
    CHECK_THROWS_WITH(w->wait(1s), Catch::Contains("ncclRemoteError"));
  }
  CHECK_THAT(dog.failure(), Catch::Contains("asynchronous error"));
}

TEST_CASE("an idle watchdog still notices an asynchronous error", "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("test communicator", backend.hooks(), 100us);
  backend.set_error("ncclSystemError");
  // The failure is recorded first, then the backend aborted: wait for the abort.
  CHECK(eventually([&] { return backend.aborts == 1; }));
  CHECK_THAT(dog.failure(), Catch::Contains("ncclSystemError"));
}

TEST_CASE("a device query that throws fails only its own operation", "[watchdog]") {
  FakeBackend backend;
  Watchdog dog("test communicator", backend.hooks(), 100us);
  auto bad = make_work("allreduce bad");
  auto good = make_work("allreduce good");
  dog.track(
      bad, []() -> bool { throw std::runtime_error("an illegal memory access"); }, 10s);
  dog.track(
      good, [] { return true; }, 10s);
  CHECK(eventually([&] { return bad->is_completed() && good->is_completed(); }));
  CHECK_THROWS_WITH(bad->wait(1s), Catch::Contains("allreduce bad failed on the device: an "
                                                   "illegal memory access"));
  CHECK_FALSE(good->has_error());
  CHECK(backend.aborts == 0);
}

TEST_CASE("destroying the watchdog fails what is still in flight", "[watchdog]") {
  FakeBackend backend;
  auto work = make_work("allreduce left behind");
  {
    Watchdog dog("test communicator", backend.hooks(), 100us);
    dog.track(
        work, [] { return false; }, 10s);
  }
  CHECK(work->is_completed());
  CHECK_THROWS_WITH(work->wait(1s), Catch::Contains("was still in flight when the test "
                                                    "communicator was destroyed"));
}

TEST_CASE("the watchdog names bad arguments", "[watchdog]") {
  FakeBackend backend;
  CHECK_THROWS_WITH(Watchdog("x", backend.hooks(), 0us),
                    Catch::Contains("interval must be > 0 us, got 0"));
  CHECK_THROWS_WITH(Watchdog("x", Watchdog::Hooks{}, 100us),
                    Catch::Contains("both hooks (async_error, abort) are required"));
  Watchdog dog("x", backend.hooks(), 100us);
  CHECK_THROWS_WITH(dog.track(
                        nullptr, [] { return true; }, 1s),
                    Catch::Contains("work must not be null"));
  CHECK_THROWS_WITH(dog.track(
                        make_work("w"), [] { return true; }, 0ms),
                    Catch::Contains("timeout must be > 0 ms, got 0"));
}
