// examples/common: data readers on files written here in the real formats, the Fashion-MNIST
// package files when installed, sharding, augmentation and the models' parameter counts.
#include "torch_catch.h"

#include <torch/torch.h>
#include <zlib.h>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>

#include "examples/common/data.h"
#include "examples/common/loader.h"
#include "examples/common/models.h"

using namespace decent_dp::examples;

namespace {

// POSIX calls rather than std::filesystem: the libtorch of the PyPI wheel exports
// std::filesystem symbols of its own that crash when called from code built here.
bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
int64_t file_size(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_size;
}
void remove_file(const std::string& path) {
  std::remove(path.c_str());
}
void resize_file(const std::string& path, int64_t size) {
  REQUIRE(::truncate(path.c_str(), size) == 0);
}

// A fresh folder under the system's temporary directory, removed at the end of the test.
struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/decent_dp_test_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    nftw(
        path.c_str(),
        [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
            static_cast<int>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  }
}

void put_be32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8)
    v.push_back(static_cast<uint8_t>(x >> s));
}

// IDX files of n images of rows x cols with pixel (i, r, c) = (i + 3 r + 5 c) mod 256 and
// label i mod 10.
void write_idx(const std::string& images, const std::string& labels, uint32_t n, uint32_t rows,
               uint32_t cols, bool gzip, uint32_t magic = 0x803) {
  std::vector<uint8_t> img;
  put_be32(img, magic);
  put_be32(img, n);
  put_be32(img, rows);
  put_be32(img, cols);
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t c = 0; c < cols; ++c)
        img.push_back(static_cast<uint8_t>(i + 3 * r + 5 * c));
  write_bytes(images, img, gzip);
  std::vector<uint8_t> lab;
  put_be32(lab, 0x801);
  put_be32(lab, n);
  for (uint32_t i = 0; i < n; ++i)
    lab.push_back(static_cast<uint8_t>(i % 10));
  write_bytes(labels, lab, gzip);
}

