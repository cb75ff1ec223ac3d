"""benchmarks/emulate/calibrate's parts that need no cluster: the stream model's buckets as
the wrappers build them, and the NIC's share found by bisection with the real planner
(Note [shares from a stream] in topology/planner.h).

  python tests/emulate/test_calibrate.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import os
import unittest
from importlib.machinery import SourceFileLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("DECENT_DP_BUILD_DIR", os.path.join(ROOT, "build"))
calibrate = SourceFileLoader(
    "calibrate", os.path.join(ROOT, "benchmarks", "emulate", "calibrate")).load_module()

MIB = 1 << 20


class StreamBuckets(unittest.TestCase):
    def test_sixteen_mib(self):
        # 8 layers of 2 MiB, a cap of 4 MiB: two layers reach it exactly.
        self.assertEqual(calibrate.stream_buckets_mib(16 * MIB), [4.0] * 4)

    def test_rounding_and_the_crossing_layer(self):
        # 10^6 bytes: 250000 parameters, 8 layers of 31250, each rounded up to 31264 (977 x
        # 32) = 125056 bytes. The cap is 250000 bytes: the second layer crosses it and stays,
        # so 4 buckets of 250112 bytes.
        self.assertEqual(calibrate.stream_buckets_mib(10**6), [250112 / MIB] * 4)

    def test_uneven_layers_and_a_remainder(self):
        # 3 MiB + 4 bytes: 786433 parameters, the first layer one more (98305, 7 x 98304).
        # Rounded: 98336 and 98304 elements. From the last layer back, the cap of 786433
        # bytes is reached after 3 layers of 393216 bytes each (1179648 bytes): buckets of 3,
        # 3, then the last two layers (393216 + 393344 bytes).
        got = calibrate.stream_buckets_mib(3 * MIB + 4)
        want = [1179648 / MIB, 1179648 / MIB, (393216 + 393344) / MIB]
        self.assertEqual(got, want)


class SleepModelBuckets(unittest.TestCase):
    """decent_dp_runs.sleep_model_buckets_mib, which fig6 gives the planner for its sweeps."""

    def test_the_main_sweep(self):
        # 5.5 M parameters in 8 layers of 687500, each rounded up to 687520 (21485 x 32) =
        # 2750080 bytes; under a cap of 4 MiB the second layer crosses it: 4 buckets of two
        # layers, not the 5 full buckets of 4 MiB and a rest that --params would give.
        got = calibrate.runs.sleep_model_buckets_mib(5500000, 8, 4)
        self.assertEqual(got, [5500160 / MIB] * 4)

    def test_a_rest_and_a_cap_above_the_model(self):
        # 10 parameters in 3 layers (4, 3, 3), each rounded up to 32 elements (128 bytes).
        self.assertEqual(calibrate.runs.sleep_model_buckets_mib(10, 3, 25), [384 / MIB])
        # A cap of 256 bytes: two layers reach it, the last layer is the rest.
        self.assertEqual(calibrate.runs.sleep_model_buckets_mib(10, 3, 256 / MIB),
                         [256 / MIB, 128 / MIB])


@unittest.skipUnless(os.access(os.path.join(BUILD, "bin", "decent_dp_topology"), os.X_OK),
                     "needs build/bin/decent_dp_topology")
class SolveEfficiency(unittest.TestCase):
    INPUTS = dict(ranks=8, lws=2, buckets_mib=[4.0] * 4, compute_ms=30.0, intra=635e6,
                  inter=46.67e6)

    def plan(self, topology, shared, ring=None):
        i = self.INPUTS
        return calibrate.planned_ms(BUILD, topology, i["ranks"], i["lws"], i["buckets_mib"],
                                    i["compute_ms"], i["intra"], i["inter"], shared, ring)

    def test_recovers_the_share_of_a_planned_step(self):
        for share in (0.5, 0.86, 0.97):
            measured = self.plan("ring", share)
            found = calibrate.solve_efficiency(lambda e: self.plan("ring", e), measured)
            self.assertAlmostEqual(found, share, delta=2e-3)

    def test_ring_efficiency_through_complete(self):
        measured = self.plan("complete", 0.86, 0.9)
        found = calibrate.solve_efficiency(lambda e: self.plan("complete", 0.86, e), measured)
        self.assertAlmostEqual(found, 0.9, delta=2e-3)

    def test_pairs_share_slows_ring(self):
        self.assertGreater(self.plan("ring", 0.7), self.plan("ring", 0.9) * 1.1)

    def test_faster_than_a_full_share_is_capped_at_one(self):
        fastest = self.plan("ring", 1.0)
        self.assertEqual(calibrate.solve_efficiency(lambda e: self.plan("ring", e),
                                                    fastest * 0.9), 1.0)

    def test_slower_than_the_lowest_share_is_named(self):
        with self.assertRaises(SystemExit) as caught:
            calibrate.solve_efficiency(lambda e: 100.0 / e, 10000.0)
        self.assertIn("10000.0 ms", str(caught.exception))
        self.assertIn("0.05", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
