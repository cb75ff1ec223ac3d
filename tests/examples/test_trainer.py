"""The resnet_cifar trainer under mpiexec -n 2 on a small slice of the real Fashion-MNIST data:
every mode trains one epoch above chance and writes its JSON, CSV and summary; a JSON config
is read and flags override it; a run stopped after a checkpoint and resumed in new processes
ends exactly where an uninterrupted run does; bad settings and missing data end every rank
with a message.

  python tests/examples/test_trainer.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import csv
import json
import os
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decent_dp_runs as runs  # noqa: E402

TRAINER = runs.find_trainer()
FIELDS = ["epoch", "train_loss", "train_acc", "test_acc", "local_test_acc", "consensus_distance",
          "lr", "images_per_s", "step_ms", "exchange_wait_ms", "data_wait_ms", "data_wait_frac",
          "bytes_sent_per_rank", "bytes_received_per_rank", "train_time_s", "wall_time_s",
          "epsilon"]
SMALL = ["--train-subset", "2048", "--test-subset", "1000", "--epochs", "1", "--progress",
         "lines", "--threads", "1"]


def trainer(args, ranks=2, timeout=240):
    # Through run_mpirun: the error cases exit non-zero (Note [mpirun lingering]).
    return runs.run_mpirun(runs.mpirun_prefix(ranks) + [TRAINER] + args, timeout=timeout,
                           env=runs.mpirun_env())


class Trainer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
            raise unittest.SkipTest("Debian's dataset-fashion-mnist is not installed "
                                    "(scripts/bootstrap installs it)")
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check_run(self, out, mode, expect_traffic):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual(len(rows), 1)
        row = rows[0]
        for k in FIELDS:
            self.assertIn(k, row, f"{mode}: metrics.jsonl lacks {k}")
        with open(os.path.join(out, "metrics.csv")) as f:
            table = list(csv.DictReader(f))
        self.assertEqual(len(table), 1)
        self.assertEqual(list(table[0].keys()), FIELDS)
        self.assertAlmostEqual(float(table[0]["test_acc"]), row["test_acc"], places=5)
        # Real data, 1024 images per rank, one epoch: well above chance (10%).
        self.assertGreater(row["test_acc"], 0.4, f"{mode}: averaged model at chance")
        self.assertGreater(row["local_test_acc"], 0.4, f"{mode}: local models at chance")
        self.assertLess(row["train_loss"], 2.2)
        self.assertEqual(row["bytes_sent_per_rank"] > 0, expect_traffic, mode)
        self.assertGreater(row["step_ms"], 0)
        self.assertIsNone(row["epsilon"], f"{mode}: epsilon without differential privacy")
        self.assertEqual(table[0]["epsilon"], "")
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["world_size"], 2)
        self.assertEqual(summary["steps_per_epoch"], 1024 // 32)
        # One metrics file per rank and rank 0's merge of them.
        for r in (0, 1):
            with open(os.path.join(out, f"{r}.metrics.json")) as f:
                per_rank = json.load(f)
            self.assertEqual(per_rank["rank"], r)
            self.assertEqual(per_rank["trainer"]["steps"], 1024 // 32)
            self.assertEqual("library" in per_rank, mode != "local", mode)
        with open(os.path.join(out, "metrics_summary.json")) as f:
            merged = json.load(f)["metrics"]
        self.assertEqual(merged["trainer.steps"]["sum"], 2 * (1024 // 32))
        if mode != "local":
            # The library's count of the exchanges' bytes is the trainer's training traffic
            # less the wrapper's one-time checks of the first step (a few hundred bytes).
            counted = merged["library.counters.exchange.bytes_sent"]["mean"]
            self.assertLessEqual(counted, row["bytes_sent_per_rank"])
            self.assertGreater(counted, 0.99 * row["bytes_sent_per_rank"])
            self.assertEqual(merged["library.counters.steps"]["min"], 1024 // 32)
        return row

    def test_every_mode(self):
        sent = {}
        for mode, extra, traffic in (("decentralized",
                                      ["--topology", "ring", "--consensus-every", "8"], True),
                                     ("allreduce", ["--noniid-alpha", "0.5"], True),
                                     ("local", [], False)):
            with self.subTest(mode=mode):
                out = os.path.join(self.tmp.name, mode)
                r = trainer(SMALL + ["--mode", mode, "--output", out] + extra)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertIn("final: test accuracy", r.stdout)
                row = self.check_run(out, mode, traffic)
                sent[mode] = row["bytes_sent_per_rank"]
                if mode == "allreduce":
                    self.assertEqual(row["consensus_distance"], 0)
                if mode == "local":
                    self.assertGreater(row["consensus_distance"], 0)
                with open(os.path.join(out, "consensus.csv")) as f:
                    steps = [int(r["step"]) for r in csv.DictReader(f)]
                # Every 8 steps when asked (the epoch's last step is one of them), else only at
                # the end of the epoch.
                self.assertEqual(steps, [8, 16, 24, 32] if mode == "decentralized" else [32])
        # With 2 ranks a gossip step (parameter blocks) and an all-reduce step (gradient blocks
        # of the same layout) move the same bytes: the consensus measurements' all-reduces
        # are not counted as training traffic.
        self.assertEqual(sent["decentralized"], sent["allreduce"])

    def test_config_file_and_flags(self):
        cfg = os.path.join(self.tmp.name, "run.json")
        with open(cfg, "w") as f:
            json.dump({"model": "mlp", "batch": 64, "optimizer": "sgd", "lr": 0.05,
                       "train-subset": 1024, "test-subset": 500, "epochs": 1,
                       "progress": "lines", "schedule": "step"}, f)
        out = os.path.join(self.tmp.name, "config")
        r = trainer(["--config", cfg, "--batch", "16", "--output", out])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(os.path.join(out, "config.json")) as f:
            used = json.load(f)
        self.assertEqual(used["model"], "mlp")        # from the file
        self.assertEqual(used["optimizer"], "sgd")
        self.assertEqual(used["batch"], 16)           # the flag wins
        with open(os.path.join(out, "summary.json")) as f:
            self.assertEqual(json.load(f)["steps_per_epoch"], 512 // 16)

    def test_resume_is_exact(self):
        # Epoch 1 with a checkpoint, then epoch 2 in new processes from it == two epochs in one
        # run, to the last bit of every result (the step schedule halves the lr between them).
        base = ["--train-subset", "1024", "--test-subset", "500", "--progress", "lines",
                "--threads", "1", "--model", "cnn", "--schedule", "step", "--step-epochs", "1",
                "--gamma", "0.5"]
        exact = ["train_loss", "train_acc", "test_acc", "local_test_acc", "consensus_distance",
                 "lr"]
        for mode, extra in (("decentralized", ["--topology", "ring", "--consensus-every", "5"]),
                            ("allreduce", []), ("local", [])):
            with self.subTest(mode=mode):
                whole = os.path.join(self.tmp.name, f"whole-{mode}")
                parts = os.path.join(self.tmp.name, f"parts-{mode}")
                args = base + ["--mode", mode] + extra
                r = trainer(args + ["--epochs", "2", "--output", whole])
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                r = trainer(args + ["--epochs", "1", "--checkpoint-every", "1", "--output", parts])
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertIn("checkpoint: epoch 1 saved to", r.stdout)
                r = trainer(args + ["--epochs", "2", "--output", parts, "--resume",
                                    os.path.join(parts, "checkpoint")])
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                self.assertIn("resumed from", r.stdout)
                rows = {}
                for name, out in (("whole", whole), ("parts", parts)):
                    with open(os.path.join(out, "metrics.jsonl")) as f:
                        rows[name] = [json.loads(line) for line in f]
                self.assertEqual([x["epoch"] for x in rows["parts"]], [1, 2])
                for k in exact:
                    self.assertEqual(rows["parts"][1][k], rows["whole"][1][k], f"{mode}: {k}")
                with open(os.path.join(parts, "consensus.csv")) as f:
                    steps = [int(line.split(",")[0]) for line in list(f)[1:]]
                self.assertEqual(steps, sorted(set(steps)), f"{mode}: consensus.csv repeats")
        # A folder that holds no checkpoint: every rank ends with the reason.
        r = trainer(base + ["--resume", os.path.join(self.tmp.name, "nothing"), "--output",
                            os.path.join(self.tmp.name, "nothing-out")], timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("is incomplete or missing", r.stderr)

    def test_quantized_trimmed_exchange_and_label_flipping(self):
        # 8-bit quantized gossip sends about a quarter of the float32 bytes (chunks of 1024:
        # 25.2%) and still trains; the trimmed mean refuses pair groups; a flipping rank is
        # named in config.json.
        outs = {}
        for name, extra in (("float", ["--aggregator", "mean"]),
                            ("q8", ["--aggregator", "mean", "--codec", "quantize"])):
            out = os.path.join(self.tmp.name, "exchange-" + name)
            r = trainer(SMALL + ["--topology", "ring", "--output", out] + extra)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            outs[name] = self.check_run(out, name, True)
        self.assertIn("# exchange: mean of quantize(8 bit, chunk 1024)", r.stdout)
        share = outs["q8"]["bytes_sent_per_rank"] / outs["float"]["bytes_sent_per_rank"]
        self.assertGreater(share, 0.25)
        self.assertLess(share, 0.27)
        r = trainer(SMALL + ["--topology", "ring", "--aggregator", "trimmed-mean", "--output",
                             os.path.join(self.tmp.name, "trim-ring")], timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("aggregator trimmed-mean(b=1) drops 1 values at each end", r.stderr)
        out = os.path.join(self.tmp.name, "flip")
        r = trainer(SMALL + ["--flip-ranks", "1", "--flip-mode", "permutation", "--output", out])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("# attack: rank(s) 1 train on labels flipped by permutation", r.stdout)
        with open(os.path.join(out, "config.json")) as f:
            self.assertEqual(json.load(f)["flipping_ranks"], [1])
        r = trainer(SMALL + ["--flip-ranks", "2"], timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--flip-ranks: expected ranks in [0, 1]", r.stderr)
        r = trainer(SMALL + ["--mode", "allreduce", "--codec", "quantize"], timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--aggregator and --codec apply to --mode decentralized", r.stderr)

    def test_differential_privacy(self):
        # The Gaussian mechanism on the batch gradients: epsilon grows each epoch and is what
        # the accountant gives for q = batch / shard, sigma / 2 per example and the steps so
        # far; a run without it reports none; local training refuses it.
        out = os.path.join(self.tmp.name, "dp")
        args = ["--train-subset", "1024", "--test-subset", "500", "--epochs", "2", "--progress",
                "lines", "--threads", "1", "--dp-clip", "1", "--dp-sigma", "1.5",
                "--dp-delta", "1e-4", "--output", out]
        r = trainer(args)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("# privacy: batch gradients clipped to 1 with noise sigma 1.5", r.stdout)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        eps = [row["epsilon"] for row in rows]
        # q = 32 / 512, sigma 0.75 per example, 16 and 32 steps, delta 1e-4. Epoch 2 (order 3)
        # is dp_accounting 0.6.0's RdpAccountant on the same orders to every digit; epoch 1
        # (order 3.25) the numerically integrated RDP (its series is 1.6e-4 high there, see
        # tests/unit/test_privacy.cpp).
        self.assertAlmostEqual(eps[0], 4.27531470, places=6)
        self.assertAlmostEqual(eps[1], 5.23837132, places=6)
        self.assertIn("privacy: (", r.stdout)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        self.assertEqual(summary["epsilon"], eps[1])
        self.assertEqual(summary["delta"], 1e-4)
        # Clipping alone learns (and promises nothing: epsilon is infinite).
        out = os.path.join(self.tmp.name, "clip")
        r = trainer(SMALL + ["--dp-clip", "5", "--output", out])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            row = json.loads(f.readline())
        self.assertEqual(row["epsilon"], "inf")
        self.assertGreater(row["test_acc"], 0.4)
        for bad, message in ((["--mode", "local", "--dp-clip", "1"],
                              "--dp-clip applies to --mode decentralized or allreduce"),
                             (["--dp-sigma", "1"], "--dp-sigma 1 needs --dp-clip > 0")):
            r = trainer(SMALL + bad, ranks=1, timeout=60)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(message, r.stderr)

    def test_bf16_autocast(self):
        # Autocast of forward and loss to bfloat16 (here on the CPU): it trains as float
        # does, within bfloat16's rounding, and the run records the setting.
        accs, losses = {}, {}
        for amp in ("off", "bf16"):
            out = os.path.join(self.tmp.name, "amp-" + amp)
            r = trainer(SMALL + ["--mode", "decentralized", "--topology", "ring", "--amp", amp,
                                 "--output", out])
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            row = self.check_run(out, "decentralized", True)
            accs[amp] = row["test_acc"]
            losses[amp] = row["train_loss"]
            with open(os.path.join(out, "config.json")) as f:
                self.assertEqual(json.load(f)["amp"], amp)
        self.assertLess(abs(accs["bf16"] - accs["off"]), 0.05, accs)
        # bfloat16 arithmetic did run: the losses are not the float run's.
        self.assertNotEqual(losses["bf16"], losses["off"])
        # A GPU asked for where there is none is an error naming the flag.
        r = trainer(SMALL + ["--device", "cuda"], ranks=1, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--device cuda: rank 0 sees no CUDA device", r.stderr)

    def test_bad_settings(self):
        cfg = os.path.join(self.tmp.name, "bad.json")
        with open(cfg, "w") as f:
            json.dump({"bogus": 1}, f)
        r = trainer(["--config", cfg], ranks=1, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("unknown setting 'bogus'", r.stderr)
        r = trainer(["--batch", "0"], ranks=1, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--batch: expected a value > 0, got 0", r.stdout + r.stderr)
        r = trainer(["--model", "resnet19"], ranks=1, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--model", r.stdout + r.stderr)

    def test_errors_end_every_rank(self):
        # Missing data: every rank reports the file and the job ends (no hang).
        r = trainer(["--dataset", "cifar10", "--data-dir", os.path.join(self.tmp.name, "none")],
                    timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("data_batch_1.bin: no such file", r.stderr)
        # A topology the world size does not allow.
        r = trainer(SMALL + ["--topology", "ring", "--output", os.path.join(self.tmp.name, "x")],
                    ranks=3, timeout=120)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ring topology needs an even world size, got 3", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