// CIFAR records: label bytes, then 3 x 32 x 32 with pixel (ch, r, c) = (i + ch + r + c) mod 256.
void write_cifar(const std::string& path, int n, int first, bool hundred) {
  std::vector<uint8_t> v;
  for (int i = first; i < first + n; ++i) {
    if (hundred)
      v.push_back(static_cast<uint8_t>(i % 20));
    v.push_back(static_cast<uint8_t>(i % (hundred ? 100 : 10)));
    for (int ch = 0; ch < 3; ++ch)
      for (int r = 0; r < 32; ++r)
        for (int c = 0; c < 32; ++c)
          v.push_back(static_cast<uint8_t>(i + ch + r + c));
  }
  write_bytes(path, v, false);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("IDX reader: raw and gzip round trip", "[data]") {
  TempDir dir;
  for (bool gzip : {false, true}) {
    const std::string ext = gzip ? ".gz" : "";
    write_idx(dir.file("train-images-idx3-ubyte" + ext), dir.file("train-labels-idx1-ubyte" + ext),
              37, 28, 28, gzip);
    write_idx(dir.file("t10k-images-idx3-ubyte" + ext), dir.file("t10k-labels-idx1-ubyte" + ext),
              11, 28, 28, gzip);
    const Dataset d = read_fashion_mnist(dir.path, true);
    REQUIRE(d.size() == 37);
    CHECK(d.images.sizes() == at::IntArrayRef({37, 1, 28, 28}));
    CHECK(d.images.scalar_type() == at::kByte);
    CHECK(d.num_classes == 10);
    CHECK(d.images[5][0][2][3].item<int>() == (5 + 6 + 15) % 256);
    CHECK(d.labels[36].item<int64_t>() == 6);
    CHECK(read_fashion_mnist(dir.path, false).size() == 11);
    remove_file(dir.file("train-images-idx3-ubyte" + ext));
    remove_file(dir.file("train-labels-idx1-ubyte" + ext));
    remove_file(dir.file("t10k-images-idx3-ubyte" + ext));
    remove_file(dir.file("t10k-labels-idx1-ubyte" + ext));
  }
}

TEST_CASE("IDX reader: missing, truncated and wrong-magic files", "[data]") {
  TempDir dir;
  const auto img = dir.file("train-images-idx3-ubyte");
  const auto lab = dir.file("train-labels-idx1-ubyte");
  std::string e = error_of([&] { read_fashion_mnist(dir.path, true); });
  CHECK_THAT(e, Catch::Contains("train-images-idx3-ubyte[.gz]: no such file"));
  CHECK_THAT(e, Catch::Contains("dataset-fashion-mnist"));

  write_idx(img, lab, 20, 4, 4, false, 0x802);
  e = error_of([&] { read_idx(img, lab, 10, "x"); });
  CHECK_THAT(e, Catch::Contains(img));
  CHECK_THAT(e, Catch::Contains("wrong magic number 0x00000802, expected 0x00000803"));

  write_idx(img, lab, 20, 4, 4, false);
  resize_file(img, 16 + 20 * 16 - 7);
  e = error_of([&] { read_idx(img, lab, 10, "x"); });
  CHECK_THAT(e, Catch::Contains(img + ": truncated: expected 320 bytes"));

  // The same for a gzip file cut short.
  write_idx(img + ".gz", lab + ".gz", 200, 8, 8, true);
  resize_file(img + ".gz", file_size(img + ".gz") / 2);
  e = error_of([&] { read_idx(img + ".gz", lab + ".gz", 10, "x"); });
  CHECK_THAT(e, Catch::Contains(img + ".gz"));
  CHECK((e.find("truncated") != std::string::npos || e.find("corrupt") != std::string::npos));

  // Labels that do not match the images.
  write_idx(img, lab, 20, 4, 4, false);
  std::vector<uint8_t> bad;
  put_be32(bad, 0x801);
  put_be32(bad, 19);
  bad.resize(8 + 19, 0);
  write_bytes(lab, bad, false);
  e = error_of([&] { read_idx(img, lab, 10, "x"); });
  CHECK_THAT(e, Catch::Contains("holds 19 labels, expected 20"));
  std::vector<uint8_t> out_of_range;
  put_be32(out_of_range, 0x801);
  put_be32(out_of_range, 20);
  for (int i = 0; i < 20; ++i)
    out_of_range.push_back(i == 5 ? 12 : 0);
  write_bytes(lab, out_of_range, false);
  e = error_of([&] { read_idx(img, lab, 10, "x"); });
  CHECK_THAT(e, Catch::Contains("label 12 out of range, expected labels in [0, 9]"));
}

TEST_CASE("CIFAR-10 and CIFAR-100 binary readers", "[data]") {
  TempDir dir;
  REQUIRE(::mkdir(dir.file("cifar-10-batches-bin").c_str(), 0755) == 0);
  for (int b = 1; b <= 5; ++b)
    write_cifar(dir.file("cifar-10-batches-bin/data_batch_" + std::to_string(b) + ".bin"), 3,
                (b - 1) * 3, false);
  write_cifar(dir.file("cifar-10-batches-bin/test_batch.bin"), 4, 100, false);
  // The folder holding the archive's folder, and the archive's folder itself.
  for (const auto& root : {dir.path, dir.file("cifar-10-batches-bin")}) {
    const Dataset d = read_cifar10(root, true);
    REQUIRE(d.size() == 15);
    CHECK(d.images.sizes() == at::IntArrayRef({15, 3, 32, 32}));
    CHECK(d.labels[13].item<int64_t>() == 3);
    CHECK(d.images[13][2][4][5].item<int>() == (13 + 2 + 4 + 5));
    CHECK(read_cifar10(root, false).size() == 4);
  }
  write_cifar(dir.file("train.bin"), 7, 0, true);
  write_cifar(dir.file("test.bin"), 5, 50, true);
  const Dataset h = read_cifar100(dir.path, true);
  CHECK(h.size() == 7);
  CHECK(h.num_classes == 100);
  CHECK(read_cifar100(dir.path, false).labels[4].item<int64_t>() == 54);

  const auto f = dir.file("cifar-10-batches-bin/test_batch.bin");
  resize_file(f, 3073 * 4 - 1);
  CHECK_THAT(error_of([&] { read_cifar10(dir.path, false); }),
             Catch::Contains(f + ": truncated or not a CIFAR binary file: 12291 bytes is not a "
                                 "positive multiple of the 3073-byte record"));
  remove_file(f);
  CHECK_THAT(error_of([&] { read_cifar10(dir.path, false); }),
             Catch::Contains(f + ": no such file"));
  // A CIFAR-100 file read as CIFAR-10 has labels out of range.
  write_cifar(f, 4, 10, true);
  resize_file(f, 3073 * 3);  // three 3073-byte "records"
  CHECK_THAT(error_of([&] { read_cifar10(dir.path, false); }), Catch::Contains("out of range"));
}

TEST_CASE("Fashion-MNIST package files", "[data]") {
  const std::string dir = default_data_dir("fashion-mnist");
  if (!file_exists(dir + "/train-images-idx3-ubyte.gz")) {
    WARN("skipped: Debian's dataset-fashion-mnist package is not installed (" << dir << ")");
    return;
  }
  const Dataset train = load_dataset("fashion-mnist", "", true);
  const Dataset test = load_dataset("fashion-mnist", "", false);
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.images.sizes() == at::IntArrayRef({60000, 1, 28, 28}));
  CHECK(train.labels.min().item<int64_t>() == 0);
  CHECK(train.labels.max().item<int64_t>() == 9);
  // Balanced classes: 6000 and 1000 of each.
  CHECK(at::bincount(train.labels).eq(6000).all().item<bool>());
  CHECK(at::bincount(test.labels).eq(1000).all().item<bool>());
}

