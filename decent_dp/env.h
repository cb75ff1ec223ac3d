// Every environment override of the library, declared in one place and read once.
//
//   DECENT_DP_LOG_LEVEL          trace | debug | info | warn | error | off   (default warn)
//   DECENT_DP_TIMEOUT_MS         default timeout of Work::wait() in ms        (default 600000)
//   DECENT_DP_SHUTDOWN_TIMEOUT_MS  how long a wrapper's or communicator's destructor lets
//                                exchanges in flight finish, all of them together
//                                (default min(30000, DECENT_DP_TIMEOUT_MS))
//   DECENT_DP_STALL_WARN_MS      a wait on one operation logs a warning naming it each
//                                time this long passes (default 60000; 0: never)
//   DECENT_DP_PROGRESS_INTERVAL_US  sleep between two polls of the MPI progress thread
//                                while nobody waits, in microseconds        (default 50)
//   DECENT_DP_SHM                1 | 0: ranks of one node exchange the wrappers' buffers
//                                through shared memory (default 1; the same on every rank)
//   DECENT_DP_NODE_AWARE         1 | 0: groups spread evenly over several nodes all-reduce
//                                inside each node first (Note [node-aware all-reduce];
//                                default 1; the same on every rank)
//   DECENT_DP_RING_LANES         1..8: an all-reduce over MPI messages of at least twice
//                                MpiOptions::ring_lane_min_bytes, over a group that spans
//                                several nodes, runs as up to this many
//                                independent rings over segments of its buffer (Note [ring
//                                lanes]; default 4; the same on every rank)
//
// Options structs take precedence only when their fields are set explicitly; the
// environment supplies the defaults.
#pragma once

#include <cstdint>
#include <string>

namespace decent_dp {
namespace env {

// The longest timeout anything accepts (about 31 years): deadlines stay representable.
constexpr int64_t kMaxTimeoutMs = 1000000000000;

std::string log_level();
int64_t timeout_ms();
int64_t shutdown_timeout_ms();
int64_t stall_warn_ms();
int64_t progress_interval_us();
bool shared_memory();
bool node_aware();
int ring_lanes();

}  // namespace env
}  // namespace decent_dp
