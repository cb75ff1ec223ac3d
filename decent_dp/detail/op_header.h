// Note [operation header]
// Operations of one group pair up by their number on the group (the message tag), and
// nothing in MPI checks that the members agree on what that operation is: two members that
// run different collectives of equal size as their n-th operation (one member's global
// average against another's exchange, an all-reduce against an all-gather) would exchange
// bytes silently, and a size mismatch on Open MPI's single-copy path overruns the receive
// buffer. So every collective of the MPI backend starts with a header stage: each member
// sends every other member a fixed-size header (kind, reduce op, elements, dtype, root,
// a hash of the caller's label, a readable summary) and receives theirs, before any
// payload is posted. Every member compares all k headers and, on a difference, fails with
// the same error on every member, naming both ranks and what each of them runs. Shared-memory
// operations carry their segment descriptor in the same header, so they pay nothing extra;
// point-to-point operations pay one round of small messages (k - 1 each way) per operation.
#pragma once

#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace decent_dp {
namespace detail {

enum class OpKind : int32_t { kAllreduce = 1, kAllgather = 2, kBroadcast = 3 };

struct OpHeader {
  uint64_t magic = 0;
  int32_t kind = 0;
  int32_t reduce_op = -1;  // ReduceOp of an all-reduce, else -1
  int64_t numel = 0;       // this member's input elements
  int32_t dtype = 0;
  int32_t root = -1;  // a broadcast's root, else -1
  uint64_t label_hash = 0;
  char summary[160] = {};  // e.g. "allreduce(avg, 4096 x Float, bucket 0, exchange of update 3)"
  // Where this member's buffers lie, for shared-memory operations ("input|output" segment
  // names, or the input's alone); `shared` is 0 when they are private.
  char segment[128] = {};
  uint64_t input_offset = 0;
  uint64_t output_offset = 0;
  int32_t shared = 0;
  int32_t reserved = 0;
  // A varying all-gather's bytes of this member's input (numel is then the capacity every
  // member agrees on); -1 otherwise. Not compared.
  int64_t length = -1;
};

// The header of an operation; `summary` is truncated to fit.
OpHeader make_op_header(OpKind kind, int32_t reduce_op, int64_t numel, c10::ScalarType dtype,
                        int32_t root, const std::string& label, const std::string& summary);

// Posts the header exchange: `mine` to every other member, theirs into `all[m]` (`all`
// has one entry per member; `all[index]` is set to `mine`).
std::vector<MPI_Request> post_op_headers(const OpHeader& mine, std::vector<OpHeader>& all,
                                         MPI_Comm comm, int index, int size, int tag);

// Throws InvalidArgument when any member's header differs from this member's in what the
// operation is (all but the shared-memory fields): names this rank, the first member that
// differs, both summaries and the operation's number on the group.
void check_op_headers(const std::vector<OpHeader>& all, int index, const std::vector<int>& ranks,
                      int64_t sequence);

}  // namespace detail
}  // namespace decent_dp
