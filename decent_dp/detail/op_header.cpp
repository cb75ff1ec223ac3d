#include "decent_dp/detail/op_header.h"

#include <algorithm>
#include <cstring>

#include "decent_dp/communicator.h"
#include "decent_dp/detail/allgather.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace detail {
namespace {

constexpr uint64_t kOpHeaderMagic = 0x6463647030686472ULL;  // "dcdp0hdr"

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool same_operation(const OpHeader& a, const OpHeader& b) {
  return a.magic == b.magic && a.kind == b.kind && a.reduce_op == b.reduce_op &&
         a.numel == b.numel && a.dtype == b.dtype && a.root == b.root &&
         a.label_hash == b.label_hash;
}

std::string summary_of(const OpHeader& h) {
  if (h.magic != kOpHeaderMagic) {
    return "a message that is not a decent_dp operation header";
  }
  return std::string(h.summary, strnlen(h.summary, sizeof(h.summary)));
}

}  // namespace

OpHeader make_op_header(OpKind kind, int32_t reduce_op, int64_t numel, c10::ScalarType dtype,
                        int32_t root, const std::string& label, const std::string& summary) {
  OpHeader h;
  h.magic = kOpHeaderMagic;
  h.kind = static_cast<int32_t>(kind);
  h.reduce_op = reduce_op;
  h.numel = numel;
  h.dtype = static_cast<int32_t>(dtype);
  h.root = root;
  h.label_hash = fnv1a(label);
  const size_t n = std::min(summary.size(), sizeof(h.summary) - 1);
  std::memcpy(h.summary, summary.data(), n);
  if (n < summary.size() && n >= 3) {
    std::memcpy(h.summary + n - 3, "...", 3);
  }
  return h;
}

std::vector<MPI_Request> post_op_headers(const OpHeader& mine, std::vector<OpHeader>& all,
                                         MPI_Comm comm, int index, int size, int tag) {
  all.resize(static_cast<size_t>(size));
  all[static_cast<size_t>(index)] = mine;
  return post_member_exchange(&all[static_cast<size_t>(index)], all.data(), sizeof(OpHeader),
                              sizeof(OpHeader), comm, index, size, tag);
}

void check_op_headers(const std::vector<OpHeader>& all, int index, const std::vector<int>& ranks,
                      int64_t sequence) {
  const OpHeader& mine = all[static_cast<size_t>(index)];
  for (size_t m = 0; m < all.size(); ++m) {
    if (static_cast<int>(m) == index || same_operation(all[m], mine)) {
      continue;
    }
    const std::string group = ranks_to_string(ranks);
    std::string label_note;
    if (all[m].magic == mine.magic && all[m].label_hash != mine.label_hash &&
        summary_of(all[m]) == summary_of(mine)) {
      label_note = " (the labels differ beyond what the summaries show)";
    }
    throw InvalidArgument(
        cat("mismatched operations on group ", group, ", operation ", sequence, " there: rank ",
            ranks[static_cast<size_t>(index)], " (this rank) runs ", summary_of(mine), ", rank ",
            ranks[m], " runs ", summary_of(all[m]), label_note,
            "; every member must start the same collectives (kind, size, dtype, root and "
            "label) in the same order"));
  }
}

}  // namespace detail
}  // namespace decent_dp
