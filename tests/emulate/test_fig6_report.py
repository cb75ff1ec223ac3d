"""benchmarks/emulate/fig6 --report on finished cells written here (no cluster needed): the
table, the planner's prediction next to each measurement, and the order compared only on the
pairs of topologies whose rounds do not overlap.

  python tests/emulate/test_fig6_report.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIG6 = os.path.join(ROOT, "benchmarks", "emulate", "fig6")
BUILD = os.environ.get("DECENT_DP_BUILD_DIR", os.path.join(ROOT, "build"))

SWEEP = {"name": "cells", "kind": "emulated-step-time", "nodes": [4], "ranks_per_node": 2,
         "rates": ["400mbit"], "global_compute_ms": 600, "params": 2500000, "layers": 8,
         "bucket_mb": 4, "jitter_ms": 0, "steps": 12, "rounds": 3, "warmup": 2,
         "topologies": ["complete", "ring", "exp", "aer"]}
# A calibration of 4 emulated nodes at 400 Mbit/s. With it, 82.6 ms of compute and the
# sleep model's two buckets of 5000192 bytes the planner predicts aer < ring < complete <
# one-peer-exp < all-reduce (175, 294, 331, 374, 391 ms).
CALIBRATION = {"lws": 2, "nodes": 4, "intra_bw_MBps": 1067.2, "inter_bw_MBps": 46.4,
               "flow_bw_MBps": 0.0, "shared_efficiency": 0.809, "ring_efficiency": 0.977}


def cell(rounds):
    names = {"allreduce": "DistributedDataParallel (all-reduce)",
             "complete": "DecentralizedDataParallel complete",
             "ring": "DecentralizedDataParallel ring",
             "one-peer-exp": "DecentralizedDataParallel one-peer-exp",
             "aer": "DecentralizedDataParallel alternating-exp-ring",
             "compute only": "local (no communication)"}
    return {"rows": [{"case": names[k], "ms_per_step": sorted(v)[1], "rounds_ms": v}
                     for k, v in rounds.items()]}


class Report(unittest.TestCase):
    def report(self, rounds):
        with tempfile.TemporaryDirectory() as tmp:
            sweep = os.path.join(tmp, "sweep.json")
            with open(sweep, "w") as f:
                json.dump(SWEEP, f)
            with open(os.path.join(tmp, "4x2_400mbit.json"), "w") as f:
                json.dump(cell(rounds), f)
            with open(os.path.join(tmp, "4x2_400mbit.calibration.json"), "w") as f:
                json.dump(CALIBRATION, f)
            out = subprocess.run([sys.executable, FIG6, sweep, "--report", tmp, "--build-dir",
                                  BUILD], capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(os.path.join(tmp, "table.md")) as f:
                table = f.read()
            self.assertTrue(os.path.getsize(os.path.join(tmp, "fig6.png")) > 1000)
        return table

    def test_order_on_separated_pairs(self):
        # Measured: aer < complete < ring < all-reduce < one-peer-exp, every pair apart.
        rounds = {"allreduce": [400, 404, 408], "complete": [324, 327, 339],
                  "ring": [361, 369, 374], "one-peer-exp": [444, 458, 476],
                  "aer": [196, 212, 223], "compute only": [82, 82.6, 84]}
        table = self.report(rounds)
        self.assertIn("| 400mbit | 4 x 2 | ", table)
        self.assertIn("/ 404 (", table)  # the planner next to the measured all-reduce
        self.assertIn("| 400mbit | 4 x 2 | 404 | 327 | 369 | 458 | 212 | 83 | 1.91x |", table)
        self.assertIn("| no: aer < ring < complete < one-peer-exp < allreduce | "
                      "8 of 10 (not: allreduce < one-peer-exp, complete < ring) |", table)
        # Rounds of complete and ring that overlap: that pair is not an order to compare.
        rounds["ring"] = [330, 369, 374]
        table = self.report(rounds)
        self.assertIn("| 8 of 9 (not: allreduce < one-peer-exp) |", table)
        # The predicted order everywhere the rounds separate: every pair agrees.
        rounds.update({"complete": [340, 345, 350], "ring": [300, 305, 310],
                       "one-peer-exp": [360, 370, 380], "allreduce": [390, 400, 410]})
        table = self.report(rounds)
        self.assertIn("| yes | 10 of 10 |", table)


if __name__ == "__main__":
    unittest.main()
