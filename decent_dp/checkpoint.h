// Note [checkpoint]
// A checkpoint is a folder written by every rank of a job together:
//
//   <dir>/rank-<r>.ckpt   one per rank: a header line, a JSON line (rank, world size, payload
//                         length, FNV-1a 64 checksum of the payload), then the payload, a
//                         LibTorch archive of that rank's state
//   <dir>/manifest.json   written by rank 0 last, once every rank's file is on disk: the job
//                         (wrapper, world size, ranks per node, topology, step and update
//                         counts), the bucket plan, and every rank file's length and checksum
//
// Every file is written atomically (a temporary file in the folder, fsync, rename, fsync of
// the folder), and the old manifest is removed before any rank file is replaced, so a save
// that dies half way leaves a folder without a manifest, which load refuses as incomplete;
// it never leaves a mix of two saves that loads. load checks, in order: the manifest
// exists and parses, its wrapper, world size, ranks per node and topology match this job,
// this rank's file exists, its header parses and names this rank, its length matches the
// header (truncated otherwise), its checksum matches the header and the manifest (torn or
// from another save otherwise); then the wrapper checks the bucket plan. Each refusal is a
// CheckpointError naming the file and the field. Both save and load are collective: when
// any rank fails, every rank raises (the failing rank its own reason, the others naming that
// rank), so no rank trains on while a peer stopped.
#pragma once

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <string>
#include <vector>

#include "decent_dp/communicator.h"

namespace decent_dp {

// One bucket in the manifest: its parameters' names (in the bucket's order), elements and
// dtype of its blocks.
struct CheckpointBucket {
  std::vector<std::string> params;
  int64_t numel = 0;
  std::string dtype;
  bool operator==(const CheckpointBucket& o) const {
    return params == o.params && numel == o.numel && dtype == o.dtype;
  }
};

// What the manifest records about the job.
struct CheckpointManifest {
  std::string wrapper;  // "DecentralizedDataParallel", ...
  int world_size = 0;
  int local_world_size = 0;
  std::string topology;
  int64_t period = 0;
  int64_t steps = 0;
  int64_t updates = 0;
  std::vector<CheckpointBucket> buckets;
};

namespace checkpoint {

constexpr int kFormatVersion = 1;

// Path of rank `rank`'s file and of the manifest in `dir`.
std::string rank_file(const std::string& dir, int rank);
std::string manifest_file(const std::string& dir);

// Collective over `control`: writes `archive` as this rank's file, then rank 0 writes the
// manifest for `manifest`. Creates `dir` (and its parents) when missing.
void save(Communicator& control, const std::string& dir, const CheckpointManifest& manifest,
          torch::serialize::OutputArchive& archive);

// Collective over `control`: checks the manifest against `expected` (wrapper, world size,
// ranks per node, topology) and this rank's file, then loads the archive. Returns the
// manifest as saved.
CheckpointManifest load(Communicator& control, const std::string& dir,
                        const CheckpointManifest& expected,
                        torch::serialize::InputArchive& archive);

// Collective over `control`: throws CheckpointError on every rank when `error` is non-empty
// on any rank — the rank's own `error`, or on the others "<what>: rank r failed: ...".
void agree(Communicator& control, const std::string& what, const std::string& error);

// FNV-1a 64 of `size` bytes (a changed byte always changes it).
uint64_t fnv1a64(const void* data, size_t size);

}  // namespace checkpoint
}  // namespace decent_dp
