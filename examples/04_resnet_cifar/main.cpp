// resnet_cifar: trains a ResNet (or a small CNN / MLP) on Fashion-MNIST, CIFAR-10 or CIFAR-100
// with decentralized gossip (any registered topology), classic all-reduce, or purely local
// training, one process per rank under mpirun. Each epoch it evaluates the globally averaged
// model and the local models on the test set (split across ranks) and rank 0 appends one JSON
// line and one CSV row to the output folder.
//
//   mpirun -n 4 --oversubscribe --bind-to none build/bin/resnet_cifar --model cnn --epochs 2
//   mpirun -n 4 ... build/bin/resnet_cifar --config run.json --topology ring
//   mpirun -n 4 ... build/bin/resnet_cifar --device cuda --amp bf16 --model resnet18
//
// --device cuda trains each rank on its GPU (decent_dp::local_device: the local rank modulo
// the node's GPUs); the wrappers then exchange through NCCL, or through MPI with host
// staging where ranks share a GPU. --amp bf16 runs forward and loss under autocast with
// bfloat16 (on the CPU too): parameters, gradients, buckets and optimizer stay float32.
//
// Every flag can also come from a JSON object (--config): keys are the flags' long names
// ("batch", "data-dir", ...); flags on the command line override it.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>

#include <sys/stat.h>
#include <unistd.h>

#include "decent_dp/decent_dp.h"
#include "decent_dp/mpi_communicator.h"
#include "decent_dp/state_archive.h"
#include "examples/common/data.h"
#include "examples/common/loader.h"
#include "examples/common/models.h"

namespace {

namespace ex = decent_dp::examples;
using Clock = std::chrono::steady_clock;
using Model = torch::nn::Sequential;

struct Config {
  std::string dataset = "fashion-mnist";
  std::string data_dir;
  int64_t train_subset = 0;  // 0: all
  int64_t test_subset = 0;
  std::string model = "cnn";
  std::string mode = "decentralized";  // decentralized | allreduce | local
  std::string device = "cpu";          // cpu | cuda (the local rank's GPU)
  std::string amp = "off";             // off | bf16 (autocast of forward and loss)
  std::string topology = "complete";
  int lws = 0;
  double bucket_cap_mb = 25;
  std::string optimizer = "adamw";  // sgd | adamw | accum_adamw
  double lr = 1e-3;
  double weight_decay = -1;  // < 0: the optimizer factory's default
  double momentum = 0.9;
  bool nesterov = true;
  double beta1 = 0.9, beta2 = 0.999;
  int64_t accum_iter = 4;
  std::string schedule = "cosine";  // cosine | step | constant
  double warmup_epochs = 0.2;
  double step_epochs = 1;
  double gamma = 0.1;
  int epochs = 2;
  int64_t batch = 32;
  int threads = 1;
  uint64_t seed = 0;
  std::string augment = "auto";  // auto | none | crop-flip
  double noniid_alpha = 0;
  std::string output;
  std::string progress = "auto";  // auto | bar | lines
  int log_every = 0;              // plain progress lines every this many steps (0: ten per epoch)
  int consensus_every = 0;        // also measure the consensus distance every this many steps
  int64_t eval_batch = 500;
  int checkpoint_every = 0;  // save <output>/checkpoint every this many epochs (0: never)
  std::string resume;        // checkpoint folder to continue from
  // The gossip exchange (decentralized mode): aggregation and what a rank sends.
  std::string aggregator =
      "auto";                  // auto (the all-reduce fast path) | mean | median | trimmed-mean
  int64_t trim = 1;            // trimmed-mean: values dropped at each end per coordinate
  std::string codec = "none";  // none | quantize | quantize-ec | zstd | fpzip
  int codec_bits = 8;
  int codec_level = 1;  // zstd's level
  int64_t codec_chunk = 1024;
  // Attack emulation: ranks that train on flipped labels.
  std::string flip_ranks;  // "2,5"; empty: flip_fraction of the ranks, drawn with the seed
  double flip_fraction = 0;
  std::string flip_mode = "reverse";  // reverse (l -> C-1-l) | permutation (seeded)
  // Differential privacy: the Gaussian mechanism on each rank's gradient (library
  // Note [differential privacy]); the accountant's delta.
  double dp_clip = 0;  // C (0: off)
  double dp_sigma = 0;
  double dp_delta = 1e-5;
};

// Payload bytes of the exchanges: all-reduces (the fast path, DDP) and all-gathers (the
// gather path of aggregators and codecs, what a codec encodes).
uint64_t sent_bytes(const decent_dp::MpiStats& s) {
  return s.allreduce_bytes_sent + s.allgather_bytes_sent;
}
uint64_t received_bytes(const decent_dp::MpiStats& s) {
  return s.allreduce_bytes_received + s.allgather_bytes_received;
}

// "must be > 0" / ">= 0" checks whose messages name the bound and the value.
CLI::Validator at_least(double lo, bool strict) {
  const std::string bound = (strict ? "> " : ">= ") + fmt::format("{}", lo);
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        double v = 0;
        try {
          size_t used = 0;
          v = std::stod(value, &used);
          if (used != value.size())
            throw std::invalid_argument(value);
        } catch (const std::exception&) {
          return "expected a number " + bound + ", got '" + value + "'";
        }
        return (strict ? v > lo : v >= lo) ? std::string()
                                           : "expected a value " + bound + ", got " + value;
      },
      "", strict ? "POSITIVE" : "NON-NEGATIVE");
}
const CLI::Validator kPositive = at_least(0, true);
const CLI::Validator kNonNegative = at_least(0, false);

