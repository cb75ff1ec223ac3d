// The narrow communication interface every backend implements (MPI for CPU tensors,
// NCCL for CUDA tensors). Every operation takes tensors plus a small argument list and
// returns a Work handle; blocking forms are wait() on that handle.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "decent_dp/work.h"

namespace decent_dp {

enum class ReduceOp { kSum, kAvg };
enum class Backend { kMpi, kNccl };

const char* to_string(ReduceOp op);
const char* to_string(Backend backend);

// Per-operation options (c10d style): new settings are new fields, not new signatures.
struct AllreduceOptions {
  ReduceOp op = ReduceOp::kSum;
  std::vector<int> ranks;                // the group, ascending; empty: every rank
  std::chrono::milliseconds timeout{0};  // of the returned Work; 0: the communicator's
  std::string label{};  // what it is for, e.g. "bucket 2, exchange of update 17": in messages
};

struct AllgatherOptions {
  std::vector<int> ranks;                // the group, ascending; empty: every rank
  std::chrono::milliseconds timeout{0};  // of the returned Work; 0: the communicator's
  std::string label{};                   // as AllreduceOptions::label
};

// Call-order contract (as c10d's): every member of a group issues that group's collectives
// in the same order, and a process issues its collectives from one thread at a time (two
// threads calling allreduce concurrently is safe for the communicator and still wrong for
// the program: the order would differ across ranks). Operations that a backend does not
// implement throw InvalidArgument naming the backend.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual Backend backend() const = 0;
  // This process's rank and the number of ranks.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank among, and number of, the ranks sharing this node.
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;

  // Collective over all ranks, which must pass the same list in the same order: creates
  // one sub-communicator for every rank list (ascending ranks) that contains this rank.
  // Lists already created are skipped. Throws InvalidArgument when the lists differ across
  // ranks or are malformed.
  virtual void make_groups(const std::vector<std::vector<int>>& groups) = 0;
  // True when allreduce() accepts `ranks` (created by make_groups, the whole world, or
  // this rank alone).
  virtual bool has_group(const std::vector<int>& ranks) const = 0;

  // Asynchronous all-reduce of `input` over the group `options.ranks` (ascending, must
  // contain this rank) into `output` (same dtype and number of elements; may be `input`).
  // kAvg divides the sum by the group size, in the tensor's dtype. `input` must not change
  // until the work is done.
  virtual std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                          const AllreduceOptions& options) = 0;
  // Shorthands: in place, and out of place on group `ranks`.
  std::shared_ptr<Work> allreduce(const at::Tensor& tensor, const std::vector<int>& ranks,
                                  ReduceOp op) {
    return allreduce(tensor, tensor, AllreduceOptions{op, ranks, {}, {}});
  }
  std::shared_ptr<Work> allreduce(const at::Tensor& input, const at::Tensor& output,
                                  const std::vector<int>& ranks, ReduceOp op) {
    return allreduce(input, output, AllreduceOptions{op, ranks, {}, {}});
  }
  // Asynchronous broadcast of `tensor` from world rank `root` to every rank.
  virtual std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int root) = 0;
  // Asynchronous all-gather over the group `options.ranks` (Note [group all-gather]):
  // `output` holds k * input.numel() elements of input's dtype for a group of k ranks, and
  // the input of the group's m-th rank (ascending order) lands at elements [m n, (m + 1) n).
  virtual std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input,
                                          const AllgatherOptions& options);
  // Over all ranks: rank r's input lands at elements [r * n, (r + 1) * n).
  std::shared_ptr<Work> allgather(const at::Tensor& output, const at::Tensor& input) {
    return allgather(output, input, AllgatherOptions{});
  }
  // Note [varying all-gather]
  // An all-gather whose members' inputs differ in length (compressed payloads): `output`
  // holds k blocks of capacity c = output.numel() / k, the same on every member; each
  // member's input has at most c elements. The lengths travel in the operation header
  // (Note [operation header]), so only each input's own bytes cross the wire. Member m's
  // input lands at elements [m c, m c + len_m) and len_m in lengths[m] (an int64 tensor of k
  // elements), both set once the Work completes.
  virtual std::shared_ptr<Work> allgather_varying(const at::Tensor& output, const at::Tensor& input,
                                                  const at::Tensor& lengths,
                                                  const AllgatherOptions& options);
  // Blocks until every rank has entered the barrier (honours the default timeout).
  virtual void barrier() = 0;

  // A zero-filled 1-D tensor of `numel` elements for buffers this communicator will
  // exchange often (the wrappers' parameter, gradient and communication blocks). The MPI
  // backend places CPU buffers in shared memory when ranks share a node, so group members
  // there read each other's buffers directly (Note [shared-memory transport]); other
  // backends return at::zeros. Any tensor works with every operation either way.
  virtual at::Tensor allocate(int64_t numel, const at::TensorOptions& options);

  // Default timeout of the Work handles this communicator returns.
  virtual std::chrono::milliseconds timeout() const = 0;

  // True when this communicator's operations take tensors on `device` (MPI: CPU).
  virtual bool supports(const c10::Device& device) const = 0;
};

// "[0,1,2]"
std::string ranks_to_string(const std::vector<int>& ranks);

namespace detail {

// make_groups' local validation, the same for every backend: each group non-empty, ranks in
// [0, world_size), ascending without repeats (InvalidArgument naming the group otherwise).
// Returns a hash of the whole list, which the backends compare across ranks.
uint64_t check_groups(const std::vector<std::vector<int>>& groups, int world_size);
// This machine's host name ("unknown host" when it cannot be read), for messages.
std::string host_name();

}  // namespace detail

}  // namespace decent_dp
