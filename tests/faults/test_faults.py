"""A rank that dies by a signal in the middle of a 4-rank gossip job: the job ends promptly and
non-zero, mpirun names the dead rank, no process of the job survives it and none of its
shared-memory segments stays in /dev/shm (Note [shared-memory janitor]). Jobs are launched
through decent_dp_runs.run_mpirun: an mpirun that hangs in its own finalize after all its ranks
have exited is ended there, and the time it spent so is not the job's (Note [mpirun
lingering]).

  python tests/faults/test_faults.py   (DECENT_DP_BUILD_DIR: the build folder)
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decent_dp_runs as runs  # noqa: E402

BUILD = os.environ.get("DECENT_DP_BUILD_DIR", os.path.join(ROOT, "build"))
FAULT_RANK = os.path.join(BUILD, "bin", "fault_rank")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its parent to collect it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def run_job(args, env=None):
    """(result, seconds until its ranks were done) of a 4-rank fault_rank job."""
    start = time.monotonic()
    r = runs.run_mpirun(runs.mpirun_prefix(4) + [FAULT_RANK] + [str(a) for a in args],
                        timeout=240, env=env or runs.mpirun_env())
    return r, time.monotonic() - start - r.lingered_s


class DyingRank(unittest.TestCase):
    def run_job(self, sig, die_rank=2):
        r, elapsed = run_job([die_rank, int(sig), 20, 100000])
        out = r.stdout + r.stderr
        pids = [int(p) for p in re.findall(r"^rank \d+ pid (\d+)$", r.stdout, re.M)]
        self.assertEqual(len(pids), 4, out)
        self.assertIn(f"rank {die_rank} raising signal {int(sig)}", r.stdout)
        self.assertNotEqual(r.returncode, 0, out)
        self.assertNotIn("finished", r.stdout, "a rank trained on after its peer died")
        # mpirun names the dead rank and how it ended.
        self.assertRegex(out, rf"rank {die_rank} with PID \d+ .*(signal {int(sig)}|exited)", out)
        # Prompt: far below any collective timeout (the default is 10 minutes).
        self.assertLess(elapsed, 60, f"the job took {elapsed:.1f} s to end")
        # Nothing of the job survives: no rank process, no segment.
        self.assertTrue(wait_until(lambda: not any(alive(p) for p in pids), 10),
                        f"processes left behind: {[p for p in pids if alive(p)]}")

        def leftovers():
            return [f for p in pids for f in glob.glob(f"/dev/shm/decent_dp.{p}.*")]

        self.assertTrue(wait_until(lambda: not leftovers(), 10),
                        f"segments left in /dev/shm: {leftovers()}")
        return elapsed

    def test_stall_is_reported_long_before_the_timeout(self):
        # Rank 2 falls 3 s behind: its peers' waits say so after 0.5 s, naming the operation,
        # its group, bucket and update; then training goes on and the job ends cleanly.
        env = runs.mpirun_env()
        env["DECENT_DP_STALL_WARN_MS"] = "500"
        r, _ = run_job([2, 0, 20, 40], env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stderr, r"still waiting for allreduce\(avg, \d+ x Float\) on group "
                         r"\[[0-9,]*2[0-9,]*\] \(rank \d, bucket \d+, exchange of update \d+\) "
                         r"\d+ ms after its launch")
        self.assertEqual(r.stdout.count("finished 40 steps"), 4)

    def test_stopped_rank_times_out_everywhere(self):
        # SIGSTOP: the peers warn, then time out after DECENT_DP_TIMEOUT_MS naming the stalled
        # exchange, and the job ends (mpirun kills the stopped rank too).
        env = runs.mpirun_env()
        env["DECENT_DP_STALL_WARN_MS"] = "500"
        env["DECENT_DP_TIMEOUT_MS"] = "3000"
        r, elapsed = run_job([1, int(signal.SIGSTOP), 20, 100000], env)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("still waiting for", r.stderr)
        self.assertRegex(r.stderr, r"on group \[[0-9,]*1[0-9,]*\] \(rank \d, bucket \d+, "
                         r"exchange of update \d+\) did not complete within the timeout of 3000 ms")
        self.assertLess(elapsed, 60)
        pids = [int(p) for p in re.findall(r"^rank \d+ pid (\d+)$", r.stdout, re.M)]
        self.assertTrue(wait_until(lambda: not any(alive(p) for p in pids), 10),
                        f"processes left behind: {[p for p in pids if alive(p)]}")

    def test_rank_that_leaves_early_is_named_at_once(self):
        # Rank 2 has fewer batches: it leaves after 20 steps and exits normally. The ranks
        # still waiting on it fail within seconds (the timeout is 10 minutes), naming it.
        r, elapsed = run_job([2, -1, 20, 100000])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("rank 2 leaving after 20 steps", r.stdout)
        self.assertRegex(r.stderr, r"rank 2 has left: its communicator shut down .* after "
                         r"starting \d+ operation\(s\) on group \[[0-9,]*2[0-9,]*\], and this "
                         r"rank waits for allreduce\(avg, \d+ x Float\) on group .*exchange of "
                         r"update \d+\)")
        self.assertLess(elapsed, 30, f"the job took {elapsed:.1f} s to end")
        print(f"early exit: job ended in {elapsed:.1f} s", file=sys.stderr)

    def test_sigkill(self):
        print(f"SIGKILL: job ended in {self.run_job(signal.SIGKILL):.1f} s", file=sys.stderr)

    def test_sigterm(self):
        print(f"SIGTERM: job ended in {self.run_job(signal.SIGTERM):.1f} s", file=sys.stderr)


class LingeringMpirun(unittest.TestCase):
    # Note [mpirun lingering]: a launcher that outlives its ranks is ended; one that returns
    # by itself is left alone. A shell stands in for mpirun: its child is the rank.
    def test_a_launcher_hung_after_its_ranks_is_ended(self):
        fake = ["bash", "-c", "sh -c 'sleep 0.6; echo rank out; exit 3' & wait; "
                "echo aborted >&2; exec sleep 120"]
        start = time.monotonic()
        r = runs.run_mpirun(fake, timeout=60, linger=1.0)
        self.assertLess(time.monotonic() - start, 30)
        self.assertGreater(r.lingered_s, 1.0)
        self.assertLess(r.lingered_s, 5.0)
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(r.stdout, "rank out\n")
        self.assertEqual(r.stderr, "aborted\n")
        self.assertGreater(r.ranks_exited_s, 0.5)

    def test_a_launcher_that_returns_is_left_alone(self):
        r = runs.run_mpirun(["bash", "-c", "sh -c 'sleep 0.5; echo done' & wait; exit 4"],
                            timeout=60, linger=1.0)
        self.assertEqual(r.returncode, 4)
        self.assertEqual(r.stdout, "done\n")
        self.assertEqual(r.lingered_s, 0.0)

    def test_a_launcher_past_its_timeout_raises(self):
        with self.assertRaises(subprocess.TimeoutExpired):
            runs.run_mpirun(["bash", "-c", "sleep 120"], timeout=1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