TEST_CASE("IID sharding: every sample once per epoch, new order each epoch", "[data]") {
  const int64_t n = 1003;
  auto labels = torch::arange(n, torch::kLong).remainder(10);
  for (int world : {1, 2, 3, 4, 8}) {
    Sharder s(labels, 10, world, 42);
    REQUIRE(s.samples_per_rank() == n / world);
    std::vector<int64_t> all;
    for (int r = 0; r < world; ++r) {
      auto idx = s.indices(r, 1);
      REQUIRE(static_cast<int64_t>(idx.size()) == n / world);
      all.insert(all.end(), idx.begin(), idx.end());
    }
    std::set<int64_t> unique(all.begin(), all.end());
    INFO("world " << world);
    CHECK(unique.size() == all.size());  // disjoint
    CHECK(static_cast<int64_t>(unique.size()) == n / world * world);
    CHECK(*unique.rbegin() < n);
    CHECK(s.indices(0, 1) != s.indices(0, 2));
    // The same answer from another Sharder built the same way (as on another rank).
    CHECK(Sharder(labels, 10, world, 42).indices(world - 1, 3) == s.indices(world - 1, 3));
    CHECK(Sharder(labels, 10, world, 43).indices(0, 1) != s.indices(0, 1));
  }
  // With n divisible by the world size every sample is visited.
  Sharder even(torch::arange(1000, torch::kLong).remainder(10), 10, 4, 1);
  std::set<int64_t> seen;
  for (int r = 0; r < 4; ++r)
    for (auto i : even.indices(r, 5))
      seen.insert(i);
  CHECK(seen.size() == 1000);
}

TEST_CASE("non-IID sharding follows alpha", "[data]") {
  const int64_t n = 20000, classes = 10, world = 8;
  auto labels = torch::arange(n, torch::kLong).remainder(classes);
  // Mean over ranks of the largest class's share of the rank's part.
  auto concentration = [&](double alpha) {
    Sharder s(labels, classes, world, 7, alpha);
    double total = 0;
    int64_t dealt = 0;
    for (int r = 0; r < world; ++r) {
      const auto& part = s.part(r);
      dealt += static_cast<int64_t>(part.size());
      auto h = torch::bincount(labels.index_select(0, torch::tensor(part)), {}, classes);
      total += h.max().item<double>() / static_cast<double>(part.size());
      // Each epoch a rank takes n / world samples, all from its part.
      const auto idx = s.indices(r, 2);
      CHECK(static_cast<int64_t>(idx.size()) == n / world);
      std::set<int64_t> in_part(part.begin(), part.end());
      CHECK(std::all_of(idx.begin(), idx.end(), [&](int64_t i) { return in_part.count(i) == 1; }));
    }
    CHECK(dealt == n);  // every sample dealt to exactly one rank
    return total / world;
  };
  const double iid_like = concentration(1000.0);
  const double skewed = concentration(0.1);
  CHECK(iid_like < 0.15);  // uniform would be 0.10
  CHECK(skewed > 0.5);
  CHECK(concentration(1.0) > iid_like);
  CHECK(concentration(1.0) < skewed);
}

