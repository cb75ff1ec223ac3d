#include "examples/common/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randperm.h>
#include <zlib.h>

#include <sys/stat.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace decent_dp {
namespace examples {
namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string join(const std::string& dir, const std::string& file) {
  if (dir.empty())
    return file;
  return dir.back() == '/' ? dir + file : dir + "/" + file;
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// A file read through zlib, which reads uncompressed files as they are.
class ZFile {
 public:
  explicit ZFile(const std::string& path) : path_(path) {
    if (!exists(path))
      throw DataError(path + ": no such file");
    f_ = gzopen(path.c_str(), "rb");
    if (f_ == nullptr)
      throw DataError(path + ": cannot open (" + std::strerror(errno) + ")");
  }
  ~ZFile() { gzclose(f_); }
  ZFile(const ZFile&) = delete;
  ZFile& operator=(const ZFile&) = delete;

  void read(void* out, size_t bytes, const std::string& what) {
    char* p = static_cast<char*>(out);
    size_t done = 0;
    while (done < bytes) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes - done, 1u << 30));
      const int got = gzread(f_, p + done, chunk);
      if (got < 0) {
        int code = 0;
        throw DataError(path_ + ": corrupt file while reading " + what + " (" + gzerror(f_, &code) +
                        ")");
      }
      if (got == 0)
        throw DataError(path_ + ": truncated: expected " + std::to_string(bytes) + " bytes of " +
                        what + ", the file ends after " + std::to_string(done));
      done += static_cast<size_t>(got);
    }
  }
  uint32_t read_be32(const std::string& what) {
    unsigned char b[4];
    read(b, 4, what);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
  }
  void expect_magic(uint32_t expected, const std::string& what) {
    const uint32_t magic = read_be32("the magic number");
    if (magic != expected)
      throw DataError(path_ + ": wrong magic number " + hex(magic) + ", expected " + hex(expected) +
                      " (" + what + ")");
  }

 private:
  std::string path_;
  gzFile f_ = nullptr;
};

void check_labels(const at::Tensor& labels, int64_t num_classes, const std::string& path) {
  if (labels.numel() == 0)
    return;
  const int64_t hi = labels.max().item<int64_t>();
  if (hi >= num_classes)
    throw DataError(path + ": label " + std::to_string(hi) +
                    " out of range, expected labels in [0, " + std::to_string(num_classes - 1) +
                    "]");
}

// CIFAR binary records: `label_bytes` bytes (the label used is the last), then 3 x 32 x 32.
void read_cifar_file(const std::string& path, int label_bytes, int64_t num_classes,
                     std::vector<at::Tensor>& images, std::vector<at::Tensor>& labels) {
  if (!exists(path))
    throw DataError(path + ": no such file");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in)
    throw DataError(path + ": cannot open");
  const int64_t bytes = static_cast<int64_t>(in.tellg());
  const int64_t record = label_bytes + 3 * 32 * 32;
  if (bytes == 0 || bytes % record != 0)
    throw DataError(path + ": truncated or not a CIFAR binary file: " + std::to_string(bytes) +
                    " bytes is not a positive multiple of the " + std::to_string(record) +
                    "-byte record");
  const int64_t n = bytes / record;
  auto raw = at::empty({n, record}, at::kByte);
  in.seekg(0);
  in.read(static_cast<char*>(raw.data_ptr()), bytes);
  if (!in)
    throw DataError(path + ": read error");
  auto lab = raw.select(1, label_bytes - 1).to(at::kLong);
  if (label_bytes == 2) {
    const int64_t coarse = raw.select(1, 0).max().item<int64_t>();
    if (coarse >= 20)
      throw DataError(path + ": coarse label " + std::to_string(coarse) +
                      " out of range, expected [0, 19] (is this a CIFAR-100 file?)");
  }
  check_labels(lab, num_classes, path);
  labels.push_back(lab);
  images.push_back(raw.narrow(1, label_bytes, 3 * 32 * 32).reshape({n, 3, 32, 32}).clone());
}

