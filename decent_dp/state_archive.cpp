#include "decent_dp/state_archive.h"

#include <torch/csrc/autograd/grad_mode.h>

#include "decent_dp/errors.h"
#include "decent_dp/optim/schedulers.h"

namespace decent_dp {
namespace state_archive {
namespace {

c10::IValue read_value(torch::serialize::InputArchive& ar, const std::string& key) {
  c10::IValue v;
  if (!ar.try_read(key, v)) {
    throw CheckpointError(detail::cat("checkpoint payload: field '", key, "' is missing"));
  }
  return v;
}

std::string bucket_key(size_t b, const char* what) {
  return detail::cat("bucket_", b, "_", what);
}

}  // namespace

void write_int(torch::serialize::OutputArchive& ar, const std::string& key, int64_t v) {
  ar.write(key, c10::IValue(v));
}

void write_double(torch::serialize::OutputArchive& ar, const std::string& key, double v) {
  ar.write(key, c10::IValue(v));
}

void write_tensor(torch::serialize::OutputArchive& ar, const std::string& key,
                  const at::Tensor& t) {
  at::NoGradGuard no_grad;
  ar.write(key, t.detach().clone(), /*is_buffer=*/true);
}

int64_t read_int(torch::serialize::InputArchive& ar, const std::string& key) {
  const c10::IValue v = read_value(ar, key);
  if (!v.isInt()) {
    throw CheckpointError(
        detail::cat("checkpoint payload: field '", key, "' is not an integer (", v.tagKind(), ")"));
  }
  return v.toInt();
}

double read_double(torch::serialize::InputArchive& ar, const std::string& key) {
  const c10::IValue v = read_value(ar, key);
  if (!v.isDouble()) {
    throw CheckpointError(
        detail::cat("checkpoint payload: field '", key, "' is not a number (", v.tagKind(), ")"));
  }
  return v.toDouble();
}

at::Tensor read_tensor(torch::serialize::InputArchive& ar, const std::string& key) {
  at::Tensor t;
  if (!ar.try_read(key, t, /*is_buffer=*/true)) {
    throw CheckpointError(detail::cat("checkpoint payload: tensor '", key, "' is missing"));
  }
  return t;
}

void write_tensors(torch::serialize::OutputArchive& ar, const std::string& prefix,
                   const std::vector<at::Tensor>& tensors) {
  write_int(ar, prefix + "count", static_cast<int64_t>(tensors.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    write_tensor(ar, detail::cat(prefix, i), tensors[i]);
  }
}

void read_tensors_into(torch::serialize::InputArchive& ar, const std::string& prefix,
                       const std::vector<at::Tensor>& targets,
                       const std::vector<std::string>& names) {
  const int64_t count = read_int(ar, prefix + "count");
  if (count != static_cast<int64_t>(targets.size())) {
    throw CheckpointError(detail::cat("checkpoint payload: field '", prefix, "count' is ", count,
                                      ", this model has ", targets.size()));
  }
  std::vector<at::Tensor> read(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    read[i] = read_tensor(ar, detail::cat(prefix, i));
    if (read[i].sizes() != targets[i].sizes() ||
        read[i].scalar_type() != targets[i].scalar_type()) {
      throw CheckpointError(detail::cat("checkpoint payload: '", names[i], "' was saved as ",
                                        read[i].sizes(), " ", read[i].scalar_type(), ", it is ",
                                        targets[i].sizes(), " ", targets[i].scalar_type(),
                                        " here"));
    }
  }
  at::NoGradGuard no_grad;  // every check passed: now copy
  for (size_t i = 0; i < targets.size(); ++i) {
    targets[i].detach().copy_(read[i]);
  }
}

std::vector<CheckpointBucket> describe(const BucketSet& buckets) {
  std::vector<CheckpointBucket> out;
  for (size_t b = 0; b < buckets.size(); ++b) {
    CheckpointBucket cb;
    cb.params = buckets[b].names;
    cb.numel = buckets[b].spec.numel;
    cb.dtype = c10::toString(buckets[b].spec.dtype);
    out.push_back(std::move(cb));
  }
  return out;
}

void check_plan(const std::vector<CheckpointBucket>& saved,
                const std::vector<CheckpointBucket>& here, const std::string& file) {
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) {
      s += (s.empty() ? "" : " ") + x;
    }
    return s;
  };
  if (saved.size() != here.size()) {
    throw CheckpointError(detail::cat(file, ": field 'buckets' lists ", saved.size(),
                                      " buckets, this wrapper has ", here.size(),
                                      " (a different model, bucket_cap_mb or layout key?)"));
  }
  for (size_t b = 0; b < saved.size(); ++b) {
    if (!(saved[b] == here[b])) {
      throw CheckpointError(detail::cat(file, ": field 'buckets' differs at bucket ", b,
                                        ": saved [", list(saved[b].params), "] ", saved[b].numel,
                                        " x ", saved[b].dtype, ", here [", list(here[b].params),
                                        "] ", here[b].numel, " x ", here[b].dtype,
                                        " (a different model, bucket_cap_mb or layout key?)"));
    }
  }
}

void write_buckets(torch::serialize::OutputArchive& ar, BucketSet& buckets, Exchange& exchange,
                   int64_t scheduler_steps) {
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket& bucket = buckets[b];
    if (bucket.optimizer) {
      torch::serialize::OutputArchive opt;
      bucket.optimizer->save(opt);
      ar.write(bucket_key(b, "optimizer"), opt);
    }
    int64_t steps = scheduler_steps;
    if (const auto* s = dynamic_cast<const optim::ClosedFormScheduler*>(bucket.scheduler.get())) {
      steps = s->steps();
    }
    write_int(ar, bucket_key(b, "scheduler_steps"), steps);
    const std::vector<at::Tensor> pending = exchange.pending(bucket);
    write_int(ar, bucket_key(b, "exchange_update"), pending.empty() ? -1 : bucket.exchange_update);
    write_tensors(ar, bucket_key(b, "pending_"), pending);
  }
  // The codec's state between updates (Note [error compensation]), written after every
  // pending() so it is the state those exchanges left.
  const Codec* codec = exchange.codec();
  const NamedTensors state = codec != nullptr ? codec->state() : NamedTensors{};
  write_int(ar, "codec_state_count", static_cast<int64_t>(state.size()));
  for (size_t i = 0; i < state.size(); ++i) {
    ar.write(detail::cat("codec_state_", i, "_name"), c10::IValue(state[i].first));
    write_tensor(ar, detail::cat("codec_state_", i), state[i].second);
  }
}