// The flags, registered once: `bind` adds every option to `app`.
void bind(CLI::App& app, Config& c, std::string& config_path) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--config", config_path, "JSON file with any of these settings (flags win)");
  app.add_option("--dataset", c.dataset, "fashion-mnist, cifar10, cifar100 or synthetic")
      ->check(CLI::IsMember(ex::dataset_names()));
  app.add_option("--data-dir", c.data_dir,
                 "folder of the data set files (default: the data "
                 "set's default folder)");
  app.add_option("--train-subset", c.train_subset, "train on the first N images (0: all)")
      ->check(kNonNegative);
  app.add_option("--test-subset", c.test_subset, "test on the first N images (0: all)")
      ->check(kNonNegative);
  app.add_option("--model", c.model, "model")->check(CLI::IsMember(ex::model_names()));
  app.add_option("--device", c.device, "cpu, or cuda (each rank on its local GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--amp", c.amp, "off, or bf16 (autocast of forward and loss to bfloat16)")
      ->check(CLI::IsMember({"off", "bf16"}));
  app.add_option("--mode", c.mode, "decentralized (gossip), allreduce or local")
      ->check(CLI::IsMember({"decentralized", "allreduce", "local"}));
  app.add_option("--topology", c.topology, "gossip topology (complete, ring, exp, aer, ...)");
  app.add_option("--lws", c.lws, "ranks per node for the topology (0: found through MPI)")
      ->check(kNonNegative);
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "bucket size cap in MB")->check(kPositive);
  app.add_option("--optimizer", c.optimizer, "sgd, adamw or accum_adamw")
      ->check(CLI::IsMember({"sgd", "adamw", "accum_adamw"}));
  app.add_option("--lr", c.lr, "peak learning rate")->check(kPositive);
  app.add_option("--weight-decay", c.weight_decay, "weight decay (< 0: the optimizer's default)");
  app.add_option("--momentum", c.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  app.add_option("--nesterov", c.nesterov, "SGD Nesterov momentum (true/false)");
  app.add_option("--beta1", c.beta1, "Adam beta1")->check(CLI::Range(0.0, 1.0));
  app.add_option("--beta2", c.beta2, "Adam beta2")->check(CLI::Range(0.0, 1.0));
  app.add_option("--accum-iter", c.accum_iter, "AccumAdamW accumulation window")->check(kPositive);
  app.add_option("--schedule", c.schedule, "cosine (with warmup), step or constant")
      ->check(CLI::IsMember({"cosine", "step", "constant"}));
  app.add_option("--warmup-epochs", c.warmup_epochs, "cosine: linear warmup length in epochs")
      ->check(kNonNegative);
  app.add_option("--step-epochs", c.step_epochs, "step: epochs between decays")->check(kPositive);
  app.add_option("--gamma", c.gamma, "step: decay factor")->check(kPositive);
  app.add_option("--epochs", c.epochs, "epochs")->check(kPositive);
  app.add_option("--batch", c.batch, "images per rank and step")->check(kPositive);
  app.add_option("--threads", c.threads, "intra-op threads per rank")->check(kPositive);
  app.add_option("--seed", c.seed, "seed of the model, the sharding and the augmentation");
  app.add_option("--augment", c.augment,
                 "auto (crop + flip for CIFAR, none for Fashion-MNIST), none or crop-flip")
      ->check(CLI::IsMember({"auto", "none", "crop-flip"}));
  app.add_option("--noniid-alpha", c.noniid_alpha,
                 "Dirichlet alpha of a non-IID split over labels (0: IID)")
      ->check(kNonNegative);
  app.add_option("--output", c.output, "output folder (default: runs/<dataset>-<model>-<mode>)");
  app.add_option("--progress", c.progress,
                 "bar (one live line), lines (plain periodic lines) or auto (bar when stdout is a "
                 "terminal; mpirun may present a terminal even when its output goes to a file)")
      ->check(CLI::IsMember({"auto", "bar", "lines"}));
  app.add_option("--log-every", c.log_every, "plain progress line every N steps (0: 10 per epoch)")
      ->check(kNonNegative);
  app.add_option("--consensus-every", c.consensus_every,
                 "also record the consensus distance every N steps in consensus.csv (0: only "
                 "at the end of each epoch)")
      ->check(kNonNegative);
  app.add_option("--eval-batch", c.eval_batch, "evaluation batch")->check(kPositive);
  app.add_option("--checkpoint-every", c.checkpoint_every,
                 "save <output>/checkpoint every N epochs (0: never)")
      ->check(kNonNegative);
  app.add_option("--resume", c.resume,
                 "continue from this checkpoint folder (saved by --checkpoint-every)");
  app.add_option("--aggregator", c.aggregator,
                 "decentralized: auto (all-reduce to the group mean), mean, median or "
                 "trimmed-mean (group all-gather of every member's block)")
      ->check(CLI::IsMember({"auto", "mean", "median", "trimmed-mean"}));
  app.add_option("--trim", c.trim, "trimmed-mean: values dropped at each end per coordinate")
      ->check(kNonNegative);
  app.add_option("--codec", c.codec,
                 "decentralized: what a rank sends, none, quantize, quantize-ec (quantized "
                 "changes against the last value sent: error compensation), or the lossless "
                 "zstd or fpzip")
      ->check(CLI::IsMember({"none", "quantize", "quantize-ec", "zstd", "fpzip"}));
  app.add_option("--codec-level", c.codec_level, "zstd: compression level (1 fastest, 19)")
      ->check(CLI::Range(1, 19));
  app.add_option("--codec-bits", c.codec_bits, "quantize: 8 or 4 bits per value")
      ->check(CLI::IsMember({8, 4}));
  app.add_option("--codec-chunk", c.codec_chunk, "quantize: values per (minimum, step) pair")
      ->check(kPositive);
  app.add_option("--flip-ranks", c.flip_ranks,
                 "attack emulation: ranks that train on flipped labels, e.g. 2,5");
  app.add_option("--flip-fraction", c.flip_fraction,
                 "attack emulation: without --flip-ranks, this fraction of the ranks (drawn "
                 "with --seed) flips its labels")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--flip-mode", c.flip_mode,
                 "reverse (label l -> C-1-l) or permutation (a seeded map that moves every class)")
      ->check(CLI::IsMember({"reverse", "permutation"}));
  app.add_option("--dp-clip", c.dp_clip,
                 "differential privacy: clip each rank's batch gradient to this norm C (0: off)")
      ->check(kNonNegative);
  app.add_option("--dp-sigma", c.dp_sigma,
                 "differential privacy: noise multiplier, N(0, (sigma C)^2) per coordinate")
      ->check(kNonNegative);
  app.add_option("--dp-delta", c.dp_delta, "differential privacy: the delta epsilon is given for")
      ->check(CLI::Range(0.0, 1.0));
}

nlohmann::json to_json(const Config& c) {
  return {{"dataset", c.dataset},
          {"data-dir", c.data_dir},
          {"train-subset", c.train_subset},
          {"test-subset", c.test_subset},
          {"model", c.model},
          {"mode", c.mode},
          {"device", c.device},
          {"amp", c.amp},
          {"topology", c.topology},
          {"lws", c.lws},
          {"bucket-cap-mb", c.bucket_cap_mb},
          {"optimizer", c.optimizer},
          {"lr", c.lr},
          {"weight-decay", c.weight_decay},
          {"momentum", c.momentum},
          {"nesterov", c.nesterov},
          {"beta1", c.beta1},
          {"beta2", c.beta2},
          {"accum-iter", c.accum_iter},
          {"schedule", c.schedule},
          {"warmup-epochs", c.warmup_epochs},
          {"step-epochs", c.step_epochs},
          {"gamma", c.gamma},
          {"epochs", c.epochs},
          {"batch", c.batch},
          {"threads", c.threads},
          {"seed", c.seed},
          {"augment", c.augment},
          {"noniid-alpha", c.noniid_alpha},
          {"output", c.output},
          {"progress", c.progress},
          {"log-every", c.log_every},
          {"consensus-every", c.consensus_every},
          {"eval-batch", c.eval_batch},
          {"checkpoint-every", c.checkpoint_every},
          {"resume", c.resume},
          {"aggregator", c.aggregator},
          {"trim", c.trim},
          {"codec", c.codec},
          {"codec-bits", c.codec_bits},
          {"codec-level", c.codec_level},
          {"codec-chunk", c.codec_chunk},
          {"flip-ranks", c.flip_ranks},
          {"flip-fraction", c.flip_fraction},
          {"flip-mode", c.flip_mode},
          {"dp-clip", c.dp_clip},
          {"dp-sigma", c.dp_sigma},
          {"dp-delta", c.dp_delta}};
}