Dataset read_cifar(const std::string& dir, bool train, bool hundred) {
  const std::string sub = hundred ? "cifar-100-binary" : "cifar-10-batches-bin";
  const std::string first = hundred ? "train.bin" : "data_batch_1.bin";
  std::string root = dir;
  if (!exists(join(root, first)) && is_dir(join(root, sub)))
    root = join(root, sub);
  std::vector<std::string> files;
  if (hundred) {
    files.push_back(join(root, train ? "train.bin" : "test.bin"));
  } else if (train) {
    for (int i = 1; i <= 5; ++i)
      files.push_back(join(root, "data_batch_" + std::to_string(i) + ".bin"));
  } else {
    files.push_back(join(root, "test_batch.bin"));
  }
  std::vector<at::Tensor> images, labels;
  for (const auto& f : files) {
    if (!exists(f))
      throw DataError(
          f + ": no such file (the " + std::string(hundred ? "CIFAR-100" : "CIFAR-10") +
          " binary version is expected in " +
          (dir.empty() ? std::string("the folder given, or the current one when none is") : dir) +
          ", or in its " + sub + "/)");
    read_cifar_file(f, hundred ? 2 : 1, hundred ? 100 : 10, images, labels);
  }
  Dataset d;
  d.name = hundred ? "cifar100" : "cifar10";
  d.images = images.size() == 1 ? images[0] : at::cat(images);
  d.labels = labels.size() == 1 ? labels[0] : at::cat(labels);
  d.num_classes = hundred ? 100 : 10;
  return d;
}

}  // namespace

const std::vector<std::string>& dataset_names() {
  static const std::vector<std::string> names = {"fashion-mnist", "cifar10", "cifar100",
                                                 "synthetic"};
  return names;
}

std::string default_data_dir(const std::string& name) {
  if (name == "fashion-mnist")
    return "/usr/share/datasets/fashion-mnist";
  return "";
}

Dataset read_idx(const std::string& images_path, const std::string& labels_path,
                 int64_t num_classes, const std::string& name) {
  ZFile img(images_path);
  img.expect_magic(0x803, "IDX file of unsigned bytes in 3 dimensions");
  const int64_t n = img.read_be32("the image count");
  const int64_t rows = img.read_be32("the row count");
  const int64_t cols = img.read_be32("the column count");
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096)
    throw DataError(images_path + ": image size " + std::to_string(rows) + " x " +
                    std::to_string(cols) + " out of range, expected 1 to 4096 pixels a side");
  auto images = at::empty({n, 1, rows, cols}, at::kByte);
  img.read(images.data_ptr(), static_cast<size_t>(n * rows * cols),
           std::to_string(n) + " images of " + std::to_string(rows) + " x " + std::to_string(cols));

  ZFile lab(labels_path);
  lab.expect_magic(0x801, "IDX file of unsigned bytes in 1 dimension");
  const int64_t m = lab.read_be32("the label count");
  if (m != n)
    throw DataError(labels_path + ": holds " + std::to_string(m) + " labels, expected " +
                    std::to_string(n) + " (one per image of " + images_path + ")");
  auto bytes = at::empty({n}, at::kByte);
  lab.read(bytes.data_ptr(), static_cast<size_t>(n), std::to_string(n) + " labels");
  Dataset d;
  d.name = name;
  d.images = images;
  d.labels = bytes.to(at::kLong);
  d.num_classes = num_classes;
  check_labels(d.labels, num_classes, labels_path);
  return d;
}

Dataset read_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& base) {
    const std::string plain = join(dir, base);
    if (exists(plain + ".gz"))
      return plain + ".gz";
    if (exists(plain))
      return plain;
    throw DataError(plain + "[.gz]: no such file (Fashion-MNIST IDX files are expected in " +
                    (dir.empty() ? std::string(".") : dir) +
                    "; Debian's dataset-fashion-mnist package installs them in " +
                    default_data_dir("fashion-mnist") + ")");
  };
  const std::string images = find(prefix + "-images-idx3-ubyte");
  const std::string labels = find(prefix + "-labels-idx1-ubyte");
  return read_idx(images, labels, 10, "fashion-mnist");
}

Dataset read_cifar10(const std::string& dir, bool train) {
  return read_cifar(dir, train, false);
}

Dataset read_cifar100(const std::string& dir, bool train) {
  return read_cifar(dir, train, true);
}

Dataset make_synthetic(int64_t n, int64_t classes, int64_t channels, int64_t side, uint64_t seed,
                       bool train) {
  if (n < 1 || classes < 2 || channels < 1 || side < 1)
    throw std::invalid_argument(
        "make_synthetic: n >= 1, classes >= 2, channels >= 1 and side >= 1 "
        "expected, got n " +
        std::to_string(n) + ", classes " + std::to_string(classes) + ", channels " +
        std::to_string(channels) + ", side " + std::to_string(side));
  auto proto_gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto protos = at::rand({classes, channels, side, side}, proto_gen);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 2 + (train ? 1 : 2));
  auto labels = at::arange(n, at::kLong).remainder(classes).index_select(0, at::randperm(n, gen));
  auto x = protos.index_select(0, labels).add(at::randn({n, channels, side, side}, gen), 0.35);
  Dataset d;
  d.name = "synthetic";
  d.images = x.clamp(0, 1).mul(255).round().to(at::kByte);
  d.labels = labels;
  d.num_classes = classes;
  return d;
}

