// Rank-aware, levelled logging: "[decent_dp rank r/n] W message". Off above WARN by
// default (DECENT_DP_LOG_LEVEL), trace output compiles away unless DECENT_DP_ENABLE_TRACE.
#pragma once

#include <string>

namespace decent_dp {

enum class LogLevel { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 5 };

// Current threshold; messages below it are dropped.
LogLevel log_level();
void set_log_level(LogLevel level);
// Parses "trace", "debug", "info", "warn", "error", "off"; throws InvalidArgument otherwise.
LogLevel parse_log_level(const std::string& text);
// The rank prefix of every line; set by the communicator once it knows its rank.
void set_log_rank(int rank, int world_size);
inline bool log_enabled(LogLevel level) {
  return level >= log_level();
}
void log_message(LogLevel level, const std::string& message);

}  // namespace decent_dp

#define DECENT_DP_LOG(level, message)             \
  do {                                            \
    if (::decent_dp::log_enabled(level)) {        \
      ::decent_dp::log_message(level, (message)); \
    }                                             \
  } while (0)
#define DECENT_DP_LOG_DEBUG(message) DECENT_DP_LOG(::decent_dp::LogLevel::kDebug, message)
#define DECENT_DP_LOG_INFO(message) DECENT_DP_LOG(::decent_dp::LogLevel::kInfo, message)
#define DECENT_DP_LOG_WARN(message) DECENT_DP_LOG(::decent_dp::LogLevel::kWarn, message)
#define DECENT_DP_LOG_ERROR(message) DECENT_DP_LOG(::decent_dp::LogLevel::kError, message)
#ifdef DECENT_DP_ENABLE_TRACE
#define DECENT_DP_LOG_TRACE(message) DECENT_DP_LOG(::decent_dp::LogLevel::kTrace, message)
#else
#define DECENT_DP_LOG_TRACE(message) \
  do {                               \
  } while (0)
#endif
