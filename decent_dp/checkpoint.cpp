#include "decent_dp/checkpoint.h"

#include <ATen/ops/zeros.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "decent_dp/errors.h"

namespace decent_dp {
namespace checkpoint {
namespace {

constexpr const char* kMagic = "decent_dp checkpoint\n";
constexpr const char* kManifestFormat = "decent_dp checkpoint";

std::string errno_text() {
  return std::strerror(errno);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string parent_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

// mkdir -p. POSIX calls throughout: the PyPI wheel's libtorch exports std::filesystem
// symbols of its own that crash when called from code built here.
void make_dirs(const std::string& dir) {
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty() || partial == "/") {
      continue;
    }
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      throw CheckpointError(
          detail::cat("checkpoint folder ", dir, ": cannot create ", partial, ": ", errno_text()));
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw CheckpointError(detail::cat("checkpoint folder ", dir, " is not a folder"));
  }
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) {
    throw CheckpointError(detail::cat("checkpoint folder ", dir, ": open: ", errno_text()));
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) {
    throw CheckpointError(detail::cat("checkpoint folder ", dir, ": fsync: ", errno_text()));
  }
}

// Temporary file next to `path`, written, fsynced and renamed over `path`.
void write_atomic(const std::string& path, const std::vector<const std::string*>& parts) {
  const std::string tmp = detail::cat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw CheckpointError(detail::cat("checkpoint file ", tmp, ": open: ", errno_text()));
  }
  auto fail = [&](const char* call) {
    const std::string why = errno_text();
    ::close(fd);
    ::unlink(tmp.c_str());
    throw CheckpointError(detail::cat("checkpoint file ", tmp, ": ", call, ": ", why));
  };
  for (const std::string* part : parts) {
    const char* p = part->data();
    size_t left = part->size();
    while (left > 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR) {
          continue;
        }
        fail("write");
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) {
    fail("fsync");
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw CheckpointError(detail::cat("checkpoint file ", tmp, ": close: ", errno_text()));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw CheckpointError(detail::cat("checkpoint file ", path, ": rename: ", why));
  }
  fsync_dir(parent_of(path));
}

