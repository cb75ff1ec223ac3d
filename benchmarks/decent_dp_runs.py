"""Running the resnet_cifar trainer under mpirun, reading its results, and plotting them.

Shared by benchmarks/sweep, benchmarks/plot and examples/05_compare_topologies. Standard
library plus matplotlib (only for the plots).

A run folder (what the trainer's --output names) holds config.json, metrics.jsonl (one JSON
object per epoch), metrics.csv (the same rows), summary.json (written last: its presence
marks a finished run) and log.txt (the trainer's output, when run from here).
"""

import csv
import itertools
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Names of a "case": how the ranks train and, for gossip, the topology.
NON_GOSSIP = ("allreduce", "local")


def wrapper_buckets(numels, cap_bytes, element_bytes=4):
    """Bucket sizes in bytes as the wrappers build them (spec, "Buckets"): parameters of
    numels elements walked in gradient-ready order, each taking its element count rounded up
    to a multiple of 32; a bucket closes once its total reaches cap_bytes (the parameter that
    crosses the cap stays in it), and the last one holds the rest."""
    buckets, current = [], 0
    for numel in numels:
        current += (numel + 31) // 32 * 32 * element_bytes
        if current >= cap_bytes:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def sleep_model_buckets_mib(params, layers, cap_mb):
    """The buckets, in MiB, of step_bench's sleep model (--params split over --layers, the
    first params % layers layers one element more; gradients ready from the last layer back)
    under bucket_cap_mb = cap_mb."""
    sizes = [params // layers + (1 if i < params % layers else 0) for i in range(layers)]
    return [b / (1 << 20) for b in wrapper_buckets(list(reversed(sizes)), cap_mb * (1 << 20))]


def plan_step_ms(build_dir, ranks, lws, buckets_mib, compute_ms, intra_mbps, inter_mbps,
                 shared_efficiency, ring_efficiency=None, jitter_ms=0.0, extra=()):
    """{name: ms per step} of every prediction of decent_dp_topology --plan (topologies and
    "all-reduce") for these inputs: bandwidths in MB/s, buckets in MiB, ring_efficiency None
    for the planner's default; extra: more flags (--flat-ring, --name N). Raises RuntimeError
    with the planner's message when it fails."""
    cmd = [os.path.join(build_dir, "bin", "decent_dp_topology"), "--plan", "--json",
           "-n", str(ranks), "--lws", str(lws), "--buckets"] + [repr(b) for b in buckets_mib] + [
           "--compute-ms", repr(compute_ms), "--jitter-ms", repr(jitter_ms),
           "--intra-bw", repr(intra_mbps), "--inter-bw", repr(inter_mbps),
           "--shared-efficiency", repr(shared_efficiency)] + list(extra)
    if ring_efficiency is not None:
        cmd += ["--ring-efficiency", repr(ring_efficiency)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the planner failed: {out.stderr.strip()}")
    return {p["name"]: p["step_ms"] for p in json.loads(out.stdout)["predictions"]}


def use_project_python():
    """Re-executes the calling script with the project's virtual environment (scripts/bootstrap)
    when this Python has no matplotlib."""
    try:
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass
    venv = os.environ.get("DECENT_DP_VENV") or os.path.expanduser("~/.cache/decent_dp/venv")
    python = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) != os.path.realpath(venv) and os.access(python, os.X_OK):
        os.execv(python, [python] + sys.argv)
    raise SystemExit(f"error: matplotlib is missing and {python} does not exist; run "
                     f"scripts/bootstrap")


def find_trainer(build_dir=None):
    build_dir = build_dir or os.environ.get("DECENT_DP_BUILD_DIR") or os.path.join(ROOT, "build")
    path = os.path.join(build_dir, "bin", "resnet_cifar")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"error: no trainer at {path}; build first (scripts/build) or pass "
                         f"--build-dir")
    return path


