#include "decent_dp/env.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace env {
namespace {

std::string read(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

int64_t read_int(const char* name, int64_t fallback, int64_t min_value,
                 int64_t max_value = std::numeric_limits<int64_t>::max()) {
  const std::string text = read(name);
  if (text.empty()) {
    return fallback;
  }
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < min_value || value > max_value) {
    throw InvalidArgument(detail::cat("environment variable ", name, " must be an integer in [",
                                      min_value, ", ", max_value, "], got '", text, "'"));
  }
  return value;
}

}  // namespace

std::string log_level() {
  static const std::string value = read("DECENT_DP_LOG_LEVEL");
  return value;
}

int64_t timeout_ms() {
  static const int64_t value = read_int("DECENT_DP_TIMEOUT_MS", 600000, 1, kMaxTimeoutMs);
  return value;
}

int64_t shutdown_timeout_ms() {
  static const int64_t value = read_int("DECENT_DP_SHUTDOWN_TIMEOUT_MS",
                                        std::min<int64_t>(30000, timeout_ms()), 1, kMaxTimeoutMs);
  return value;
}

int64_t stall_warn_ms() {
  static const int64_t value = read_int("DECENT_DP_STALL_WARN_MS", 60000, 0, kMaxTimeoutMs);
  return value;
}

int64_t progress_interval_us() {
  static const int64_t value = read_int("DECENT_DP_PROGRESS_INTERVAL_US", 50, 0);
  return value;
}

namespace {

bool read_switch(const char* name) {
  const std::string text = read(name);
  if (text.empty() || text == "1") {
    return true;
  }
  if (text == "0") {
    return false;
  }
  throw InvalidArgument(
      detail::cat("environment variable ", name, " must be 0 or 1, got '", text, "'"));
}

}  // namespace

bool shared_memory() {
  static const bool value = read_switch("DECENT_DP_SHM");
  return value;
}

bool node_aware() {
  static const bool value = read_switch("DECENT_DP_NODE_AWARE");
  return value;
}

int ring_lanes() {
  static const int value = static_cast<int>(read_int("DECENT_DP_RING_LANES", 4, 1, 8));
  return value;
}

}  // namespace env
}  // namespace decent_dp
