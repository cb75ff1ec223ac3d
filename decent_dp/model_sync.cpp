#include "decent_dp/model_sync.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

#include "decent_dp/backend.h"
#include "decent_dp/errors.h"

namespace decent_dp {
namespace {

// All-gathers `values` (same length on every rank) into one row per rank.
std::vector<std::vector<int64_t>> allgather_rows(Communicator& comm,
                                                 const std::vector<int64_t>& values) {
  const auto n = static_cast<int64_t>(values.size());
  auto in = at::empty({std::max<int64_t>(n, 1)}, at::kLong);
  std::copy(values.begin(), values.end(), in.data_ptr<int64_t>());
  auto out = at::empty({std::max<int64_t>(n, 1) * comm.size()}, at::kLong);
  comm.allgather(out, in, AllgatherOptions{{}, {}, "model check"})->wait();
  std::vector<std::vector<int64_t>> rows(comm.size());
  const int64_t stride = std::max<int64_t>(n, 1);
  for (int r = 0; r < comm.size(); ++r) {
    rows[r].assign(out.data_ptr<int64_t>() + r * stride, out.data_ptr<int64_t>() + r * stride + n);
  }
  return rows;
}

std::vector<int64_t> allgather_scalar(Communicator& comm, int64_t v) {
  std::vector<int64_t> out;
  for (const auto& row : allgather_rows(comm, {v})) {
    out.push_back(row[0]);
  }
  return out;
}

// `ordinal`: the entry's device among this rank's devices in order of first appearance
// (detail::distinct_devices). Ranks differ in device indices (cuda:<local rank>), not in
// types or in which entries share a device: each device's communicator and buckets pair up
// across ranks by that position.
int64_t signature_of(const std::string& name, const at::Tensor& t, size_t ordinal) {
  uint64_t h = std::hash<std::string>{}(name);
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t s : t.sizes()) {
    mix(static_cast<uint64_t>(s));
  }
  mix(static_cast<uint64_t>(t.scalar_type()));
  mix(static_cast<uint64_t>(t.requires_grad()));
  mix(static_cast<uint64_t>(t.device().type()));
  mix(static_cast<uint64_t>(ordinal));
  return static_cast<int64_t>(h);
}

// A fixed-size description of one entry, to print another rank's values.
constexpr size_t kMaxDims = 8;
constexpr size_t kNameWords = 8;  // the first 64 characters of the name

constexpr size_t kDeviceField = 3 + kMaxDims + kNameWords;  // device type, then ordinal

std::vector<int64_t> describe(const std::string& name, const at::Tensor& t, size_t ordinal) {
  std::vector<int64_t> d(kDeviceField + 2, 0);
  d[0] = static_cast<int64_t>(t.scalar_type());
  d[1] = t.requires_grad() ? 1 : 0;
  d[2] = t.dim();
  for (size_t i = 0; i < std::min<size_t>(kMaxDims, t.dim()); ++i) {
    d[3 + i] = t.size(static_cast<int64_t>(i));
  }
  std::memcpy(&d[3 + kMaxDims], name.data(), std::min(name.size(), kNameWords * 8));
  d[kDeviceField] = static_cast<int64_t>(t.device().type());
  d[kDeviceField + 1] = static_cast<int64_t>(ordinal);
  return d;
}

std::string describe_text(const std::vector<int64_t>& d) {
  char name[kNameWords * 8 + 1] = {};
  std::memcpy(name, &d[3 + kMaxDims], kNameWords * 8);
  std::ostringstream os;
  os << "'" << name << "' [";
  for (int64_t i = 0; i < std::min<int64_t>(d[2], kMaxDims); ++i) {
    os << (i ? ", " : "") << d[3 + i];
  }
  if (d[2] > static_cast<int64_t>(kMaxDims)) {
    os << ", ...";
  }
  os << "] " << c10::toString(static_cast<c10::ScalarType>(d[0]))
     << (d[1] ? " requires_grad" : " no grad") << " on "
     << c10::DeviceTypeName(static_cast<c10::DeviceType>(d[kDeviceField]), /*lower_case=*/true)
     << " (its device #" << d[kDeviceField + 1] << ")";
  return os.str();
}

}  // namespace