TEST_CASE("augmentation: deterministic under a seed, crops and flips", "[data]") {
  auto images = torch::randint(0, 256, {16, 3, 32, 32}, torch::kLong).to(torch::kByte);
  Transform t;
  t.random_crop = true;
  t.horizontal_flip = true;
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(5);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(5);
  auto a = apply_transform(images, t, g1);
  auto b = apply_transform(images, t, g2);
  CHECK(torch::equal(a, b));
  auto c = apply_transform(images, t, g1);  // the generator moved on
  CHECK_FALSE(torch::equal(a, c));
  // Every output image is a shifted (and maybe mirrored) window of its zero-padded input.
  auto padded = torch::constant_pad_nd(images.to(torch::kFloat).div(255), {4, 4, 4, 4});
  int matched = 0;
  for (int64_t i = 0; i < 16; ++i) {
    bool found = false;
    for (int dy = 0; dy <= 8 && !found; ++dy)
      for (int dx = 0; dx <= 8 && !found; ++dx) {
        auto w = padded[i].narrow(1, dy, 32).narrow(2, dx, 32);
        found = torch::equal(w, a[i]) || torch::equal(w.flip({2}), a[i]);
      }
    matched += found;
  }
  CHECK(matched == 16);
  // Normalization only: (x / 255 - mean) / std per channel.
  Transform n;
  n.mean = {0.5, 0.25, 0.0};
  n.stdev = {0.5, 2.0, 1.0};
  auto x = apply_transform(images, n, g1);
  CHECK(torch::allclose(x[3][1], (images[3][1].to(torch::kFloat) / 255 - 0.25) / 2.0));
  n.mean = {0.5};
  CHECK_THROWS_WITH(apply_transform(images, n, g1), Catch::Contains("one value per channel (3)"));
}

TEST_CASE("BatchLoader: batches in order from a background thread", "[data]") {
  Dataset d = make_synthetic(100, 4, 1, 8, 3, true);
  std::vector<int64_t> idx(100);
  std::iota(idx.begin(), idx.end(), 0);
  std::reverse(idx.begin(), idx.end());
  Transform t;
  BatchLoader loader(d, idx, 32, t, 1);
  CHECK(loader.batches() == 3);  // the partial batch of 4 is dropped
  Batch b;
  int count = 0;
  while (loader.next(b)) {
    REQUIRE(b.x.sizes() == at::IntArrayRef({32, 1, 8, 8}));
    CHECK(torch::equal(
        b.y, d.labels.index_select(0, torch::arange(99 - 32 * count, 67 - 32 * count, -1))));
    ++count;
  }
  CHECK(count == 3);
  CHECK(loader.wait_seconds() >= 0);
  // Abandoned half way: the destructor stops the thread.
  BatchLoader early(d, idx, 10, t, 1, false);
  CHECK(early.batches() == 10);
  CHECK(early.next(b));
}

TEST_CASE("synthetic data: learnable classes, seeded", "[data]") {
  auto a = make_synthetic(200, 5, 1, 8, 9, true);
  auto b = make_synthetic(200, 5, 1, 8, 9, true);
  CHECK(torch::equal(a.images, b.images));
  CHECK(torch::equal(a.labels, b.labels));
  CHECK(at::bincount(a.labels).eq(40).all().item<bool>());
  // The nearest class mean classifies the test split well above chance.
  auto test = make_synthetic(200, 5, 1, 8, 9, false);
  auto x = a.images.to(torch::kFloat).flatten(1);
  std::vector<torch::Tensor> means;
  for (int c = 0; c < 5; ++c)
    means.push_back(x.index({a.labels == c}).mean(0));
  auto m = torch::stack(means);
  auto pred = torch::cdist(test.images.to(torch::kFloat).flatten(1), m).argmin(1);
  CHECK(pred.eq(test.labels).to(torch::kFloat).mean().item<double>() > 0.8);
  CHECK_THROWS_WITH(make_synthetic(0, 5, 1, 8, 1, true), Catch::Contains("n >= 1"));
}