Dataset load_dataset(const std::string& name, const std::string& dir, bool train) {
  const std::string where = dir.empty() ? default_data_dir(name) : dir;
  if (name == "fashion-mnist")
    return read_fashion_mnist(where, train);
  if (name == "cifar10")
    return read_cifar10(where, train);
  if (name == "cifar100")
    return read_cifar100(where, train);
  if (name == "synthetic")
    return make_synthetic(train ? 8192 : 2048, 10, 1, 28, 1234, train);
  throw std::invalid_argument("dataset: unknown data set '" + name +
                              "', expected fashion-mnist, cifar10, cifar100 or synthetic");
}

Dataset take(const Dataset& data, int64_t n) {
  if (n <= 0 || n >= data.size())
    return data;
  Dataset d = data;
  d.images = data.images.narrow(0, 0, n);
  d.labels = data.labels.narrow(0, 0, n);
  return d;
}

std::pair<std::vector<double>, std::vector<double>> channel_stats(const Dataset& data) {
  std::vector<double> mean, stdev;
  for (int64_t c = 0; c < data.channels(); ++c) {
    auto x = data.images.select(1, c).to(at::kDouble).div(255.0);
    mean.push_back(x.mean().item<double>());
    stdev.push_back(x.std().item<double>());
  }
  return {mean, stdev};
}

std::vector<int64_t> flip_map(const std::string& mode, int64_t num_classes, uint64_t seed) {
  if (num_classes < 2)
    throw std::invalid_argument("label flipping needs at least 2 classes, got " +
                                std::to_string(num_classes));
  std::vector<int64_t> map(static_cast<size_t>(num_classes));
  if (mode == "reverse") {
    for (int64_t l = 0; l < num_classes; ++l)
      map[static_cast<size_t>(l)] = num_classes - 1 - l;
    return map;
  }
  if (mode != "permutation")
    throw std::invalid_argument("--flip-mode: expected reverse or permutation, got '" + mode + "'");
  // A seeded random cyclic shift of a seeded shuffle: class order[i] -> order[i + 1], a
  // single cycle through all classes, so no class keeps its label.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x6c6162656cULL);
  const at::Tensor order = at::randperm(num_classes, gen, at::kLong);
  const int64_t* o = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_classes; ++i)
    map[static_cast<size_t>(o[i])] = o[(i + 1) % num_classes];
  return map;
}

Dataset flip_labels(const Dataset& data, const std::vector<int64_t>& map) {
  if (static_cast<int64_t>(map.size()) != data.num_classes)
    throw std::invalid_argument("flip_labels: the map has " + std::to_string(map.size()) +
                                " entries, the data set " + std::to_string(data.num_classes) +
                                " classes");
  Dataset out = data;
  out.labels = data.labels.clone();
  int64_t* l = out.labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < out.size(); ++i)
    l[i] = map[static_cast<size_t>(l[i])];
  return out;
}

std::vector<int> attacking_ranks(int world, const std::string& ranks, double fraction,
                                 uint64_t seed) {
  std::vector<int> out;
  if (!ranks.empty()) {
    size_t pos = 0;
    while (pos <= ranks.size()) {
      const size_t comma = std::min(ranks.find(',', pos), ranks.size());
      const std::string item = ranks.substr(pos, comma - pos);
      size_t used = 0;
      int r = -1;
      try {
        r = std::stoi(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != item.size() || r < 0 || r >= world)
        throw std::invalid_argument("--flip-ranks: expected ranks in [0, " +
                                    std::to_string(world - 1) + "] separated by commas, got '" +
                                    ranks + "'");
      out.push_back(r);
      pos = comma + 1;
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw std::invalid_argument("--flip-fraction: expected a value in [0, 1], got " +
                                std::to_string(fraction));
  const auto count = static_cast<int64_t>(std::llround(fraction * world));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x666c6970ULL);
  const at::Tensor order = at::randperm(world, gen, at::kLong);
  for (int64_t i = 0; i < count; ++i)
    out.push_back(static_cast<int>(order.data_ptr<int64_t>()[i]));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace examples
}  // namespace decent_dp