void check_same_model(Communicator& control, const NamedTensors& items) {
  const auto counts = allgather_scalar(control, static_cast<int64_t>(items.size()));
  for (int r = 0; r < control.size(); ++r) {
    if (counts[r] != counts[0]) {
      throw InvalidArgument(detail::cat("the model differs across ranks: rank 0 has ", counts[0],
                                        " parameters and buffers, rank ", r, " has ", counts[r]));
    }
  }
  std::vector<at::Tensor> tensors;
  for (const auto& item : items) {
    tensors.push_back(item.second);
  }
  const auto devices = detail::distinct_devices(tensors);
  auto ordinal_of = [&devices](const at::Tensor& t) {
    return static_cast<size_t>(
        std::find(devices.begin(), devices.end(), detail::route_device(t.device())) -
        devices.begin());
  };
  std::vector<int64_t> sig;
  for (const auto& [name, t] : items) {
    sig.push_back(signature_of(name, t, ordinal_of(t)));
  }
  const auto rows = allgather_rows(control, sig);
  for (size_t k = 0; k < items.size(); ++k) {
    for (int r = 1; r < control.size(); ++r) {
      if (rows[r][k] == rows[0][k]) {
        continue;
      }
      // Every rank found the same first mismatch: gather that entry's description.
      const auto described = allgather_rows(
          control, describe(items[k].first, items[k].second, ordinal_of(items[k].second)));
      throw InvalidArgument(detail::cat(
          "the model differs across ranks at entry ", k, ": rank 0 has ",
          describe_text(described[0]), ", rank ", r, " has ", describe_text(described[r]),
          " (names, shapes, dtypes, device types and order of parameters and buffers must be "
          "identical, and so must which of them share a device; device #k is a rank's k-th "
          "device in order of first use)"));
    }
  }
}

void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors) {
  if (comm.size() == 1) {
    return;
  }
  at::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (original, contiguous copy)
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& t : tensors) {
    at::Tensor c = t.detach().is_contiguous() ? t.detach() : t.detach().contiguous();
    staged.emplace_back(t, c);
    works.push_back(comm.broadcast(c, 0));
  }
  for (auto& w : works) {
    w->wait();
  }
  for (auto& [orig, c] : staged) {
    if (!c.is_same(orig) && c.data_ptr() != orig.data_ptr()) {
      orig.detach().copy_(c);
    }
  }
}

// Note [gradient order across ranks]
// Iteration 1's gradient-ready order decides the buckets, and every rank must build the
// same buckets. The order can differ across ranks without anything being wrong: a model on
// several devices gets its gradients from one autograd thread per device (the caller's for
// CPU tensors, a worker per GPU), whose interleaving varies from run to run; rank-dependent
// control flow reorders them too. So every rank takes rank 0's order, as torch DDP takes
// rank 0's bucket assignment; only a different set of parameters is an error. A rank whose
// gradients then arrive in another order overlaps less (a bucket waits for its predecessors,
// Note [gradient-ready bookkeeping]); its collectives still match its peers'.
std::vector<size_t> agree_first_order(Communicator& control, const std::vector<size_t>& order,
                                      const std::vector<std::string>& names) {
  const auto counts = allgather_scalar(control, static_cast<int64_t>(order.size()));
  for (int r = 0; r < control.size(); ++r) {
    if (counts[r] != counts[0]) {
      throw Error(
          detail::cat("ranks disagree on the parameters that received gradients in the "
                      "first iteration: rank 0 saw ",
                      counts[0], ", rank ", r, " saw ", counts[r],
                      "; the first iteration must use every parameter the same way on "
                      "every rank"));
    }
  }
  std::vector<int64_t> mine(order.begin(), order.end());
  const auto rows = allgather_rows(control, mine);
  auto sorted = [](std::vector<int64_t> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  const auto reference = sorted(rows[0]);
  for (int r = 1; r < control.size(); ++r) {
    const auto theirs = sorted(rows[r]);
    const auto [a, b] = std::mismatch(reference.begin(), reference.end(), theirs.begin());
    if (a != reference.end()) {
      // The smaller index is the one the other rank lacks.
      const bool rank0_only = *a < *b;
      const int64_t i = rank0_only ? *a : *b;
      throw Error(detail::cat(
          "ranks disagree on the parameters that received gradients in the first iteration: "
          "parameter #",
          i, " ('", i < static_cast<int64_t>(names.size()) ? names[i] : std::string("?"),
          "') received one on rank ", rank0_only ? 0 : r, " and not on rank ", rank0_only ? r : 0,
          "; the first iteration must use every parameter the same way on every rank"));
    }
  }
  std::vector<size_t> agreed;
  for (int64_t i : rows[0]) {
    DECENT_DP_CHECK_ARG(i >= 0 && i < static_cast<int64_t>(names.size()),
                        "agree_first_order: parameter index ", i, " out of range [0, ",
                        names.size(), ")");
    agreed.push_back(static_cast<size_t>(i));
  }
  return agreed;
}

}  // namespace decent_dp