// argv with the JSON file's settings first (so command-line flags, parsed later, win).
std::vector<std::string> with_config(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  std::string path;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size())
      path = args[i + 1];
    else if (args[i].rfind("--config=", 0) == 0)
      path = args[i].substr(9);
  }
  if (path.empty())
    return args;
  std::ifstream in(path);
  if (!in)
    throw std::invalid_argument("--config: cannot open " + path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("--config: " + path + " is not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw std::invalid_argument("--config: " + path + " must hold one JSON object of settings");
  const nlohmann::json known = to_json(Config{});
  std::vector<std::string> out = {args[0]};
  for (const auto& [key, value] : j.items()) {
    if (!known.contains(key)) {
      std::string list;
      for (const auto& [k, v] : known.items())
        list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument("--config: " + path + ": unknown setting '" + key +
                                  "', expected one of " + list);
    }
    if (value.is_object() || value.is_array() || value.is_null())
      throw std::invalid_argument("--config: " + path + ": setting '" + key +
                                  "' must be a string, number or boolean");
    out.push_back("--" + key);
    out.push_back(value.is_string() ? value.get<std::string>() : value.dump());
  }
  out.insert(out.end(), args.begin() + 1, args.end());
  return out;
}

decent_dp::optim::OptimFn make_optimizer(const Config& c) {
  namespace o = decent_dp::optim;
  if (c.optimizer == "sgd") {
    o::SgdFactoryOptions s;
    s.lr = c.lr;
    s.momentum = c.momentum;
    s.nesterov = c.nesterov && c.momentum > 0;
    s.weight_decay = c.weight_decay >= 0 ? c.weight_decay : 5e-4;
    return o::sgd(s);
  }
  // The settings AdamW and AccumAdamW share.
  auto adam_settings = [&c](auto& a) {
    a.lr = c.lr;
    a.beta1 = c.beta1;
    a.beta2 = c.beta2;
    if (c.weight_decay >= 0)
      a.weight_decay = c.weight_decay;
  };
  if (c.optimizer == "adamw") {
    o::AdamWFactoryOptions a;
    adam_settings(a);
    return o::adamw(a);
  }
  o::AccumAdamWFactoryOptions a;
  adam_settings(a);
  a.accum_iter = c.accum_iter;
  return o::accum_adamw(a);
}

decent_dp::optim::LrSchedulerFn make_schedule(const Config& c, int64_t steps_per_epoch) {
  const int64_t total = steps_per_epoch * c.epochs;
  if (c.schedule == "cosine") {
    const int64_t warmup =
        std::min<int64_t>(total - 1, static_cast<int64_t>(c.warmup_epochs * steps_per_epoch));
    return decent_dp::optim::cosine_with_warmup(std::max<int64_t>(1, total - warmup),
                                                std::max<int64_t>(0, warmup));
  }
  if (c.schedule == "step") {
    return decent_dp::optim::step_decay(
        std::max<int64_t>(1, static_cast<int64_t>(c.step_epochs * steps_per_epoch)), c.gamma);
  }
  return decent_dp::optim::constant_lr();
}

// Replaces a module's floating-point buffers, and its parameters unless they are known to be
// equal on every rank, with their mean over all ranks, and puts the rank's own values back
// afterwards.
class StateAverager {
 public:
  // `comm` is the control (CPU) communicator; the model's tensors travel on the
  // communicator of their device.
  StateAverager(Model m, std::shared_ptr<decent_dp::Communicator> comm, bool parameters)
      : m_(std::move(m)),
        comm_(std::move(comm)),
        data_(decent_dp::communicator_for_device(m_->parameters().front().device(), comm_)),
        parameters_(parameters) {
    for (int r = 0; r < comm_->size(); ++r)
      all_.push_back(r);
  }
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : m_->parameters())
      if (parameters_)
        out.push_back(p.detach());
    for (const auto& b : m_->buffers())
      out.push_back(b);
    return out;
  }
  void average() {
    torch::NoGradGuard no_grad;
    backup_.clear();
    for (auto& t : state()) {
      backup_.push_back(t.clone());
      if (t.is_floating_point())
        data_->allreduce(t, all_, decent_dp::ReduceOp::kAvg)->wait();
    }
  }
  void restore() {
    torch::NoGradGuard no_grad;
    auto s = state();
    for (size_t i = 0; i < s.size() && i < backup_.size(); ++i)
      s[i].copy_(backup_[i]);
    backup_.clear();
  }
  // Mean over ranks of ||x_i - mean||^2 over the parameters.
  double consensus_distance() {
    torch::NoGradGuard no_grad;
    double d2 = 0;
    for (const auto& p : m_->parameters()) {
      auto mean = p.detach().clone();
      data_->allreduce(mean, all_, decent_dp::ReduceOp::kAvg)->wait();
      d2 += (p.detach().to(torch::kDouble) - mean.to(torch::kDouble)).pow(2).sum().item<double>();
    }
    auto total = torch::full({1}, d2, torch::kDouble);
    comm_->allreduce(total, all_, decent_dp::ReduceOp::kAvg)->wait();
    return total.item<double>();
  }
  decent_dp::Communicator& comm() { return *comm_; }
  decent_dp::Communicator& data() { return *data_; }

 private:
  Model m_;
  std::shared_ptr<decent_dp::Communicator> comm_;
  std::shared_ptr<decent_dp::Communicator> data_;
  bool parameters_;
  std::vector<int> all_;
  std::vector<torch::Tensor> backup_;
};

// The three ways of training behind one face.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // After loss.backward(): local training steps its optimizer here; the wrappers already did.
  virtual void after_backward() {}
  virtual void train(bool on) = 0;
  virtual double lr() = 0;
  // Replace every rank's model with the mean over ranks until end_average().
  virtual void begin_average() = 0;
  virtual void end_average() = 0;
  virtual double consensus_distance() = 0;
  virtual double exchange_wait_seconds() const { return 0; }
  // The wrapper's counters and timers (null: local training has none).
  virtual const decent_dp::Metrics* metrics() const { return nullptr; }
  virtual void synchronize() {}
  // Collective checkpoint of the whole training state plus the trainer's own tensors.
  virtual void save(const std::string& dir, const decent_dp::NamedTensors& user) = 0;
  virtual decent_dp::NamedTensors load(const std::string& dir) = 0;
};

class GossipRunner final : public Runner {
 public:
  GossipRunner(Model m, const decent_dp::DataParallelOptions& o, decent_dp::OptimFn f,
               decent_dp::LrSchedulerFn s, std::shared_ptr<decent_dp::Communicator> comm)
      : w_(std::move(m), o, std::move(f), std::move(s), std::move(comm)) {}
  torch::Tensor forward(const torch::Tensor& x) override { return w_.forward(x); }
  void train(bool on) override { w_.train(on); }
  double lr() override { return w_.get_lr(); }
  void begin_average() override { w_.global_avg(/*will_revert=*/true); }
  void end_average() override { w_.revert_global_avg(); }
  double consensus_distance() override { return w_.consensus_distance(); }
  double exchange_wait_seconds() const override { return w_.exchange_wait_seconds(); }
  const decent_dp::Metrics* metrics() const override { return &w_.metrics(); }
  void synchronize() override { w_.synchronize(); }
  void save(const std::string& dir, const decent_dp::NamedTensors& user) override {
    w_.save(dir, user);
  }
  decent_dp::NamedTensors load(const std::string& dir) override { return w_.load(dir); }
  const decent_dp::topology::Topology& topology() const { return w_.topology(); }

 private:
  decent_dp::DecentralizedDataParallel<Model> w_;
};

