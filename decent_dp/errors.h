// Exceptions and argument checks of the core layer. The hierarchy itself is in
// topology/errors.h so every layer throws the same types.
#pragma once

#include <sstream>
#include <string>

#include "topology/errors.h"

namespace decent_dp {
namespace detail {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace detail
}  // namespace decent_dp

// Throws InvalidArgument with the message built from the arguments when `cond` is false.
#define DECENT_DP_CHECK_ARG(cond, ...)                                           \
  do {                                                                           \
    if (!(cond)) {                                                               \
      throw ::decent_dp::InvalidArgument(::decent_dp::detail::cat(__VA_ARGS__)); \
    }                                                                            \
  } while (0)
