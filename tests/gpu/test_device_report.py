"""scripts/device_report on what the benchmarks really write: optim_bench and step_bench run
here on the CPU (small), the report reads their JSON, and its verdicts follow the targets
when the figures are moved across them.

  python tests/gpu/test_device_report.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(ROOT, "scripts", "device_report")
BUILD = os.environ.get("DECENT_DP_BUILD_DIR", os.path.join(ROOT, "build"))
BIN = os.path.join(BUILD, "bin")

WRAPPERS = ["DistributedDataParallel (all-reduce)", "DecentralizedDataParallel complete",
            "DecentralizedDataParallel ring"]


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)


class DeviceReport(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.bench = tempfile.mkdtemp(prefix="device_report_")
        # The device check's commands, on the CPU and much shorter.
        for cmd in ([os.path.join(BIN, "optim_bench"), "--iters", "1",
                     "-J", os.path.join(cls.bench, "optim_bench.json")],
                    [os.path.join(BIN, "step_bench"), "--model", "resnet50", "--batch", "2",
                     "--steps", "1", "--rounds", "1", "--warmup", "0", "--no-local-barrier",
                     "-t", "complete", "-t", "ring",
                     "-J", os.path.join(cls.bench, "step_bench_resnet50.json")]):
            r = run(cmd)
            if r.returncode != 0:
                raise AssertionError(f"{cmd[0]} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        with open(os.path.join(cls.bench, "optim_bench.json")) as f:
            cls.optim = json.load(f)
        with open(os.path.join(cls.bench, "step_bench_resnet50.json")) as f:
            cls.step = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.bench, ignore_errors=True)

    def folder(self, optim=None, step=None):
        d = tempfile.mkdtemp(prefix="device_report_case_")
        self.addCleanup(shutil.rmtree, d, True)
        for name, data in (("optim_bench.json", optim), ("step_bench_resnet50.json", step)):
            if data is not None:
                with open(os.path.join(d, name), "w") as f:
                    json.dump(data, f)
        return d

    def report(self, folder, *args):
        return run([sys.executable, REPORT, folder, *args])

    def test_reads_the_benchmarks_output(self):
        d = self.folder(self.optim, self.step)
        r = self.report(d)
        self.assertEqual(r.returncode, 0, r.stderr)
        adamw = next(x for x in self.optim["rows"] if x["case"] == "decent_dp AdamW (flat)")
        percent = 100 * adamw["GBps"] / self.optim["copy_GBps"]
        self.assertIn(f"= {percent:.1f}% of copy", r.stdout)
        local = next(x for x in self.step["rows"] if x["case"] == "local (no communication)")
        self.assertIn(f"{local['ms_per_step']:.2f} ms", r.stdout)
        for case in WRAPPERS:
            row = next(x for x in self.step["rows"] if x["case"] == case)
            self.assertIn(f"| {case} | {row['ms_per_step']:.2f} ms, {row['ratio_to_local']:.3f}x",
                          r.stdout)
        with open(os.path.join(d, "figures.json")) as f:
            figures = json.load(f)
        met = adamw["GBps"] / self.optim["copy_GBps"] >= 0.6 and all(
            x["ratio_to_local"] - 1 < 0.05 for x in self.step["rows"] if x["case"] in WRAPPERS)
        self.assertEqual(figures["targets_met"], met)
        self.assertEqual([c["case"] for c in figures["step"]["cases"]], WRAPPERS)
        self.assertEqual(self.report(d, "--check").returncode, 0 if met else 1)

    def moved(self, fraction, ratios):
        optim = json.loads(json.dumps(self.optim))
        for row in optim["rows"]:
            if row.get("case") == "decent_dp AdamW (flat)":
                row["copy_fraction"] = fraction
        step = json.loads(json.dumps(self.step))
        for row in step["rows"]:
            if row["case"] in WRAPPERS:
                row["ratio_to_local"] = ratios.get(row["case"], 1.01)
        return self.folder(optim, step)

    def test_verdicts_follow_the_targets(self):
        d = self.moved(0.61, {})
        r = self.report(d, "--check")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("targets: all met", r.stdout)

        d = self.moved(0.59, {})
        r = self.report(d, "--check")
        self.assertEqual(r.returncode, 1)
        self.assertIn("59.0% of copy", r.stdout)
        self.assertIn("| >= 60% | MISSED |", r.stdout)
        self.assertEqual(self.report(d).returncode, 0)  # without --check: the table only

        d = self.moved(0.61, {"DecentralizedDataParallel ring": 1.06})
        r = self.report(d, "--check")
        self.assertEqual(r.returncode, 1)
        self.assertIn("1.060x plain (+6.0%) | < +5% | MISSED |", r.stdout)
        self.assertIn("1.010x plain (+1.0%) | < +5% | met |", r.stdout)

    def test_missing_or_wrong_input_is_named(self):
        r = self.report(self.folder(self.optim, None))
        self.assertEqual(r.returncode, 2)
        self.assertIn("step_bench_resnet50.json: not found", r.stderr)

        step = json.loads(json.dumps(self.step))
        step["ranks"] = 2
        r = self.report(self.folder(self.optim, step))
        self.assertEqual(r.returncode, 2)
        self.assertIn("the overhead target is at world size 1, this run had 2 ranks", r.stderr)

        optim = json.loads(json.dumps(self.optim))
        optim["rows"] = [x for x in optim["rows"] if x.get("case") != "decent_dp AdamW (flat)"]
        r = self.report(self.folder(optim, self.step))
        self.assertEqual(r.returncode, 2)
        self.assertIn("no row for case 'decent_dp AdamW (flat)'", r.stderr)

        for bad in ({"rows": 3}, [1, 2], {"rows": [1]}):
            r = self.report(self.folder(bad, self.step))
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("optim_bench.json: ", r.stderr)
            self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main()
