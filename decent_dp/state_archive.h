// What both gossip APIs and the all-reduce wrapper put into a checkpoint's archive
// (Note [checkpoint]) and read back: tensors by key (copied, so a view never drags its
// whole block along), counters, each bucket's optimizer, scheduler and pending exchange, and
// the caller's own named tensors.
#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <string>
#include <vector>

#include "decent_dp/bucket_set.h"
#include "decent_dp/checkpoint.h"
#include "decent_dp/exchange.h"
#include "decent_dp/model_sync.h"

namespace decent_dp {
namespace state_archive {

void write_int(torch::serialize::OutputArchive& ar, const std::string& key, int64_t v);
void write_double(torch::serialize::OutputArchive& ar, const std::string& key, double v);
void write_tensor(torch::serialize::OutputArchive& ar, const std::string& key, const at::Tensor& t);
// Throw CheckpointError naming `key` when it is missing or of another kind.
int64_t read_int(torch::serialize::InputArchive& ar, const std::string& key);
double read_double(torch::serialize::InputArchive& ar, const std::string& key);
at::Tensor read_tensor(torch::serialize::InputArchive& ar, const std::string& key);

// Copies the saved tensors `<prefix><i>` into `targets` (same shapes and dtypes, checked,
// naming `names[i]`).
void write_tensors(torch::serialize::OutputArchive& ar, const std::string& prefix,
                   const std::vector<at::Tensor>& tensors);
void read_tensors_into(torch::serialize::InputArchive& ar, const std::string& prefix,
                       const std::vector<at::Tensor>& targets,
                       const std::vector<std::string>& names);

// The manifest's view of the bucket plan.
std::vector<CheckpointBucket> describe(const BucketSet& buckets);
// Throws CheckpointError naming the first bucket where the saved plan and this one differ.
void check_plan(const std::vector<CheckpointBucket>& saved,
                const std::vector<CheckpointBucket>& here, const std::string& file);

// Each bucket's optimizer state (when it has one), scheduler step count and the exchange in
// flight (waited for: Exchange::pending). `scheduler_steps` is how many times the buckets'
// schedulers have stepped (the update count).
void write_buckets(torch::serialize::OutputArchive& ar, BucketSet& buckets, Exchange& exchange,
                   int64_t scheduler_steps);
void read_buckets(torch::serialize::InputArchive& ar, BucketSet& buckets, Exchange& exchange);

// The caller's own tensors (a data loader's position, generator states, ...).
void write_user_state(torch::serialize::OutputArchive& ar, const NamedTensors& user);
NamedTensors read_user_state(torch::serialize::InputArchive& ar);

}  // namespace state_archive
}  // namespace decent_dp
