// The one exception hierarchy of decent_dp, and the argument check every layer uses. It
// lives in the lowest layer (header-only, no dependencies) so that topology/, decent_dp/ and
// optim/ all throw the same types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace decent_dp {

// Base of every exception the library throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Bad input from the caller: the message names the argument and the expected value.
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(what) {}
};

// A topology that cannot be built for the requested world size, or a slot list that
// is not a partition with sane weights.
class TopologyError : public InvalidArgument {
 public:
  explicit TopologyError(const std::string& what) : InvalidArgument(what) {}
};

// A failure reported by the communication backend (MPI, NCCL).
class CommError : public Error {
 public:
  explicit CommError(const std::string& what) : Error(what) {}
};

// A collective that did not complete within its timeout.
class TimeoutError : public CommError {
 public:
  explicit TimeoutError(const std::string& what) : CommError(what) {}
};

// A checkpoint that cannot be written, or that a load refuses (missing, torn, truncated,
// or saved by a different job or model): the message names the file and the field.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what) : Error(what) {}
};

namespace detail {

// Concatenates the arguments with operator<<.
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
