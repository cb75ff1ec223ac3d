"""benchmarks/sweep runs a two-point sweep end to end and resumes it without rerunning;
benchmarks/plot writes its PNGs; examples/05_compare_topologies prints its table and PNG.

  python tests/examples/test_sweep.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


def run(cmd, timeout=400):
    return subprocess.run([sys.executable] + cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG and os.path.getsize(path) > 1000


class Sweep(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def test_sweep_resume_plot(self):
        spec = {"name": "two", "base": {"dataset": "synthetic", "model": "mlp", "epochs": 2,
                                        "train-subset": 1024, "test-subset": 512, "batch": 32},
                "grid": {"ranks": [2], "case": ["allreduce", "ring"]}}
        path = os.path.join(self.tmp.name, "two.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        results = os.path.join(self.tmp.name, "results")
        r = run(["benchmarks/sweep", path, "--results", results, "--quiet"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("2/2 points finished", r.stdout)
        sweep = os.path.join(results, "two")
        points = sorted(d for d in os.listdir(sweep) if os.path.isdir(os.path.join(sweep, d)))
        self.assertEqual(points, ["n2_allreduce", "n2_ring"])
        with open(os.path.join(sweep, "results.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 4)  # 2 points x 2 epochs
        self.assertEqual({r["case"] for r in rows}, {"allreduce", "ring"})
        self.assertTrue(all(float(r["test_acc"]) > 0.3 for r in rows if r["epoch"] == "2"))
        stamp = os.path.getmtime(os.path.join(sweep, "n2_ring", "summary.json"))
        # Resume: nothing runs again.
        r = run(["benchmarks/sweep", path, "--results", results, "--quiet"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.count("done before, skipped"), 2, r.stdout)
        self.assertEqual(os.path.getmtime(os.path.join(sweep, "n2_ring", "summary.json")), stamp)
        # A half-finished sweep: one point's result removed, only that one runs.
        os.remove(os.path.join(sweep, "n2_allreduce", "summary.json"))
        r = run(["benchmarks/sweep", path, "--results", results, "--quiet"])
        self.assertEqual(r.stdout.count("done before, skipped"), 1, r.stdout)
        self.assertIn("n2_allreduce: finished", r.stdout)
        r = run(["benchmarks/plot", sweep])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for png in ("accuracy.png", "step_time_vs_ranks.png", "consensus.png"):
            self.assertTrue(is_png(os.path.join(sweep, png)), png)
        r = run(["benchmarks/plot", os.path.join(self.tmp.name, "nothing")])
        self.assertNotEqual(r.returncode, 0)

    def test_bad_sweep_file(self):
        path = os.path.join(self.tmp.name, "bad.json")
        with open(path, "w") as f:
            json.dump({"name": "bad", "grid": {"case": []}}, f)
        r = run(["benchmarks/sweep", path])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("grid entry 'case' must be a non-empty list", r.stdout + r.stderr)

    def test_compare_topologies(self):
        out = os.path.join(self.tmp.name, "compare")
        r = run(["examples/05_compare_topologies/compare_topologies", "--ranks", "2", "--cases",
                 "complete", "allreduce", "--output", out, "--quiet", "--", "--dataset",
                 "synthetic", "--model", "mlp", "--epochs", "1", "--train-subset", "1024"])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"complete\s+2\s+\d+\.\d+%")
        self.assertRegex(r.stdout, r"allreduce\s+2\s+\d+\.\d+%")
        self.assertTrue(is_png(os.path.join(out, "compare_topologies.png")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