class AllReduceRunner final : public Runner {
 public:
  AllReduceRunner(Model m, const decent_dp::DataParallelOptions& o, decent_dp::OptimFn f,
                  decent_dp::LrSchedulerFn s, std::shared_ptr<decent_dp::Communicator> comm)
      : w_(m, o, std::move(f), std::move(s), comm), avg_(m, comm, /*parameters=*/false) {}
  torch::Tensor forward(const torch::Tensor& x) override { return w_.forward(x); }
  void train(bool on) override { w_.train(on); }
  double lr() override { return w_.get_lr(); }
  // Every rank holds the same parameters, but batch-norm statistics are each rank's own: only
  // they are averaged for evaluation, as the gossip wrapper's global_avg does.
  void begin_average() override {
    w_.synchronize();
    avg_.average();
  }
  void end_average() override { avg_.restore(); }
  double consensus_distance() override { return 0; }
  double exchange_wait_seconds() const override { return w_.exchange_wait_seconds(); }
  const decent_dp::Metrics* metrics() const override { return &w_.metrics(); }
  void synchronize() override { w_.synchronize(); }
  void save(const std::string& dir, const decent_dp::NamedTensors& user) override {
    w_.save(dir, user);
  }
  decent_dp::NamedTensors load(const std::string& dir) override { return w_.load(dir); }

 private:
  decent_dp::DistributedDataParallel<Model> w_;
  StateAverager avg_;
};

// No communication while training; the averaged model is formed only to evaluate it.
class LocalRunner final : public Runner {
 public:
  LocalRunner(Model m, decent_dp::OptimFn f, decent_dp::LrSchedulerFn s,
              std::shared_ptr<decent_dp::Communicator> comm)
      : m_(m), avg_(m, std::move(comm), /*parameters=*/true) {
    decent_dp::NamedParams named;
    for (const auto& p : m_->named_parameters())
      named.emplace_back(p.key(), p.value());
    opt_ = f(named);
    if (s)
      sched_ = s(*opt_);
    // Same initial model everywhere, as the wrappers do.
    torch::NoGradGuard no_grad;
    for (auto& t : avg_.state())
      avg_.data().broadcast(t, 0)->wait();
  }
  torch::Tensor forward(const torch::Tensor& x) override { return m_->forward(x); }
  void after_backward() override {
    opt_->step();
    if (sched_)
      sched_->step();
    opt_->zero_grad();
    ++steps_;
  }
  void train(bool on) override { m_->train(on); }
  double lr() override { return opt_->param_groups()[0].options().get_lr(); }
  void begin_average() override { avg_.average(); }
  void end_average() override { avg_.restore(); }
  double consensus_distance() override { return avg_.consensus_distance(); }
  // The library's checkpoint format with this runner's own contents.
  void save(const std::string& dir, const decent_dp::NamedTensors& user) override {
    namespace sa = decent_dp::state_archive;
    torch::serialize::OutputArchive ar;
    sa::write_tensors(ar, "state_", state());
    torch::serialize::OutputArchive opt;
    opt_->save(opt);
    ar.write("optimizer", opt);
    sa::write_int(ar, "steps", steps_);
    sa::write_user_state(ar, user);
    decent_dp::checkpoint::save(avg_.comm(), dir, manifest(), ar);
  }
  decent_dp::NamedTensors load(const std::string& dir) override {
    namespace sa = decent_dp::state_archive;
    torch::serialize::InputArchive ar;
    decent_dp::checkpoint::load(avg_.comm(), dir, manifest(), ar);
    std::vector<std::string> names;
    for (const auto& p : m_->named_parameters())
      names.push_back(p.key());
    for (const auto& b : m_->named_buffers())
      names.push_back("buffer " + b.key());
    sa::read_tensors_into(ar, "state_", state(), names);
    steps_ = sa::read_int(ar, "steps");
    if (auto* cs = dynamic_cast<decent_dp::optim::ClosedFormScheduler*>(sched_.get()))
      cs->set_steps(steps_);
    torch::serialize::InputArchive opt;
    if (!ar.try_read("optimizer", opt))
      throw decent_dp::CheckpointError(dir + ": the optimizer's state is missing");
    opt_->load(opt);
    return sa::read_user_state(ar);
  }

 private:
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : m_->parameters())
      out.push_back(p);
    for (const auto& b : m_->buffers())
      out.push_back(b);
    return out;
  }
  decent_dp::CheckpointManifest manifest() {
    decent_dp::CheckpointManifest m;
    m.wrapper = "local training (resnet_cifar)";
    m.world_size = avg_.comm().size();
    m.local_world_size = avg_.comm().local_size();
    m.topology = "none";
    m.steps = m.updates = steps_;
    return m;
  }

  Model m_;
  int64_t steps_ = 0;
  StateAverager avg_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::unique_ptr<torch::optim::LRScheduler> sched_;
};

// Sums `values` over all ranks in place.
void sum_all(decent_dp::Communicator& comm, std::vector<double>& values) {
  std::vector<int> all(comm.size());
  for (int r = 0; r < comm.size(); ++r)
    all[r] = r;
  auto t = torch::from_blob(values.data(), {static_cast<int64_t>(values.size())}, torch::kDouble)
               .clone();
  comm.allreduce(t, all, decent_dp::ReduceOp::kSum)->wait();
  std::memcpy(values.data(), t.data_ptr<double>(), values.size() * sizeof(double));
}

// Correct predictions and count on this rank's part of the test set (samples rank, rank + n,
// ...), with the runner in eval mode.
// Autocast of forward and loss on `device` to bfloat16 while alive, when `on`.
class AmpScope {
 public:
  AmpScope(const c10::Device& device, bool on) : type_(device.type()), on_(on) {
    if (!on_)
      return;
    was_enabled_ = at::autocast::is_autocast_enabled(type_);
    was_dtype_ = at::autocast::get_autocast_dtype(type_);
    at::autocast::set_autocast_dtype(type_, at::kBFloat16);
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::increment_nesting();
  }
  ~AmpScope() {
    if (!on_)
      return;
    if (at::autocast::decrement_nesting() == 0)
      at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, was_enabled_);
    at::autocast::set_autocast_dtype(type_, was_dtype_);
  }
  AmpScope(const AmpScope&) = delete;
  AmpScope& operator=(const AmpScope&) = delete;

 private:
  c10::DeviceType type_;
  bool on_;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

std::pair<double, double> evaluate(Runner& runner, const ex::Dataset& test,
                                   const ex::Transform& transform, int rank, int world,
                                   int64_t eval_batch, const c10::Device& device, bool amp) {
  torch::NoGradGuard no_grad;
  runner.train(false);
  double correct = 0, count = 0;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  for (int64_t begin = rank; begin < test.size(); begin += eval_batch * world) {
    const int64_t end = std::min(test.size(), begin + eval_batch * world);
    auto idx = torch::arange(begin, end, world, torch::kLong);
    auto x = ex::apply_transform(test.images.index_select(0, idx), transform, gen);
    auto y = test.labels.index_select(0, idx).to(device);
    AmpScope scope(device, amp);
    correct += runner.forward(x.to(device)).argmax(1).eq(y).sum().item<double>();
    count += static_cast<double>(idx.numel());
  }
  runner.train(true);
  return {correct, count};
}

// mkdir -p (POSIX: the PyPI wheel's libtorch exports std::filesystem symbols of its own that
// crash when called from code built here).
void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      const std::string prefix = path.substr(0, i);
      struct stat st {};
      if (::stat(prefix.c_str(), &st) != 0 && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
        throw std::invalid_argument("--output: cannot create " + prefix + " (" +
                                    std::strerror(errno) + ")");
    }
  }
}

