// Small helpers the benchmarks share: output files that fail loudly.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace decent_dp {
namespace bench {

// Empty when `path` can be written (it is created if missing, left as it is otherwise);
// else why not, naming `flag`. Checked before any measurement, so a bad path costs nothing.
inline std::string check_writable(const std::string& path, const char* flag) {
  if (path.empty()) {
    return {};
  }
  std::ofstream out(path, std::ios::app);
  if (!out) {
    return std::string(flag) + ": cannot write to '" + path + "' (" + std::strerror(errno) + ")";
  }
  return {};
}

// Writes `j` to `path`; false with a message on stderr when that fails.
inline bool write_json(const std::string& path, const nlohmann::json& j, const char* flag) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "error: %s: writing '%s' failed\n", flag, path.c_str());
    return false;
  }
  return true;
}

}  // namespace bench
}  // namespace decent_dp