TEST_CASE("models: parameter counts and shapes", "[models]") {
  const std::vector<std::pair<std::string, int64_t>> counts = {{"resnet18", 11173962},
                                                               {"resnet34", 21282122},
                                                               {"resnet50", 23520842},
                                                               {"resnet20", 269722},
                                                               {"resnet56", 853018}};
  for (const auto& [name, count] : counts) {
    INFO(name);
    CHECK(parameter_count(*make_model(name, 3, 10, 32)) == count);
  }
  // Grey images and other class counts.
  CHECK(parameter_count(*make_model("resnet18", 1, 10, 28)) == 11173962 - 2 * 64 * 3 * 3);
  CHECK(parameter_count(*make_model("resnet20", 3, 100, 32)) == 269722 + 90 * 65);
  for (const auto& name : {"resnet20", "resnet18", "cnn", "mlp"}) {
    INFO(name);
    auto m = make_model(name, 1, 10, 28);
    m->eval();
    torch::NoGradGuard no_grad;
    CHECK(m->forward(torch::randn({2, 1, 28, 28})).sizes() == at::IntArrayRef({2, 10}));
  }
  CHECK_THROWS_WITH(make_model("resnet19"),
                    Catch::Contains("unknown model 'resnet19', expected one of resnet18"));
  CHECK_THROWS_WITH(make_model("cnn", 0), Catch::Contains("in_channels must be >= 1, got 0"));
  CHECK_THROWS_WITH(make_model("resnet20", 3, 10, 4),
                    Catch::Contains("image_size of resnet20 must be >= 8, got 4"));
}

TEST_CASE("label flipping: maps, flipped copies and the attacking ranks", "[data][attack]") {
  // reverse: l -> C - 1 - l.
  CHECK(flip_map("reverse", 4, 0) == std::vector<int64_t>({3, 2, 1, 0}));
  // permutation: a bijection that moves every class, the same for one seed.
  for (int64_t classes : {2, 3, 10, 100}) {
    const auto map = flip_map("permutation", classes, 5);
    std::vector<int64_t> sorted = map;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t l = 0; l < classes; ++l) {
      CHECK(sorted[l] == l);
      CHECK(map[l] != l);
    }
    CHECK(flip_map("permutation", classes, 5) == map);
  }
  CHECK(flip_map("permutation", 10, 5) != flip_map("permutation", 10, 6));
  CHECK_THROWS_WITH(flip_map("sideways", 10, 0), Catch::Contains("--flip-mode"));
  CHECK_THROWS_WITH(flip_map("reverse", 1, 0), Catch::Contains("at least 2 classes"));
  // A flipped copy: new labels, the same images, the original untouched.
  auto data = make_synthetic(50, 10, 1, 4, 3, true);
  const at::Tensor before = data.labels.clone();
  auto flipped = flip_labels(data, flip_map("reverse", 10, 0));
  CHECK(data.labels.equal(before));
  CHECK(flipped.labels.equal(9 - before));
  CHECK(flipped.images.data_ptr() == data.images.data_ptr());
  // Attacking ranks: a list (sorted, duplicates dropped) or a seeded fraction.
  CHECK(attacking_ranks(8, "5,2,5", 0, 0) == std::vector<int>({2, 5}));
  CHECK(attacking_ranks(8, "", 0, 0).empty());
  const auto some = attacking_ranks(8, "", 0.25, 11);
  CHECK(some.size() == 2);
  CHECK(attacking_ranks(8, "", 0.25, 11) == some);
  CHECK(attacking_ranks(8, "", 1.0, 11).size() == 8);
  for (const char* bad : {"8", "-1", "1,,2", "x", "1.5"})
    CHECK_THROWS_WITH(attacking_ranks(8, bad, 0, 0),
                      Catch::Contains("--flip-ranks: expected ranks in [0, 7]"));
  CHECK_THROWS_WITH(attacking_ranks(8, "", 1.5, 0), Catch::Contains("--flip-fraction"));
}