def mpirun_prefix(ranks):
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise SystemExit("error: mpirun not found; run scripts/bootstrap")
    return [mpirun, "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]


def mpirun_env():
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# Note [mpirun lingering]
# Open MPI 4.1's mpirun (Debian 12, PMIx 4.2) sometimes hangs in its own finalize
# (PMIx_server_finalize) after every rank has exited, when ranks exit with a non-zero status:
# the ranks are gone (zombies waiting to be collected), mpirun printed its "the job has been
# aborted" notice, and it never returns (open-mpi/ompi#3380 describes the same). In 120
# launches of the 4-rank early-exit fault job (tests/faults) mpirun hung so once, and once
# crashed there (SIGSEGV in PMIx_server_finalize); both times every rank had already ended
# with the expected error. run_mpirun() below watches mpirun's children and ends such an
# mpirun, so a test sees the ranks' own outcome.
MPIRUN_LINGER_S = 10.0


def live_children(pid):
    """The pids of pid's child processes that have not exited (a zombie has)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def run_mpirun(cmd, timeout, env=None, linger=MPIRUN_LINGER_S, **kw):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw) for
    an mpirun command line, except that an mpirun still running `linger` seconds after its last
    rank exited is killed (Note [mpirun lingering]). The result has two more attributes:
    ranks_exited_s, the seconds from launch until no rank was left (None if ranks were still
    running when mpirun returned), and lingered_s, the seconds mpirun outlived its ranks before
    it was killed (0.0 when it returned by itself)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, **kw)
    seen_rank = False
    ranks_exited = None
    lingered = 0.0
    while True:
        try:
            out, err = proc.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > timeout:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        if live_children(proc.pid):
            seen_rank = True
            ranks_exited = None
        elif seen_rank and ranks_exited is None:
            ranks_exited = now
        elif ranks_exited is not None and now - ranks_exited > linger:
            lingered = now - ranks_exited
            print(f"note: mpirun was still running {lingered:.1f} s after its last rank had "
                  f"exited, and was ended (Note [mpirun lingering] in "
                  f"benchmarks/decent_dp_runs.py)", file=sys.stderr)
            proc.kill()
            out, err = proc.communicate()
            break
    result = subprocess.CompletedProcess(cmd, proc.returncode, out or "", err or "")
    result.ranks_exited_s = (ranks_exited - start) if ranks_exited is not None else None
    result.lingered_s = lingered
    return result


def case_settings(case):
    """Trainer settings of a case name: 'allreduce', 'local' or a topology name."""
    if case in NON_GOSSIP:
        return {"mode": case}
    return {"mode": "decentralized", "topology": case}


def run_trainer(settings, ranks, out_dir, trainer, echo=True):
    """Runs the trainer with `settings` (flag name -> value) on `ranks` ranks into `out_dir`.
    Returns the exit code; the output goes to out_dir/log.txt (and to stdout with `echo`)."""
    os.makedirs(out_dir, exist_ok=True)
    settings = dict(settings, output=out_dir, progress="lines")
    config = os.path.join(out_dir, "settings.json")
    with open(config, "w") as f:
        json.dump(settings, f, indent=2)
    cmd = mpirun_prefix(ranks) + [trainer, "--config", config]
    with open(os.path.join(out_dir, "log.txt"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=mpirun_env(), text=True)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if echo:
                sys.stdout.write("  " + line)
                sys.stdout.flush()
        return proc.wait()


def read_run(run_dir):
    """{'dir', 'config', 'rows', 'summary'} of a run folder; summary is None when unfinished."""
    out = {"dir": run_dir, "config": {}, "rows": [], "summary": None}
    path = os.path.join(run_dir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            out["config"] = json.load(f)
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            out["rows"] = [json.loads(line) for line in f if line.strip()]
    path = os.path.join(run_dir, "consensus.csv")
    out["consensus"] = []
    if os.path.exists(path):
        with open(path) as f:
            out["consensus"] = [(int(r["step"]), float(r["consensus_distance"]))
                                for r in csv.DictReader(f)]
    path = os.path.join(run_dir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            out["summary"] = json.load(f)
    return out


# ---- sweeps ----

def load_sweep(path):
    with open(path) as f:
        try:
            spec = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path} is not valid JSON: {e}")
    if not isinstance(spec, dict) or "grid" not in spec:
        raise SystemExit(f"error: {path}: expected an object with 'name', 'base' and 'grid'")
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec.setdefault("base", {})
    for key, values in spec["grid"].items():
        if not isinstance(values, list) or not values:
            raise SystemExit(f"error: {path}: grid entry '{key}' must be a non-empty list")
    if "ranks" not in spec["grid"] and "ranks" not in spec["base"]:
        raise SystemExit(f"error: {path}: give 'ranks' (world sizes) in 'grid' or 'base'")
    spec["_dir"] = os.path.dirname(os.path.abspath(path))
    for c in spec["grid"].get("config", []):
        config_path(spec, c)  # every trainer config file exists and holds settings
    return spec


def is_trainer_config(path):
    """Whether `path` is a trainer configuration (one flat JSON object of settings, as
    resnet_cifar --config reads) rather than a sweep file."""
    with open(path) as f:
        try:
            j = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path} is not valid JSON: {e}")
    return isinstance(j, dict) and "grid" not in j


def configs_sweep(paths, ranks, name, overrides):
    """A sweep of trainer configuration files: one point per file at each world size, the
    file's settings, then `overrides` (setting -> value) on top."""
    spec = {"name": name, "base": {}, "override": dict(overrides),
            "grid": {"ranks": list(ranks), "config": [os.path.abspath(p) for p in paths]},
            "_dir": os.getcwd()}
    for c in spec["grid"]["config"]:
        config_path(spec, c)
    return spec


def config_path(spec, c):
    """A "config" grid value: a trainer configuration file, relative to the sweep file's folder
    or the project root."""
    for candidate in (c, os.path.join(spec.get("_dir", ""), c), os.path.join(ROOT, c)):
        if os.path.isfile(candidate):
            with open(candidate) as f:
                try:
                    settings = json.load(f)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {candidate} is not valid JSON: {e}")
            if not isinstance(settings, dict) or "grid" in settings:
                raise SystemExit(f"error: {candidate}: a 'config' value must name a trainer "
                                 f"configuration (one object of settings), not a sweep")
            return candidate, settings
    raise SystemExit(f"error: 'config' {c}: no such file (relative to the sweep file or the "
                     f"project root)")


def points(spec):
    """The grid's points in order: (name, ranks, case, trainer settings)."""
    grid = spec["grid"]
    keys = list(grid.keys())
    out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        p = dict(spec["base"])
        chosen = dict(zip(keys, values))
        if "config" in chosen:  # base < the configuration file < the other grid values
            p.update(config_path(spec, chosen.pop("config"))[1])
        p.update(chosen)
        p.update(spec.get("override", {}))
        ranks = int(p.pop("ranks"))
        case = p.pop("case", None)
        if case is not None:
            p.update(case_settings(case))
        if p.get("topology") in ("aer", "alternating-exp-ring") and "lws" not in p:
            # One machine has no nodes: emulate two per world, as step_bench does.
            p["lws"] = max(2, ranks // 2)
        else:
            case = p.get("topology", "complete") if p.get("mode", "decentralized") == \
                "decentralized" else p["mode"]
        parts = []
        for k, v in zip(keys, values):
            if k == "config":
                parts.append(os.path.splitext(os.path.basename(v))[0])
                continue
            parts.append(f"n{v}" if k == "ranks" else (str(v) if k in ("case", "model", "dataset",
                                                                          "optimizer") else
                                                        f"{k}{v}"))
        name = "_".join(parts).replace("/", "-").replace(" ", "")
        out.append((name, ranks, case, p))
    return out


def run_sweep(spec, results_dir, trainer, data_dir=None, echo=True, only=None):
    """Runs every point of `spec` whose summary.json is missing; writes the merged CSVs."""
    sweep_dir = os.path.join(results_dir, spec["name"])
    os.makedirs(sweep_dir, exist_ok=True)
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        json.dump({k: v for k, v in spec.items() if not k.startswith("_")}, f, indent=2)
    failed = []
    pts = points(spec)
    for i, (name, ranks, case, settings) in enumerate(pts, 1):
        if only and name not in only:
            continue
        out_dir = os.path.join(sweep_dir, name)
        if data_dir:
            settings = dict(settings, **{"data-dir": data_dir})
        if os.path.exists(os.path.join(out_dir, "summary.json")):
            print(f"[{i}/{len(pts)}] {name}: done before, skipped", flush=True)
            continue
        print(f"[{i}/{len(pts)}] {name}: {ranks} ranks, {case}", flush=True)
        t0 = time.time()
        rc = run_trainer(settings, ranks, out_dir, trainer, echo=echo)
        if rc != 0 or not os.path.exists(os.path.join(out_dir, "summary.json")):
            print(f"[{i}/{len(pts)}] {name}: FAILED (exit {rc}); see {out_dir}/log.txt",
                  flush=True)
            failed.append(name)
        else:
            print(f"[{i}/{len(pts)}] {name}: finished in {time.time() - t0:.0f} s", flush=True)
    merge(sweep_dir, pts)
    return failed


def merge(sweep_dir, pts):
    """results.csv (every epoch of every finished point) and summary.csv (one row a point)."""
    rows, summaries = [], []
    for name, ranks, case, _ in pts:
        run = read_run(os.path.join(sweep_dir, name))
        if run["summary"] is None:
            continue
        for r in run["rows"]:
            rows.append(dict({"point": name, "ranks": ranks, "case": case}, **r))
        summaries.append(dict({"point": name, "ranks": ranks, "case": case}, **run["summary"]))
    for file, data in (("results.csv", rows), ("summary.csv", summaries)):
        if not data:
            continue
        fields = list(data[0].keys())
        for d in data:
            fields += [k for k in d if k not in fields]
        with open(os.path.join(sweep_dir, file), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(data)


def read_sweep(sweep_dir):
    """The finished runs under a sweep (or any) folder, each with 'point', 'ranks', 'case'."""
    runs = []
    for name in sorted(os.listdir(sweep_dir)):
        d = os.path.join(sweep_dir, name)
        if not os.path.isdir(d):
            continue
        run = read_run(d)
        if run["summary"] is None:
            continue
        s = run["summary"]
        run["point"] = name
        run["ranks"] = s.get("world_size")
        run["case"] = s.get("label")
        runs.append(run)
    return runs


# ---- tables and plots ----

def _epsilon(s):
    e = s.get("epsilon")
    return "-" if e is None else (e if isinstance(e, str) else f"{e:.3g}")


def table(runs):
    head = (f"{'run':<24} {'ranks':>5} {'final acc':>9} {'best acc':>9} {'ms/step':>8} "
            f"{'MB/step':>8} {'consensus':>10} {'data wait':>9} {'epsilon':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r["summary"]
        lines.append(f"{r['point']:<24} {r['ranks']:>5} {100 * s['final_test_acc']:>8.2f}% "
                     f"{100 * s['best_test_acc']:>8.2f}% {s['step_ms']:>8.1f} "
                     f"{s['bytes_sent_per_step'] / 1e6:>8.3f} "
                     f"{s['final_consensus_distance']:>10.2e} "
                     f"{100 * s['data_wait_frac']:>8.2f}% {_epsilon(s):>8}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(run, runs):
    several = len({r["ranks"] for r in runs}) > 1
    models = {r["summary"].get("model") for r in runs}
    label = run["case"]
    if len(models) > 1:
        label = f"{run['summary'].get('model')} {run['case']}"
    if several:
        label += f" (n={run['ranks']})"
    if len([r for r in runs if r["case"] == run["case"] and r["ranks"] == run["ranks"]]) > 1:
        label = run["point"]
    return label


_CASE_KEYS = {"mode", "topology", "lws", "output", "label", "data-dir", "progress", "log-every"}


def groups_of(runs):
    """Runs grouped by every setting that varies across them except the case (mode and
    topology): [(title, [runs])]. One group when only the case varies."""
    keys = set()
    for r in runs:
        keys |= set(r["config"]) - _CASE_KEYS
    varying = sorted(k for k in keys if len({json.dumps(r["config"].get(k)) for r in runs}) > 1)
    out = {}
    for r in runs:
        key = tuple((k, r["config"].get(k)) for k in varying)
        out.setdefault(key, []).append(r)
    return [(", ".join(f"{'n' if k == 'world_size' else k}={v}" for k, v in key), rs)
            for key, rs in sorted(out.items(), key=lambda kv: json.dumps(kv[0]))]


def plot_accuracy(runs, path, title=""):
    """Test accuracy of the averaged model vs epoch and vs training time: one row of two
    panels per group of runs (groups_of), one line per case."""
    plt = _pyplot()
    groups = groups_of(runs)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.6 * len(groups) + 0.6),
                             squeeze=False)
    for (name, rs), (a, b) in zip(groups, axes):
        for r in rs:
            ep = [row["epoch"] for row in r["rows"]]
            acc = [100 * row["test_acc"] for row in r["rows"]]
            t = [row["train_time_s"] for row in r["rows"]]
            label = r["case"] if len(groups) > 1 else _label(r, runs)
            a.plot(ep, acc, marker="o", label=label)
            b.plot(t, acc, marker="o", label=label)
        a.set_xlabel("epoch")
        b.set_xlabel("training time (s)")
        for ax in (a, b):
            ax.set_ylabel("test accuracy, averaged model (%)")
            ax.grid(alpha=0.3)
            if name:
                ax.set_title(name, fontsize=10)
        a.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_step_time(runs, path, title=""):
    """Mean step time vs world size, one line a case."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    cases = sorted({r["case"] for r in runs})
    for c in cases:
        by_n = {}
        for r in runs:
            if r["case"] == c:
                by_n.setdefault(r["ranks"], []).append(r["summary"]["step_ms"])
        ns = sorted(by_n)
        # Mean over the runs of a case at one world size (seeds, optimizers, ...).
        ax.plot(ns, [sum(by_n[n]) / len(by_n[n]) for n in ns], marker="o", label=c)
    ax.set_xlabel("ranks")
    ax.set_ylabel("time per step (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def plot_consensus(runs, path, title=""):
    """Consensus distance vs step (log scale), one panel per group of runs, one line per
    case; from consensus.csv (every --consensus-every steps and at each epoch's end)."""
    plt = _pyplot()
    groups = groups_of(runs)
    cols = min(2, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows + 0.6), squeeze=False)
    for (name, rs), ax in zip(groups, axes.flat):
        for r in rs:
            points = r.get("consensus") or [
                (row["epoch"] * r["summary"]["steps_per_epoch"], row["consensus_distance"])
                for row in r["rows"]]
            points = [(x, y) for x, y in points if y > 0]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points],
                        marker="o" if len(points) < 30 else None, markersize=3,
                        label=r["case"] if len(groups) > 1 else _label(r, runs))
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("consensus distance")
        ax.grid(alpha=0.3)
        if name:
            ax.set_title(name, fontsize=10)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle((title + ": " if title else "") + "mean over ranks of ||x_i - mean||^2")
    return _save(fig, path)


def plot_all(runs, out_dir, title=""):
    os.makedirs(out_dir, exist_ok=True)
    return [plot_accuracy(runs, os.path.join(out_dir, "accuracy.png"), title),
            plot_step_time(runs, os.path.join(out_dir, "step_time_vs_ranks.png"), title),
            plot_consensus(runs, os.path.join(out_dir, "consensus.png"), title)]
