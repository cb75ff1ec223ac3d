#include "decent_dp/metrics.h"

#include <nlohmann/json.hpp>

namespace decent_dp {

Metrics::Metrics() {
  for (const char* name : {"steps", "updates", "missing_gradients", "exchanges",
                           "exchange.bytes_sent", "exchange.bytes_received"}) {
    counters_[name] = 0;
  }
  for (const char* name : {"exchange.wait", "exchange.encode", "exchange.decode",
                           "exchange.aggregate", "optimizer", "privacy"}) {
    timers_[name] = Timer{};
  }
}

void Metrics::count(const std::string& name, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_[name] += n;
}

void Metrics::time(const std::string& name, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  Timer& t = timers_[name];
  t.seconds += seconds;
  ++t.count;
}

uint64_t Metrics::counter(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counters_.find(name);
  return it == counters_.end() ? 0 : it->second;
}

Metrics::Timer Metrics::timer(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = timers_.find(name);
  return it == timers_.end() ? Timer{} : it->second;
}

std::map<std::string, uint64_t> Metrics::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::map<std::string, Metrics::Timer> Metrics::timers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timers_;
}

void Metrics::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, value] : counters_) {
    value = 0;
  }
  for (auto& [name, value] : timers_) {
    value = Timer{};
  }
}

std::string Metrics::to_json() const {
  nlohmann::json counters = nlohmann::json::object();
  nlohmann::json timers = nlohmann::json::object();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, value] : counters_) {
      counters[name] = value;
    }
    for (const auto& [name, t] : timers_) {
      timers[name] = {{"seconds", t.seconds}, {"count", t.count}};
    }
  }
  return nlohmann::json{{"counters", counters}, {"timers", timers}}.dump();
}

}  // namespace decent_dp