std::string duration(double s) {
  const int t = static_cast<int>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

extern "C" void on_signal(int sig) {
  const char msg[] = "resnet_cifar: interrupted, stopping every rank\n";
  ssize_t ignored = write(2, msg, sizeof(msg) - 1);
  (void)ignored;
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// One epoch's results, as metrics.jsonl / metrics.csv hold them.
struct Row {
  int epoch;
  double loss, train_acc, test_acc, local_acc, consensus, lr, ips, step_ms, wait_ms, data_ms, sent,
      received, train_s, wall_s;
  double epsilon;  // of the run so far (NaN: differential privacy off)
};
constexpr int64_t kRowFields = 16;

// Epsilon in JSON: null when differential privacy is off, "inf" without noise.
nlohmann::json epsilon_json(double e) {
  if (std::isnan(e))
    return nullptr;
  if (std::isinf(e))
    return "inf";
  return e;
}

void write_row(std::ofstream& jsonl, std::ofstream& csv, const Row& r) {
  const nlohmann::json j = {{"epoch", r.epoch},
                            {"train_loss", r.loss},
                            {"train_acc", r.train_acc},
                            {"test_acc", r.test_acc},
                            {"local_test_acc", r.local_acc},
                            {"consensus_distance", r.consensus},
                            {"lr", r.lr},
                            {"images_per_s", r.ips},
                            {"step_ms", r.step_ms},
                            {"exchange_wait_ms", r.wait_ms},
                            {"data_wait_ms", r.data_ms},
                            {"data_wait_frac", r.data_ms / r.step_ms},
                            {"bytes_sent_per_rank", r.sent},
                            {"bytes_received_per_rank", r.received},
                            {"train_time_s", r.train_s},
                            {"wall_time_s", r.wall_s},
                            {"epsilon", epsilon_json(r.epsilon)}};
  jsonl << j.dump() << "\n" << std::flush;
  csv << fmt::format(
             "{},{:.6f},{:.6f},{:.6f},{:.6f},{:.6e},{:.6e},{:.2f},{:.3f},{:.3f},{:.3f},"
             "{:.5f},{:.0f},{:.0f},{:.3f},{:.3f},{}\n",
             r.epoch, r.loss, r.train_acc, r.test_acc, r.local_acc, r.consensus, r.lr, r.ips,
             r.step_ms, r.wait_ms, r.data_ms, r.data_ms / r.step_ms, r.sent, r.received, r.train_s,
             r.wall_s, std::isnan(r.epsilon) ? std::string() : fmt::format("{:.6g}", r.epsilon))
      << std::flush;
}

// The finished epochs' rows travel in the checkpoint as one double tensor.
torch::Tensor rows_to_tensor(const std::vector<Row>& rows) {
  auto t = torch::zeros({static_cast<int64_t>(rows.size()), kRowFields}, torch::kDouble);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double v[kRowFields] = {static_cast<double>(r.epoch),
                                  r.loss,
                                  r.train_acc,
                                  r.test_acc,
                                  r.local_acc,
                                  r.consensus,
                                  r.lr,
                                  r.ips,
                                  r.step_ms,
                                  r.wait_ms,
                                  r.data_ms,
                                  r.sent,
                                  r.received,
                                  r.train_s,
                                  r.wall_s,
                                  r.epsilon};
    std::memcpy(t[static_cast<int64_t>(i)].data_ptr<double>(), v, sizeof v);
  }
  return t;
}

std::vector<Row> rows_from_tensor(const torch::Tensor& t) {
  if (t.dim() != 2 || t.size(1) != kRowFields || t.scalar_type() != torch::kDouble)
    throw std::invalid_argument("--resume: the checkpoint's 'rows' are not the trainer's");
  std::vector<Row> rows;
  for (int64_t i = 0; i < t.size(0); ++i) {
    const double* v = t[i].data_ptr<double>();
    rows.push_back(Row{static_cast<int>(v[0]), v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9],
                       v[10], v[11], v[12], v[13], v[14], v[15]});
  }
  return rows;
}

torch::Tensor cpu_generator_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

// Rewrites consensus.csv without the lines after `last_step` (the interrupted run's).
void keep_consensus_until(const std::string& path, std::ofstream& out, int64_t last_step) {
  out.close();
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    const bool header = line.rfind("step", 0) == 0;
    if (header || (!line.empty() && std::stoll(line) <= last_step))
      kept += line + "\n";
  }
  in.close();
  out.open(path, std::ios::trunc);
  out << (kept.empty() ? std::string("step,consensus_distance\n") : kept) << std::flush;
}

// Numeric leaves of a JSON object as "a.b.c" -> value, in key order.
void flatten(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, double>>& out) {
  for (const auto& [k, v] : j.items()) {
    const std::string name = prefix.empty() ? k : prefix + "." + k;
    if (v.is_object())
      flatten(v, name, out);
    else if (v.is_number())
      out.emplace_back(name, v.get<double>());
  }
}

// Writes <out>/<rank>.metrics.json on every rank and, on rank 0, <out>/metrics_summary.json:
// every numeric value of the ranks' files with its sum, mean, minimum, maximum (and the rank
// that holds it) over ranks. Collective.
void write_rank_metrics(decent_dp::Communicator& comm, const std::string& out_dir,
                        const nlohmann::json& mine) {
  const int rank = comm.rank(), world = comm.size();
  make_dirs(out_dir);
  const std::string path = fmt::format("{}/{}.metrics.json", out_dir, rank);
  std::ofstream(path) << mine.dump(2) << "\n";
  std::vector<std::pair<std::string, double>> values;
  flatten(mine, "", values);
  const int64_t k = static_cast<int64_t>(values.size());
  auto local = torch::empty({k}, torch::kDouble);
  for (int64_t i = 0; i < k; ++i)
    local[i] = values[static_cast<size_t>(i)].second;
  auto all = torch::empty({world * k}, torch::kDouble);
  // Every rank's file has the same names (the registry starts with all of them), so the
  // same size; a rank with other names would be refused here, naming both.
  comm.allgather(all, local, decent_dp::AllgatherOptions{{}, {}, "per-rank metrics"})->wait();
  if (rank != 0)
    return;
  auto table = all.view({world, k});
  nlohmann::json merged = nlohmann::json::object();
  for (int64_t i = 0; i < k; ++i) {
    auto column = table.select(1, i);
    const auto [lo, lo_at] = column.min(0);
    const auto [hi, hi_at] = column.max(0);
    merged[values[static_cast<size_t>(i)].first] = {
        {"sum", column.sum().item<double>()}, {"mean", column.mean().item<double>()},
        {"min", lo.item<double>()},           {"min_rank", lo_at.item<int64_t>()},
        {"max", hi.item<double>()},           {"max_rank", hi_at.item<int64_t>()}};
  }
  std::ofstream(out_dir + "/metrics_summary.json")
      << nlohmann::json{{"world_size", world}, {"metrics", merged}}.dump(2) << "\n";
}