void read_buckets(torch::serialize::InputArchive& ar, BucketSet& buckets, Exchange& exchange) {
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket& bucket = buckets[b];
    if (bucket.optimizer) {
      torch::serialize::InputArchive opt;
      if (!ar.try_read(bucket_key(b, "optimizer"), opt)) {
        throw CheckpointError(
            detail::cat("checkpoint payload: field '", bucket_key(b, "optimizer"), "' is missing"));
      }
      // The scheduler first (it sets the groups' learning rates), then the optimizer's own
      // state, whose saved options win.
      const int64_t steps = read_int(ar, bucket_key(b, "scheduler_steps"));
      if (auto* s = dynamic_cast<optim::ClosedFormScheduler*>(bucket.scheduler.get())) {
        s->set_steps(steps);
      } else if (bucket.scheduler) {
        for (int64_t t = 0; t < steps; ++t) {
          bucket.scheduler->step();  // a LibTorch scheduler is a function of its step count
        }
      }
      bucket.optimizer->load(opt);
    }
    const int64_t update = read_int(ar, bucket_key(b, "exchange_update"));
    const std::string prefix = bucket_key(b, "pending_");
    const int64_t count = read_int(ar, prefix + "count");
    std::vector<at::Tensor> saved;
    for (int64_t j = 0; j < count; ++j) {
      saved.push_back(read_tensor(ar, detail::cat(prefix, j)));
    }
    bucket.work.reset();
    if (update >= 0) {
      exchange.restore_pending(bucket, update, saved);
    }
  }
  // Checkpoints written before codecs kept state have no such field: no state.
  c10::IValue probe;
  const int64_t count =
      ar.try_read("codec_state_count", probe) ? read_int(ar, "codec_state_count") : 0;
  NamedTensors state;
  for (int64_t i = 0; i < count; ++i) {
    const c10::IValue name = read_value(ar, detail::cat("codec_state_", i, "_name"));
    if (!name.isString()) {
      throw CheckpointError(
          detail::cat("checkpoint payload: field 'codec_state_", i, "_name' is not a string"));
    }
    state.emplace_back(name.toStringRef(), read_tensor(ar, detail::cat("codec_state_", i)));
  }
  Codec* codec = exchange.codec();
  if (codec == nullptr) {
    if (!state.empty()) {
      throw CheckpointError(detail::cat("checkpoint payload: holds ", state.size(),
                                        " codec state tensor(s) (an error-compensated codec), "
                                        "this wrapper has no codec"));
    }
    return;
  }
  try {
    codec->load_state(state);
  } catch (const InvalidArgument& e) {
    throw CheckpointError(detail::cat("checkpoint payload: codec state: ", e.what()));
  }
}

void write_user_state(torch::serialize::OutputArchive& ar, const NamedTensors& user) {
  write_int(ar, "user_count", static_cast<int64_t>(user.size()));
  for (size_t i = 0; i < user.size(); ++i) {
    DECENT_DP_CHECK_ARG(user[i].second.defined(), "save: user_state entry '", user[i].first,
                        "' is an undefined tensor");
    ar.write(detail::cat("user_name_", i), c10::IValue(user[i].first));
    write_tensor(ar, detail::cat("user_", i), user[i].second);
  }
}

NamedTensors read_user_state(torch::serialize::InputArchive& ar) {
  NamedTensors out;
  const int64_t count = read_int(ar, "user_count");
  for (int64_t i = 0; i < count; ++i) {
    const c10::IValue name = read_value(ar, detail::cat("user_name_", i));
    if (!name.isString()) {
      throw CheckpointError(
          detail::cat("checkpoint payload: field 'user_name_", i, "' is not a string"));
    }
    out.emplace_back(name.toStringRef(), read_tensor(ar, detail::cat("user_", i)));
  }
  return out;
}

}  // namespace state_archive
}  // namespace decent_dp
