// Note [metrics]
// A small registry of named counters and timers, one per wrapper on each rank, filled by the
// exchange and the wrapper and read through `metrics()`. Every name below exists from the
// start (at zero), so every rank and every mode reports the same keys and a trainer can merge
// ranks by name.
//
// counters
//   steps                  forward passes that started a training step
//   updates                bucket updates (optimizer steps of one bucket)
//   missing_gradients      bucketed parameters whose gradient had not arrived at the end of
//                          a training backward (counted as zero, spec §7), per backward
//   exchanges              collectives the exchange started (one per bucket and update)
//   exchange.bytes_sent    payload bytes this rank sent in them, after encoding
//   exchange.bytes_received  and received
// timers (seconds, and how many intervals were added)
//   exchange.wait          blocked on an exchange that had not finished
//   exchange.encode        a codec encoding this rank's block
//   exchange.decode        a codec decoding the members' blocks
//   exchange.aggregate     an aggregator combining the group's blocks (gather path)
//   optimizer              bucket updates (optimizer and scheduler steps, clipping)
//   privacy                the Gaussian mechanism (Note [differential privacy])
//
// Bytes: an all-gather over k ranks of a P-byte payload moves (k - 1) P each way (exact);
// an all-reduce of B bytes is counted as 2 (k - 1) / k B each way, what a ring or the
// shared-memory path moves when B splits evenly into k chunks (the bus-bandwidth convention
// of nccl-tests). A group of one moves nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace decent_dp {

class Metrics {
 public:
  struct Timer {
    double seconds = 0;
    uint64_t count = 0;
  };

  Metrics();

  // Adds to a counter or a timer, creating it at zero first when it is new.
  void count(const std::string& name, uint64_t n = 1);
  void time(const std::string& name, double seconds);

  // 0 / a zero timer for a name never added to.
  uint64_t counter(const std::string& name) const;
  Timer timer(const std::string& name) const;
  std::map<std::string, uint64_t> counters() const;
  std::map<std::string, Timer> timers() const;

  // Every counter and timer back to zero (the names stay).
  void reset();

  // {"counters": {name: value}, "timers": {name: {"seconds": s, "count": n}}}
  std::string to_json() const;

  // Adds the time from construction to destruction to `name` (nothing when `metrics` is null).
  class Scope {
   public:
    Scope(Metrics* metrics, const char* name)
        : metrics_(metrics), name_(name), start_(std::chrono::steady_clock::now()) {}
    ~Scope() {
      if (metrics_ != nullptr) {
        metrics_->time(
            name_,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Metrics* metrics_;
    const char* name_;
    std::chrono::steady_clock::time_point start_;
  };

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> counters_;
  std::map<std::string, Timer> timers_;
};

}  // namespace decent_dp
