#include "decent_dp/model_sync.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

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

int64_t signature_of(const std::string& name, const at::Tensor& t) {
  uint64_t h = std::hash<std::string>{}(name);
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t s : t.sizes()) {
    mix(static_cast<uint64_t>(s));
  }
  mix(static_cast<uint64_t>(t.scalar_type()));
  mix(static_cast<uint64_t>(t.requires_grad()));
  return static_cast<int64_t>(h);
}

// A fixed-size description of one entry, to print another rank's values.
constexpr size_t kMaxDims = 8;
constexpr size_t kNameWords = 8;  // the first 64 characters of the name

std::vector<int64_t> describe(const std::string& name, const at::Tensor& t) {
  std::vector<int64_t> d(3 + kMaxDims + kNameWords, 0);
  d[0] = static_cast<int64_t>(t.scalar_type());
  d[1] = t.requires_grad() ? 1 : 0;
  d[2] = t.dim();
  for (size_t i = 0; i < std::min<size_t>(kMaxDims, t.dim()); ++i) {
    d[3 + i] = t.size(static_cast<int64_t>(i));
  }
  std::memcpy(&d[3 + kMaxDims], name.data(), std::min(name.size(), kNameWords * 8));
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
     << (d[1] ? " requires_grad" : " no grad");
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
  std::vector<int64_t> sig;
  for (const auto& [name, t] : items) {
    sig.push_back(signature_of(name, t));
  }
  const auto rows = allgather_rows(control, sig);
  for (size_t k = 0; k < items.size(); ++k) {
    for (int r = 1; r < control.size(); ++r) {
      if (rows[r][k] == rows[0][k]) {
        continue;
      }
      // Every rank found the same first mismatch: gather that entry's description.
      const auto described = allgather_rows(control, describe(items[k].first, items[k].second));
      throw InvalidArgument(detail::cat(
          "the model differs across ranks at entry ", k, ": rank 0 has ",
          describe_text(described[0]), ", rank ", r, " has ", describe_text(described[r]),
          " (names, shapes, dtypes and order of parameters and buffers must be identical)"));
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

void check_same_order(Communicator& control, const std::vector<size_t>& order,
                      const std::vector<at::Tensor>& params,
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
  std::vector<int64_t> mine;
  for (size_t i : order) {
    mine.push_back(static_cast<int64_t>(i));
    mine.push_back(params[i].numel());
  }
  const auto rows = allgather_rows(control, mine);
  for (int r = 1; r < control.size(); ++r) {
    for (size_t k = 0; k < mine.size(); ++k) {
      if (rows[r][k] != rows[0][k]) {
        const size_t pos = k / 2;
        throw Error(detail::cat(
            "gradients became ready in a different order on rank ", r, " than on rank 0: position ",
            pos, " is parameter #", rows[r][2 * pos], " ('", names[rows[r][2 * pos]], "') on rank ",
            r, " and #", rows[0][2 * pos], " ('", names[rows[0][2 * pos]], "') on rank 0"));
      }
    }
  }
}

}  // namespace decent_dp
