"""The six PRE stages of examples/configs (0_baseline ... 5_combined) each run a few steps of
the trainer under mpiexec -n 4 on real Fashion-MNIST images and write valid per-rank metrics
files and their merge; benchmarks/sweep takes the files as points.

  python tests/examples/test_configs.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decent_dp_runs as runs  # noqa: E402

CONFIGS = os.path.join(ROOT, "examples", "configs")
STAGES = ["0_baseline", "1_private", "2_robust", "3_robust_poisoned", "4_quantized", "5_combined"]
RANKS = 4
# 512 images over 4 ranks, batch 32: 4 steps.
FEW_STEPS = ["--train-subset", "512", "--test-subset", "200", "--epochs", "1"]


class Configs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
            raise unittest.SkipTest("Debian's dataset-fashion-mnist is not installed "
                                    "(scripts/bootstrap installs it)")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.trainer = runs.find_trainer()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_six_stages_are_there(self):
        self.assertEqual(sorted(os.path.splitext(f)[0] for f in os.listdir(CONFIGS)
                                if f.endswith(".json")), STAGES)

    def run_stage(self, stage, more=()):
        path = os.path.join(CONFIGS, stage + ".json")
        with open(path) as f:
            settings = json.load(f)
        out = os.path.join(self.tmp.name, stage + "".join(more))
        extra = list(more)
        if settings.get("aggregator") == "trimmed-mean":
            # The configs drop b = 2 of 8 values; 4 ranks form groups of 4, which allow b = 1.
            extra = ["--trim", "1"]
        r = runs.run_mpirun(runs.mpirun_prefix(RANKS) + [self.trainer, "--config", path] +
                            FEW_STEPS + extra + ["--progress", "lines", "--output", out],
                            timeout=300, env=runs.mpirun_env())
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return settings, out, r.stdout

    def test_each_stage_runs_and_writes_valid_metrics(self):
        sent = {}
        for stage in STAGES:
            with self.subTest(stage=stage):
                settings, out, stdout = self.run_stage(stage)
                ranks = []
                for r in range(RANKS):
                    with open(os.path.join(out, f"{r}.metrics.json")) as f:
                        m = json.load(f)
                    self.assertEqual((m["rank"], m["world_size"]), (r, RANKS))
                    lib = m["library"]
                    self.assertEqual(lib["counters"]["steps"], 4)
                    self.assertEqual(m["trainer"]["steps"], 4)
                    self.assertGreater(lib["counters"]["exchange.bytes_sent"], 0)
                    self.assertGreaterEqual(m["trainer"]["compute_s"], 0)
                    gathers = "aggregator" in settings or "codec" in settings
                    self.assertEqual(lib["timers"]["exchange.aggregate"]["count"] > 0, gathers)
                    self.assertEqual(lib["timers"]["exchange.encode"]["count"] > 0,
                                     "codec" in settings)
                    self.assertEqual(lib["timers"]["privacy"]["count"] > 0,
                                     "dp-clip" in settings)
                    ranks.append(m)
                with open(os.path.join(out, "metrics_summary.json")) as f:
                    merged = json.load(f)
                self.assertEqual(merged["world_size"], RANKS)
                sent_mean = merged["metrics"]["library.counters.exchange.bytes_sent"]["mean"]
                self.assertAlmostEqual(
                    sent_mean, sum(m["library"]["counters"]["exchange.bytes_sent"]
                                   for m in ranks) / RANKS)
                sent[stage] = sent_mean
                with open(os.path.join(out, "summary.json")) as f:
                    summary = json.load(f)
                self.assertEqual(summary["epsilon"] is not None, "dp-clip" in settings)
                if "dp-clip" in settings:
                    self.assertGreater(summary["epsilon"], 0)
                with open(os.path.join(out, "config.json")) as f:
                    flipping = json.load(f)["flipping_ranks"]
                self.assertEqual(len(flipping), 1 if "flip-fraction" in settings else 0)
        # 8-bit codes: about a quarter of the bytes of the same exchange in float32 (every
        # member's block to the 3 others). The baseline's all-reduce moves 2 (k - 1) / k of a
        # block instead of k - 1: half the float32 gather's bytes at k = 4.
        _, out, _ = self.run_stage("0_baseline", ["--aggregator", "mean"])
        with open(os.path.join(out, "metrics_summary.json")) as f:
            gather = json.load(f)["metrics"]["library.counters.exchange.bytes_sent"]["mean"]
        self.assertAlmostEqual(sent["0_baseline"] / gather, 0.5, places=3)
        self.assertLess(sent["4_quantized"], 0.27 * gather)
        self.assertGreater(sent["4_quantized"], 0.25 * gather)

    def test_sweep_takes_the_files(self):
        results = os.path.join(self.tmp.name, "results")
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep")] + \
            [os.path.join(CONFIGS, s + ".json") for s in ("0_baseline", "4_quantized")] + \
            ["--ranks", "2", "--name", "pre", "--results", results, "--quiet",
             "--set", "train-subset=256", "--set", "test-subset=100", "--set", "epochs=1"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("2/2 points finished", r.stdout)
        for point in ("n2_0_baseline", "n2_4_quantized"):
            with open(os.path.join(results, "pre", point, "config.json")) as f:
                used = json.load(f)
            self.assertEqual(used["train-subset"], 256)  # --set wins over the file
            self.assertEqual(used["epochs"], 1)
            self.assertEqual(used["codec"], "quantize-ec" if "quantized" in point else "none")
            self.assertTrue(os.path.exists(os.path.join(results, "pre", point, "1.metrics.json")))
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sweep"),
                            os.path.join(CONFIGS, "0_baseline.json"), "--set", "epochs"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--set expects SETTING=VALUE, got 'epochs'", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
