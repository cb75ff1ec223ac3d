#include "decent_dp/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "decent_dp/env.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

std::atomic<int> g_level{-1};
std::atomic<int> g_rank{-1};
std::atomic<int> g_size{0};
std::mutex g_write_mutex;

const char* level_letter(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return "T";
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kError:
      return "E";
    default:
      return "?";
  }
}

}  // namespace

LogLevel parse_log_level(const std::string& text) {
  if (text == "trace")
    return LogLevel::kTrace;
  if (text == "debug")
    return LogLevel::kDebug;
  if (text == "info")
    return LogLevel::kInfo;
  if (text == "warn")
    return LogLevel::kWarn;
  if (text == "error")
    return LogLevel::kError;
  if (text == "off")
    return LogLevel::kOff;
  throw InvalidArgument(
      detail::cat("log level must be one of trace, debug, info, warn, error, "
                  "off; got '",
                  text, "'"));
}

LogLevel log_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    LogLevel parsed = LogLevel::kWarn;
    const std::string text = env::log_level();
    if (!text.empty()) {
      try {
        parsed = parse_log_level(text);
      } catch (const InvalidArgument& e) {
        std::fprintf(stderr, "[decent_dp] DECENT_DP_LOG_LEVEL: %s; using warn\n", e.what());
      }
    }
    int expected = -1;
    g_level.compare_exchange_strong(expected, static_cast<int>(parsed));
    level = g_level.load();
  }
  return static_cast<LogLevel>(level);
}

void set_log_level(LogLevel level) {
  g_level.store(static_cast<int>(level));
}

void set_log_rank(int rank, int world_size) {
  g_rank.store(rank);
  g_size.store(world_size);
}

void log_message(LogLevel level, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_write_mutex);
  const int rank = g_rank.load();
  if (rank >= 0) {
    std::fprintf(stderr, "[decent_dp rank %d/%d] %s %s\n", rank, g_size.load(), level_letter(level),
                 message.c_str());
  } else {
    std::fprintf(stderr, "[decent_dp] %s %s\n", level_letter(level), message.c_str());
  }
  std::fflush(stderr);
}

}  // namespace decent_dp