// The whole file, or an error naming it.
std::string read_all(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw CheckpointError(detail::cat(what, " ", path, " cannot be read: ", errno_text()));
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      const std::string why = errno_text();
      ::close(fd);
      throw CheckpointError(detail::cat(what, " ", path, ": read: ", why));
    }
    if (n == 0) {
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// Runs `f`; returns its exception's message (empty when it succeeded).
template <typename F>
std::string capture(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

template <typename T>
T field(const nlohmann::json& j, const char* key, const std::string& file) {
  if (!j.is_object() || !j.contains(key)) {
    throw CheckpointError(detail::cat(file, ": field '", key, "' is missing"));
  }
  try {
    return j.at(key).get<T>();
  } catch (const std::exception& e) {
    throw CheckpointError(
        detail::cat(file, ": field '", key, "' has the wrong type (", e.what(), ")"));
  }
}

template <typename T>
void expect_equal(const std::string& file, const char* key, const T& saved, const T& here,
                  const char* meaning) {
  if (!(saved == here)) {
    throw CheckpointError(detail::cat(file, ": field '", key, "' is ", saved, ", ", meaning, " ",
                                      here, "; load a checkpoint saved by the same setup"));
  }
}

nlohmann::json manifest_json(const CheckpointManifest& m, const std::vector<int64_t>& bytes,
                             const std::vector<uint64_t>& sums) {
  nlohmann::json buckets = nlohmann::json::array();
  for (const auto& b : m.buckets) {
    buckets.push_back({{"params", b.params}, {"numel", b.numel}, {"dtype", b.dtype}});
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < bytes.size(); ++r) {
    ranks.push_back({{"file", detail::cat("rank-", r, ".ckpt")},
                     {"payload_bytes", bytes[r]},
                     {"fnv1a64", hex64(sums[r])}});
  }
  return {{"format", kManifestFormat},
          {"version", kFormatVersion},
          {"wrapper", m.wrapper},
          {"world_size", m.world_size},
          {"local_world_size", m.local_world_size},
          {"topology", m.topology},
          {"period", m.period},
          {"steps", m.steps},
          {"updates", m.updates},
          {"buckets", buckets},
          {"ranks", ranks}};
}

CheckpointManifest parse_manifest(const nlohmann::json& j, const std::string& file) {
  const auto format = field<std::string>(j, "format", file);
  if (format != kManifestFormat) {
    throw CheckpointError(
        detail::cat(file, ": field 'format' is '", format, "', expected '", kManifestFormat, "'"));
  }
  const int version = field<int>(j, "version", file);
  if (version != kFormatVersion) {
    throw CheckpointError(detail::cat(file, ": field 'version' is ", version,
                                      ", this library reads version ", kFormatVersion));
  }
  CheckpointManifest m;
  m.wrapper = field<std::string>(j, "wrapper", file);
  m.world_size = field<int>(j, "world_size", file);
  m.local_world_size = field<int>(j, "local_world_size", file);
  m.topology = field<std::string>(j, "topology", file);
  m.period = field<int64_t>(j, "period", file);
  m.steps = field<int64_t>(j, "steps", file);
  m.updates = field<int64_t>(j, "updates", file);
  for (const auto& b : field<nlohmann::json>(j, "buckets", file)) {
    CheckpointBucket cb;
    cb.params = field<std::vector<std::string>>(b, "params", file);
    cb.numel = field<int64_t>(b, "numel", file);
    cb.dtype = field<std::string>(b, "dtype", file);
    m.buckets.push_back(std::move(cb));
  }
  return m;
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string rank_file(const std::string& dir, int rank) {
  return detail::cat(dir, "/rank-", rank, ".ckpt");
}

std::string manifest_file(const std::string& dir) {
  return dir + "/manifest.json";
}

void agree(Communicator& control, const std::string& what, const std::string& error) {
  const int n = control.size();
  at::Tensor flags = at::zeros({n}, at::kInt);
  if (!error.empty()) {
    flags.data_ptr<int32_t>()[control.rank()] = 1;
  }
  if (n > 1) {
    control
        .allreduce(flags, flags, AllreduceOptions{ReduceOp::kSum, {}, {}, "checkpoint agreement"})
        ->wait();
  }
  if (!error.empty()) {
    throw CheckpointError(error);
  }
  const int32_t* f = flags.data_ptr<int32_t>();
  for (int r = 0; r < n; ++r) {
    if (f[r] != 0) {
      throw CheckpointError(
          detail::cat(what, ": rank ", r, " failed (its own error says why); no rank goes on"));
    }
  }
}

void save(Communicator& control, const std::string& dir, const CheckpointManifest& manifest,
          torch::serialize::OutputArchive& archive) {
  const int rank = control.rank();
  const int n = control.size();
  const std::string what = detail::cat("checkpoint save to ", dir);
  // 1. The folder exists everywhere and no manifest describes the files about to change.
  agree(control, what, capture([&] {
          DECENT_DP_CHECK_ARG(!dir.empty(), "save: path must name a folder, got an empty string");
          make_dirs(dir);
          if (rank == 0) {
            if (::unlink(manifest_file(dir).c_str()) != 0 && errno != ENOENT) {
              throw CheckpointError(
                  detail::cat("checkpoint file ", manifest_file(dir), ": unlink: ", errno_text()));
            }
            fsync_dir(dir);
          }
        }));
  // 2. Every rank's file.
  int64_t bytes = 0;
  uint64_t sum = 0;
  agree(control, what, capture([&] {
          std::ostringstream os;
          archive.save_to(os);
          const std::string payload = os.str();
          bytes = static_cast<int64_t>(payload.size());
          sum = fnv1a64(payload.data(), payload.size());
          const std::string header = std::string(kMagic) +
                                     nlohmann::json{{"version", kFormatVersion},
                                                    {"rank", rank},
                                                    {"world_size", n},
                                                    {"payload_bytes", bytes},
                                                    {"fnv1a64", hex64(sum)}}
                                         .dump() +
                                     "\n";
          write_atomic(rank_file(dir, rank), {&header, &payload});
        }));
  // 3. Rank 0 writes the manifest with every file's length and checksum.
  at::Tensor table = at::zeros({2 * n}, at::kLong);
  table.data_ptr<int64_t>()[2 * rank] = bytes;
  int64_t sum_bits = 0;
  std::memcpy(&sum_bits, &sum, sizeof sum);
  table.data_ptr<int64_t>()[2 * rank + 1] = sum_bits;
  if (n > 1) {
    control.allreduce(table, table, AllreduceOptions{ReduceOp::kSum, {}, {}, "checkpoint files"})
        ->wait();
  }
  agree(control, what, capture([&] {
          if (rank != 0) {
            return;
          }
          std::vector<int64_t> all_bytes(n);
          std::vector<uint64_t> all_sums(n);
          for (int r = 0; r < n; ++r) {
            all_bytes[r] = table.data_ptr<int64_t>()[2 * r];
            std::memcpy(&all_sums[r], table.data_ptr<int64_t>() + 2 * r + 1, sizeof(uint64_t));
          }
          const std::string text = manifest_json(manifest, all_bytes, all_sums).dump(1) + "\n";
          write_atomic(manifest_file(dir), {&text});
        }));
}

CheckpointManifest load(Communicator& control, const std::string& dir,
                        const CheckpointManifest& expected,
                        torch::serialize::InputArchive& archive) {
  const int rank = control.rank();
  const int n = control.size();
  const std::string what = detail::cat("checkpoint load from ", dir);
  CheckpointManifest saved;
  std::string payload_file;
  size_t payload_offset = 0;
  std::string contents;
  agree(
      control, what, capture([&] {
        DECENT_DP_CHECK_ARG(!dir.empty(), "load: path must name a folder, got an empty string");
        const std::string mfile = manifest_file(dir);
        if (::access(mfile.c_str(), F_OK) != 0) {
          throw CheckpointError(detail::cat(
              "checkpoint ", dir, " is incomplete or missing: ", mfile,
              " does not exist (the manifest is written last: was the save interrupted?)"));
        }
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(read_all(mfile, "checkpoint manifest"));
        } catch (const nlohmann::json::exception& e) {
          throw CheckpointError(detail::cat(mfile, ": not valid JSON (", e.what(), ")"));
        }
        saved = parse_manifest(j, mfile);
        expect_equal(mfile, "wrapper", saved.wrapper, expected.wrapper, "this wrapper is a");
        expect_equal(mfile, "world_size", saved.world_size, expected.world_size,
                     "this job's world size is");
        expect_equal(mfile, "topology", saved.topology, expected.topology,
                     "this wrapper's topology is");
        expect_equal(mfile, "local_world_size", saved.local_world_size, expected.local_world_size,
                     "this job's ranks per node are");
        const auto ranks = field<nlohmann::json>(j, "ranks", mfile);
        if (!ranks.is_array() || static_cast<int>(ranks.size()) != n) {
          throw CheckpointError(detail::cat(mfile, ": field 'ranks' must list ", n, " rank files"));
        }
        const int64_t listed_bytes = field<int64_t>(ranks[rank], "payload_bytes", mfile);
        const std::string listed_sum = field<std::string>(ranks[rank], "fnv1a64", mfile);

        // This rank's file.
        payload_file = rank_file(dir, rank);
        contents = read_all(payload_file, "checkpoint file");
        const size_t magic = std::strlen(kMagic);
        const size_t eol = contents.find('\n', magic);
        if (contents.compare(0, magic, kMagic) != 0 || eol == std::string::npos) {
          throw CheckpointError(
              detail::cat(payload_file, ": header: not a decent_dp checkpoint file"));
        }
        nlohmann::json h;
        try {
          h = nlohmann::json::parse(contents.substr(magic, eol - magic));
        } catch (const nlohmann::json::exception& e) {
          throw CheckpointError(
              detail::cat(payload_file, ": header: not valid JSON (", e.what(), ")"));
        }
        expect_equal(payload_file, "rank", field<int>(h, "rank", payload_file), rank,
                     "this process is rank");
        expect_equal(payload_file, "world_size", field<int>(h, "world_size", payload_file), n,
                     "this job's world size is");
        const auto want = field<int64_t>(h, "payload_bytes", payload_file);
        payload_offset = eol + 1;
        const auto have = static_cast<int64_t>(contents.size() - payload_offset);
        if (have < want) {
          throw CheckpointError(detail::cat(payload_file, ": truncated: field 'payload_bytes' is ",
                                            want, ", the file holds ", have, " bytes of payload"));
        }
        if (have > want) {
          throw CheckpointError(detail::cat(payload_file, ": field 'payload_bytes' is ", want,
                                            ", the file holds ", have,
                                            " bytes of payload (trailing bytes)"));
        }
        const std::string sum =
            hex64(fnv1a64(contents.data() + payload_offset, static_cast<size_t>(have)));
        const auto header_sum = field<std::string>(h, "fnv1a64", payload_file);
        if (sum != header_sum) {
          throw CheckpointError(detail::cat(payload_file, ": field 'fnv1a64' is ", header_sum,
                                            ", the payload's checksum is ", sum,
                                            " (the file is corrupt)"));
        }
        if (sum != listed_sum || want != listed_bytes) {
          throw CheckpointError(detail::cat(
              payload_file, ": field 'fnv1a64' is ", sum, ", the manifest ", mfile, " lists ",
              listed_sum, " for rank ", rank, " (the file belongs to a different save)"));
        }
      }));
  agree(control, what, capture([&] {
          try {
            archive.load_from(contents.data() + payload_offset, contents.size() - payload_offset);
          } catch (const std::exception& e) {
            throw CheckpointError(
                detail::cat(payload_file, ": payload: not a LibTorch archive (", e.what(), ")"));
          }
        }));
  return saved;
}

}  // namespace checkpoint
}  // namespace decent_dp