int run(const Config& cfg) {
  at::set_num_threads(cfg.threads);
  auto comm = decent_dp::default_communicator();
  const int rank = comm->rank(), world = comm->size();
  auto mpi = std::dynamic_pointer_cast<decent_dp::MpiCommunicator>(comm);
  const bool tty =
      rank == 0 && (cfg.progress == "bar" || (cfg.progress == "auto" && isatty(1) == 1));

  // ---- data ----
  ex::Dataset train = ex::take(ex::load_dataset(cfg.dataset, cfg.data_dir, true), cfg.train_subset);
  ex::Dataset test = ex::take(ex::load_dataset(cfg.dataset, cfg.data_dir, false), cfg.test_subset);
  ex::Transform test_tf;
  std::tie(test_tf.mean, test_tf.stdev) = ex::channel_stats(train);
  ex::Transform train_tf = test_tf;
  const bool cifar = cfg.dataset.rfind("cifar", 0) == 0;
  if (cfg.augment == "crop-flip" || (cfg.augment == "auto" && cifar)) {
    train_tf.random_crop = true;
    train_tf.horizontal_flip = true;
  }
  ex::Sharder sharder(train.labels, train.num_classes, world, cfg.seed, cfg.noniid_alpha);
  // Attack emulation: the attacking ranks train on flipped labels (the split above used the
  // true ones, so every rank computes the same shards).
  const std::vector<int> flipping =
      ex::attacking_ranks(world, cfg.flip_ranks, cfg.flip_fraction, cfg.seed);
  if (std::binary_search(flipping.begin(), flipping.end(), rank))
    train = ex::flip_labels(train, ex::flip_map(cfg.flip_mode, train.num_classes, cfg.seed));
  const int64_t steps_per_epoch = sharder.samples_per_rank() / cfg.batch;
  if (steps_per_epoch < 1)
    throw std::invalid_argument(fmt::format(
        "--batch: {} images per rank cannot fill one batch of {}; expected a batch of at most "
        "{} or more training images",
        sharder.samples_per_rank(), cfg.batch, sharder.samples_per_rank()));

  // ---- model and runner ----
  torch::manual_seed(static_cast<int64_t>(cfg.seed));
  Model net = ex::make_model(cfg.model, train.channels(), train.num_classes, train.image_size());
  const c10::Device device =
      cfg.device == "cuda" ? decent_dp::local_device(*comm) : c10::Device(c10::kCPU);
  if (cfg.device == "cuda" && !device.is_cuda())
    throw std::invalid_argument("--device cuda: rank " + std::to_string(rank) +
                                " sees no CUDA device (expected cpu or a machine with a GPU)");
  const bool amp = cfg.amp == "bf16";
  net->to(device);
  decent_dp::DataParallelOptions options;
  options.topology = cfg.topology;
  options.bucket_cap_mb = cfg.bucket_cap_mb;
  options.local_world_size = cfg.lws;
  options.sync_buffers_in_global_avg = true;
  if (cfg.mode != "decentralized" && (cfg.aggregator != "auto" || cfg.codec != "none"))
    throw std::invalid_argument("--aggregator and --codec apply to --mode decentralized, not " +
                                cfg.mode);
  if (cfg.mode == "local" && cfg.dp_clip > 0)
    throw std::invalid_argument(
        "--dp-clip applies to --mode decentralized or allreduce (local training shares "
        "nothing), not local");
  if (cfg.dp_sigma > 0 && cfg.dp_clip == 0)
    throw std::invalid_argument(
        fmt::format("--dp-sigma {} needs --dp-clip > 0 (the noise is sigma times the clip norm)",
                    cfg.dp_sigma));
  if (cfg.dp_delta <= 0 || cfg.dp_delta >= 1)
    throw std::invalid_argument(fmt::format("--dp-delta must be in (0, 1), got {}", cfg.dp_delta));
  options.privacy.clip_norm = cfg.dp_clip;
  options.privacy.noise_multiplier = cfg.dp_sigma;
  options.privacy.seed = cfg.seed;
  // The accountant's view of a step: each rank's batch is a sample of rate q of its shard.
  const double dp_rate = static_cast<double>(cfg.batch) / sharder.samples_per_rank();
  auto epsilon_after = [&](int64_t steps) {
    if (cfg.dp_clip <= 0)
      return std::numeric_limits<double>::quiet_NaN();
    return decent_dp::privacy::epsilon(dp_rate,
                                       decent_dp::privacy::per_example_multiplier(cfg.dp_sigma),
                                       steps, cfg.dp_delta)
        .epsilon;
  };
  if (cfg.aggregator == "mean")
    options.aggregator = std::make_shared<decent_dp::MeanAggregator>();
  else if (cfg.aggregator == "median")
    options.aggregator = std::make_shared<decent_dp::MedianAggregator>();
  else if (cfg.aggregator == "trimmed-mean")
    options.aggregator = std::make_shared<decent_dp::TrimmedMeanAggregator>(cfg.trim);
  if (cfg.codec == "quantize")
    options.codec = std::make_shared<decent_dp::QuantizeCodec>(cfg.codec_bits, cfg.codec_chunk);
  else if (cfg.codec == "quantize-ec")
    options.codec = std::make_shared<decent_dp::ErrorCompensatedCodec>(
        std::make_shared<decent_dp::QuantizeCodec>(cfg.codec_bits, cfg.codec_chunk));
  else if (cfg.codec == "zstd")
    options.codec = std::make_shared<decent_dp::ZstdCodec>(cfg.codec_level);
  else if (cfg.codec == "fpzip")
    options.codec = std::make_shared<decent_dp::FpzipCodec>();
  auto optim_fn = make_optimizer(cfg);
  auto sched_fn = make_schedule(cfg, steps_per_epoch);
  std::unique_ptr<Runner> runner;
  std::string label = cfg.mode;
  if (cfg.mode == "decentralized") {
    auto g = std::make_unique<GossipRunner>(net, options, optim_fn, sched_fn, comm);
    label = g->topology().name();
    runner = std::move(g);
  } else if (cfg.mode == "allreduce") {
    runner = std::make_unique<AllReduceRunner>(net, options, optim_fn, sched_fn, comm);
    label = "allreduce";
  } else {
    runner = std::make_unique<LocalRunner>(net, optim_fn, sched_fn, comm);
  }
  runner->train(true);

  // ---- output ----
  const std::string out_dir =
      cfg.output.empty() ? fmt::format("runs/{}-{}-{}-n{}", cfg.dataset, cfg.model, label, world)
                         : cfg.output;
  nlohmann::json config_json = to_json(cfg);
  config_json["output"] = out_dir;
  config_json["world_size"] = world;
  config_json["label"] = label;
  config_json["flipping_ranks"] = flipping;
  std::ofstream jsonl, csv, consensus_csv;
  if (rank == 0) {
    make_dirs(out_dir);
    std::ofstream(out_dir + "/config.json") << config_json.dump(2) << "\n";
    jsonl.open(out_dir + "/metrics.jsonl", std::ios::trunc);
    csv.open(out_dir + "/metrics.csv", std::ios::trunc);
    if (cfg.resume.empty()) {  // a resume keeps the lines up to its checkpoint
      consensus_csv.open(out_dir + "/consensus.csv", std::ios::trunc);
      consensus_csv << "step,consensus_distance\n";
    }
    if (!jsonl || !csv)
      throw std::invalid_argument("--output: cannot write to " + out_dir);
    csv << "epoch,train_loss,train_acc,test_acc,local_test_acc,consensus_distance,lr,"
           "images_per_s,step_ms,exchange_wait_ms,data_wait_ms,data_wait_frac,"
           "bytes_sent_per_rank,bytes_received_per_rank,train_time_s,wall_time_s,epsilon\n";
    fmt::print(
        "# resnet_cifar: {} ({} parameters) on {} ({} train / {} test images, {}x{}x{}), "
        "{} ranks, mode {}, {} + {}, lr {}, batch {} per rank, {} epochs of {} steps, "
        "{} thread(s) per rank\n# output: {}\n",
        cfg.model, ex::parameter_count(*net), cfg.dataset, train.size(), test.size(),
        train.channels(), train.image_size(), train.image_size(), world, label, cfg.optimizer,
        cfg.schedule, cfg.lr, cfg.batch, cfg.epochs, steps_per_epoch, cfg.threads, out_dir);
    if (options.aggregator || options.codec)
      fmt::print("# exchange: {}{}\n", options.aggregator ? options.aggregator->name() : "mean",
                 options.codec ? " of " + options.codec->name() : std::string());
    if (cfg.dp_clip > 0)
      fmt::print(
          "# privacy: batch gradients clipped to {} with noise sigma {}; accountant: sampling "
          "rate {:.4g}, noise multiplier {} per example, delta {}\n",
          cfg.dp_clip, cfg.dp_sigma, dp_rate,
          decent_dp::privacy::per_example_multiplier(cfg.dp_sigma), cfg.dp_delta);
    if (!flipping.empty())
      fmt::print("# attack: rank(s) {} train on labels flipped by {}\n", fmt::join(flipping, ","),
                 cfg.flip_mode);
    std::fflush(stdout);
  }

  // ---- resume: the runner's state, the finished epochs' rows, the generator ----
  std::vector<Row> rows;
  double train_time = 0, wall_before = 0;
  int first_epoch = 1;
  if (!cfg.resume.empty()) {
    const decent_dp::NamedTensors user = runner->load(cfg.resume);
    auto get = [&](const std::string& name) {
      for (const auto& [k, v] : user)
        if (k == name)
          return v;
      throw std::invalid_argument("--resume: " + cfg.resume + " holds no trainer state '" + name +
                                  "'; expected a checkpoint saved by --checkpoint-every");
    };
    first_epoch = static_cast<int>(get("epoch").item<int64_t>()) + 1;
    train_time = get("train_time_s").item<double>();
    wall_before = get("wall_time_s").item<double>();
    rows = rows_from_tensor(get("rows"));
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(get("cpu_generator"));
    }
    if (first_epoch > cfg.epochs + 1 || static_cast<int>(rows.size()) != first_epoch - 1)
      throw std::invalid_argument(
          fmt::format("--resume: the checkpoint finished epoch {}; --epochs is {}", first_epoch - 1,
                      cfg.epochs));
    if (rank == 0) {
      for (const Row& r : rows)
        write_row(jsonl, csv, r);
      keep_consensus_until(out_dir + "/consensus.csv", consensus_csv,
                           static_cast<int64_t>(first_epoch - 1) * steps_per_epoch);
      fmt::print("# resumed from {} after epoch {} (step {})\n", cfg.resume, first_epoch - 1,
                 (first_epoch - 1) * steps_per_epoch);
      std::fflush(stdout);
    }
  }

  // ---- training ----
  const int log_every = cfg.log_every > 0
                            ? cfg.log_every
                            : static_cast<int>(std::max<int64_t>(1, steps_per_epoch / 10));
  const auto start = Clock::now();
  uint64_t sent0 = mpi ? sent_bytes(mpi->stats()) : 0;
  uint64_t received0 = mpi ? received_bytes(mpi->stats()) : 0;
  const decent_dp::MpiStats wire0 = mpi ? mpi->stats() : decent_dp::MpiStats{};
  double data_wait_total = 0, eval_total = 0;
  const double train_time_at_start = train_time;
  int64_t trained_steps = 0;
  for (int epoch = first_epoch; epoch <= cfg.epochs; ++epoch) {
    ex::BatchLoader loader(train, sharder.indices(rank, epoch), cfg.batch, train_tf,
                           cfg.seed * 1000003 + static_cast<uint64_t>(rank) * 7919 + epoch);
    const double wait0 = runner->exchange_wait_seconds();
    double loss_sum = 0, correct = 0, seen = 0;
    const auto t0 = Clock::now();
    ex::Batch batch;
    int64_t step = 0;
    while (loader.next(batch)) {
      batch.x = batch.x.to(device);
      batch.y = batch.y.to(device);
      torch::Tensor out, loss;
      {
        AmpScope scope(device, amp);
        out = runner->forward(batch.x);
        loss = torch::nn::functional::cross_entropy(out, batch.y);
      }
      loss.backward();
      runner->after_backward();
      ++step;
      const int64_t global_step = (epoch - 1) * steps_per_epoch + step;
      if (cfg.consensus_every > 0 && global_step % cfg.consensus_every == 0) {
        // Collective: every rank is here. Its traffic is not the training's and is left out:
        // the exchange in flight is finished first so that only the measurement's own
        // all-reduces fall between the two readings (the parameters are not changed).
        runner->synchronize();
        const auto before = mpi ? mpi->stats() : decent_dp::MpiStats{};
        const double d = runner->consensus_distance();
        if (mpi) {
          sent0 += sent_bytes(mpi->stats()) - sent_bytes(before);
          received0 += received_bytes(mpi->stats()) - received_bytes(before);
        }
        if (rank == 0)
          consensus_csv << global_step << "," << fmt::format("{:.6e}", d) << "\n" << std::flush;
      }
      const double l = loss.item<double>();
      loss_sum += l * batch.y.size(0);
      correct += out.argmax(1).eq(batch.y).sum().item<double>();
      seen += batch.y.size(0);
      if (rank == 0 && (tty || step % log_every == 0 || step == steps_per_epoch)) {
        const double el = std::chrono::duration<double>(Clock::now() - t0).count();
        const double per_step = el / step;
        const double eta =
            per_step * ((cfg.epochs - epoch) * steps_per_epoch + steps_per_epoch - step);
        const std::string line = fmt::format(
            "epoch {}/{}  step {}/{}  loss {:.4f}  {:.0f} images/s  ETA {}", epoch, cfg.epochs,
            step, steps_per_epoch, l, step * cfg.batch * world / el, duration(eta));
        if (tty)
          fmt::print("\r{:<80}", line);
        else
          fmt::print("{}\n", line);
        std::fflush(stdout);
      }
    }
    runner->synchronize();
    // Training traffic only: the evaluation's averaging below is not counted.
    const uint64_t sent = mpi ? sent_bytes(mpi->stats()) : 0;
    const uint64_t received = mpi ? received_bytes(mpi->stats()) : 0;
    const double epoch_s = std::chrono::duration<double>(Clock::now() - t0).count();
    train_time += epoch_s;
    data_wait_total += loader.wait_seconds();
    trained_steps += step;
    const auto eval0 = Clock::now();
    if (tty)
      fmt::print("\n");

    // ---- evaluation ----
    auto [local_c, local_n] =
        evaluate(*runner, test, test_tf, rank, world, cfg.eval_batch, device, amp);
    const double consensus = runner->consensus_distance();
    const int64_t end_step = epoch * steps_per_epoch;
    if (rank == 0 && !(cfg.consensus_every > 0 && end_step % cfg.consensus_every == 0))
      consensus_csv << end_step << "," << fmt::format("{:.6e}", consensus) << "\n" << std::flush;
    runner->begin_average();
    auto [avg_c, avg_n] =
        evaluate(*runner, test, test_tf, rank, world, cfg.eval_batch, device, amp);
    runner->end_average();
    eval_total += std::chrono::duration<double>(Clock::now() - eval0).count();
    std::vector<double> sums = {loss_sum,
                                correct,
                                seen,
                                local_c,
                                local_n,
                                avg_c,
                                avg_n,
                                epoch_s,
                                runner->exchange_wait_seconds() - wait0,
                                loader.wait_seconds(),
                                static_cast<double>(sent - sent0),
                                static_cast<double>(received - received0)};
    sum_all(*comm, sums);
    sent0 = mpi ? sent_bytes(mpi->stats()) : 0;
    received0 = mpi ? received_bytes(mpi->stats()) : 0;
    Row r;
    r.epoch = epoch;
    r.loss = sums[0] / sums[2];
    r.train_acc = sums[1] / sums[2];
    r.local_acc = sums[3] / sums[4];
    r.test_acc = sums[5] / sums[6];
    r.consensus = consensus;
    r.lr = runner->lr();
    r.step_ms = 1e3 * sums[7] / world / steps_per_epoch;
    r.ips = sums[2] / (sums[7] / world);
    r.wait_ms = 1e3 * sums[8] / world / steps_per_epoch;
    r.data_ms = 1e3 * sums[9] / world / steps_per_epoch;
    r.sent = sums[10] / world;
    r.received = sums[11] / world;
    r.train_s = train_time;
    r.wall_s = wall_before + std::chrono::duration<double>(Clock::now() - start).count();
    r.epsilon = epsilon_after(end_step);
    rows.push_back(r);
    if (rank == 0) {
      write_row(jsonl, csv, r);
      fmt::print(
          "epoch {}/{}  train loss {:.4f} acc {:.2f}%  test acc {:.2f}% (averaged model), "
          "{:.2f}% (local models)  consensus {:.3e}  {:.1f} ms/step\n",
          epoch, cfg.epochs, r.loss, 100 * r.train_acc, 100 * r.test_acc, 100 * r.local_acc,
          r.consensus, r.step_ms);
      if (!std::isnan(r.epsilon))
        fmt::print("epoch {}/{}  privacy: ({:.4g}, {:g})-DP per training example so far\n", epoch,
                   cfg.epochs, r.epsilon, cfg.dp_delta);
      std::fflush(stdout);
    }
    if (cfg.checkpoint_every > 0 && epoch % cfg.checkpoint_every == 0) {
      const std::string dir = out_dir + "/checkpoint";
      runner->save(dir, {{"epoch", torch::full({1}, epoch, torch::kLong)},
                         {"train_time_s", torch::full({1}, train_time, torch::kDouble)},
                         {"wall_time_s", torch::full({1}, r.wall_s, torch::kDouble)},
                         {"rows", rows_to_tensor(rows)},
                         {"cpu_generator", cpu_generator_state()}});
      if (rank == 0) {
        fmt::print("checkpoint: epoch {} saved to {}\n", epoch, dir);
        std::fflush(stdout);
      }
    }
  }
  if (rows.empty())
    throw std::invalid_argument("--resume: the checkpoint has no finished epoch to report");

  // ---- per-rank metrics (this process's run: a resumed run counts from its resume) ----
  {
    const decent_dp::MpiStats wire = mpi ? mpi->stats() : decent_dp::MpiStats{};
    const double session_train_s = train_time - train_time_at_start;
    const double wait_s = runner->exchange_wait_seconds();
    nlohmann::json mine = {
        {"rank", rank},
        {"world_size", world},
        {"flipping_labels", std::binary_search(flipping.begin(), flipping.end(), rank)},
        {"trainer",
         {{"steps", trained_steps},
          {"train_s", session_train_s},
          {"data_wait_s", data_wait_total},
          {"exchange_wait_s", wait_s},
          {"compute_s", session_train_s - data_wait_total - wait_s},
          {"evaluate_s", eval_total}}},
        {"wire",
         {{"bytes_sent", sent_bytes(wire) - sent_bytes(wire0)},
          {"bytes_received", received_bytes(wire) - received_bytes(wire0)}}}};
    if (const decent_dp::Metrics* m = runner->metrics())
      mine["library"] = nlohmann::json::parse(m->to_json());
    write_rank_metrics(*comm, out_dir, mine);
  }

  // ---- summary ----
  if (rank == 0) {
    fmt::print("\n{:>5} {:>10} {:>9} {:>9} {:>10} {:>11} {:>10} {:>9} {:>9} {:>8} {:>8} {:>11}\n",
               "epoch", "train loss", "train acc", "test acc", "local acc", "consensus", "lr",
               "images/s", "ms/step", "wait ms", "data ms", "MB sent");
    double best = 0;
    for (const auto& r : rows) {
      best = std::max(best, r.test_acc);
      fmt::print(
          "{:>5} {:>10.4f} {:>8.2f}% {:>8.2f}% {:>9.2f}% {:>11.3e} {:>10.3e} {:>9.1f} {:>9.1f} "
          "{:>8.2f} {:>8.2f} {:>11.2f}\n",
          r.epoch, r.loss, 100 * r.train_acc, 100 * r.test_acc, 100 * r.local_acc, r.consensus,
          r.lr, r.ips, r.step_ms, r.wait_ms, r.data_ms, r.sent / 1e6);
    }
    const Row& last = rows.back();
    double bytes = 0, step_ms = 0;
    for (const auto& r : rows) {
      bytes += r.sent;
      step_ms += r.step_ms;
    }
    const nlohmann::json summary = {
        {"label", label},
        {"mode", cfg.mode},
        {"topology", cfg.mode == "decentralized" ? label : ""},
        {"world_size", world},
        {"model", cfg.model},
        {"dataset", cfg.dataset},
        {"epochs", cfg.epochs},
        {"steps_per_epoch", steps_per_epoch},
        {"final_test_acc", last.test_acc},
        {"best_test_acc", best},
        {"final_local_test_acc", last.local_acc},
        {"final_consensus_distance", last.consensus},
        {"step_ms", step_ms / rows.size()},
        {"bytes_sent_per_step", bytes / (static_cast<double>(steps_per_epoch) * rows.size())},
        {"data_wait_frac", last.data_ms / last.step_ms},
        {"train_time_s", last.train_s},
        {"wall_time_s", last.wall_s},
        {"epsilon", epsilon_json(last.epsilon)},
        {"delta", cfg.dp_clip > 0 ? nlohmann::json(cfg.dp_delta) : nlohmann::json(nullptr)}};
    std::ofstream(out_dir + "/summary.json") << summary.dump(2) << "\n";
    fmt::print(
        "final: test accuracy {:.2f}% (averaged model), best {:.2f}%, {:.1f} ms/step, "
        "{:.2f} MB sent per step and rank; results in {}\n",
        100 * last.test_acc, 100 * best, step_ms / rows.size(),
        bytes / (static_cast<double>(steps_per_epoch) * rows.size()) / 1e6, out_dir);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  Config cfg;
  std::string config_path;
  CLI::App app{
      "decent_dp trainer: ResNets and small networks on Fashion-MNIST / CIFAR, "
      "decentralized, all-reduce or local"};
  bind(app, cfg, config_path);
  try {
    std::vector<std::string> args = with_config(argc, argv);
    args.erase(args.begin());                // CLI11 takes the arguments without the program name,
    std::reverse(args.begin(), args.end());  // in reverse order
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    return run(cfg);
  } catch (const std::exception& e) {
    int rank = 0, size = 1, init = 0;
    MPI_Initialized(&init);
    if (init) {
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
    }
    std::fprintf(stderr, "[rank %d/%d] error: %s\n", rank, size, e.what());
    std::fflush(stderr);
    if (size > 1)
      MPI_Abort(MPI_COMM_WORLD, 2);  // ends every rank: none is left waiting on this one
    return 2;
  }
}
