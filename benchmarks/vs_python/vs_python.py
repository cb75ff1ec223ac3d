"""The Python original's side of benchmarks/vs_python: the published `decent-dp` package's
DecentralizedDataParallel (torch.distributed over gloo, CPU) training the same model on the
same data as build/bin/vs_python, with the same command line. Launched under mpirun by
benchmarks/vs_python/compare (one process per rank; rank, world size and local world size
come from Open MPI's environment, MASTER_ADDR / MASTER_PORT from the launcher).

Cases, run interleaved in rounds: "local" (the model and its optimizer, no communication),
"gossip" (the package's wrapper) and "allreduce" (torch's DistributedDataParallel, then the
optimizer's step: what decent_dp's DistributedDataParallel replaces). Each round times `--steps` steps per case after a
barrier; a case's time in a round is the slowest rank's mean step time (with --round-warmup
N, after N untimed steps, and without the final drain of the exchanges in flight). Rank 0 writes the
per-round times as JSON (--json); with --dump every rank writes the final parameters of the last case
named in --cases (float32, named_parameters order) to <prefix>.rank<r>.bin.

The models, the initialization and the batches are defined identically in vs_python.cpp;
keep the two in step.
"""

import argparse
import faulthandler
import json
import math
import os
import signal
import sys
import time


CASES = ("local", "gossip", "allreduce")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="conv", choices=["conv", "mlp", "small-conv", "small-mlp"])
    p.add_argument("--topology", default="complete")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "accum-adamw"])
    p.add_argument("--accum-iter", type=int, default=4)
    p.add_argument("--scheduler", default="none", choices=["none", "cosine"])
    p.add_argument("--t-max", type=int, default=100, help="cosine: steps of the cosine")
    p.add_argument("--t-warmup", type=int, default=0, help="cosine: steps of linear warmup")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--weight-decay-split", choices=("all", "factory", "package"), default="all",
                   help="which parameters decay: all; factory: each implementation's factory's "
                        "rule (here the package's); package: the package's rule")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=1, help="distinct batches per rank, cycled")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case first")
    p.add_argument("--round-warmup", type=int, default=0,
                   help="untimed steps at the start of each round; N > 0 also leaves the "
                        "round's final drain out of the time")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument("--grad-clip", type=float, default=0.0,
                   help="gossip: clip each bucket's gradient norm to this (0: off)")
    p.add_argument("--bucket-order", choices=("default", "ready"), default="default",
                   help="decent_dp's order inside a bucket; the package always keeps "
                        "gradient-ready order")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="local,gossip")
    p.add_argument("--json", default="")
    p.add_argument("--dump", default="")
    a = p.parse_args(argv)
    for name in ("batch", "batches", "steps", "rounds", "threads", "bucket_mb", "accum_iter",
                 "t_max"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("warmup", "round_warmup", "t_warmup", "grad_clip"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    a.cases = [c for c in a.cases.split(",") if c]
    if not a.cases or any(c not in CASES for c in a.cases) or len(set(a.cases)) < len(a.cases):
        p.error(f"--cases takes each of {', '.join(CASES)} at most once, got {','.join(a.cases)}")
    return a


def make_model(nn, name):
    if name == "mlp":  # 21 M parameters
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 10))
    if name == "small-mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                             nn.Linear(64, 10))
    layers, c_in = [], 3
    widths = [64, 128, 256, 512, 512, 512] if name == "conv" else [8, 16]
    pools = 4 if name == "conv" else 2
    for i, w in enumerate(widths):
        layers += [nn.Conv2d(c_in, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        if i < pools:
            layers.append(nn.MaxPool2d(2))
        c_in = w
    layers.append(nn.Flatten())
    if name == "conv":  # 10.5 M parameters, 32x32 inputs
        layers += [nn.Linear(512 * 2 * 2, 2048), nn.ReLU(), nn.Linear(2048, 10)]
    else:  # 16x16 inputs
        layers.append(nn.Linear(16 * 4 * 4, 10))
    return nn.Sequential(*layers)


def input_shape(name, batch):
    return {"mlp": (batch, 1024), "small-mlp": (batch, 32), "conv": (batch, 3, 32, 32),
            "small-conv": (batch, 3, 16, 16)}[name]


def initialize(torch, model, seed):
    """Parameter i (named_parameters order) <- randn(shape, seeded seed * 1000003 + i) times
    1/sqrt(fan_in) for tensors of two or more dimensions, 0.1 for the others."""
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed * 1000003 + i)
            scale = 1.0 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g).mul_(scale))


def batches(torch, a, rank):
    out = []
    for b in range(a.batches):
        g = torch.Generator().manual_seed(a.seed * 1000003 + 7919 * (rank + 1) + b)
        x = torch.randn(input_shape(a.model, a.batch), generator=g)
        y = torch.randint(0, 10, (a.batch,), generator=g)
        out.append((x, y))
    return out


def main(argv):
    faulthandler.enable()  # a Python stack on stderr if the process aborts
    # ... and every thread's stack when it is stopped from outside (compare's launch timeout)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    a = parse_args(argv)
    env = os.environ
    rank = int(env.get("OMPI_COMM_WORLD_RANK", env.get("RANK", "0")))
    size = int(env.get("OMPI_COMM_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", "1")))
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(size)
    env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("LOCAL_RANK", "0"))
    env["LOCAL_WORLD_SIZE"] = str(local_size)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    try:
        from decent_dp.ddp import DecentralizedDataParallel
        from decent_dp.optim import AccumAdamW, lr_scheduler_fn_cosine_with_warmup
        from decent_dp.optim import _get_param_groups as package_split
    except ImportError as e:
        print(f"error: the decent-dp package is not installed ({e}); run scripts/bootstrap",
              file=sys.stderr)
        return 3
    # decent-dp 0.2.3's AccumAdamW.step calls Optimizer._cuda_graph_capture_health_check, which
    # torch has since renamed; the renamed check stands in for it (the arithmetic is the
    # package's own).
    if not hasattr(AccumAdamW, "_cuda_graph_capture_health_check"):
        AccumAdamW._cuda_graph_capture_health_check = (
            torch.optim.Optimizer._accelerator_graph_capture_health_check)
    try:  # the package logs at DEBUG on rank 0 through loguru
        from loguru import logger
        logger.remove()
    except ImportError:
        pass

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=size)

    def optim_fn(named):
        # The package's factories give weight decay to the parameters it names "bn" or "bias"
        # and none to the rest (the spec's section 11: the split inverted); its groups here,
        # with the same kernels as every other check.
        params = package_split(named, a.weight_decay) if a.weight_decay_split != "all" else \
            [p for _, p in named]
        if a.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=a.weight_decay, fused=True)
        if a.optimizer == "sgd":
            return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum,
                                   weight_decay=a.weight_decay, fused=True)
        return AccumAdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=a.weight_decay, accum_iter=a.accum_iter)

    def scheduler_fn(optimizer):
        return lr_scheduler_fn_cosine_with_warmup(optimizer, t_max=a.t_max, t_warmup=a.t_warmup,
                                                  cosine_eta_min=1e-6, warmup_decay=0.01)

    scheduler = scheduler_fn if a.scheduler == "cosine" else None

    data = batches(torch, a, rank)
    cases = {}
    for name in ("local", "allreduce"):
        if name not in a.cases:
            continue
        net = make_model(nn, a.model)
        initialize(torch, net, a.seed)
        opt = optim_fn(list(net.named_parameters()))
        sched = scheduler(opt) if scheduler else None
        model = net
        if name == "allreduce":
            model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=a.bucket_mb)

        def plain_step(x, y, model=model, opt=opt, sched=sched):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()

        cases[name] = (plain_step, lambda: None, net)
    if "gossip" in a.cases:
        net = make_model(nn, a.model)
        initialize(torch, net, a.seed)
        ddp = DecentralizedDataParallel(net, optim_fn, lr_scheduler_fn=scheduler,
                                        topology=a.topology, bucket_size_in_mb=a.bucket_mb,
                                        grad_clip_norm=a.grad_clip)

        def gossip_step(x, y, ddp=ddp):
            F.cross_entropy(ddp(x), y).backward()

        def gossip_finish(ddp=ddp):  # the exchanges in flight (the next backward waits again)
            for op in ddp._comm_ops:
                if op is not None:
                    op.wait()

        cases["gossip"] = (gossip_step, gossip_finish, net)

    order = a.cases
    counters = {c: 0 for c in order}

    def run(case, n):
        step, _, _ = cases[case]
        for _ in range(n):
            x, y = data[counters[case] % len(data)]
            counters[case] += 1
            step(x, y)

    for c in order:
        run(c, a.warmup)
        cases[c][1]()
    times = {c: [] for c in order}
    for r in range(a.rounds):
        for k in range(len(order)):
            c = order[(k + r) % len(order)]
            dist.barrier()
            run(c, a.round_warmup)
            t0 = time.perf_counter()
            run(c, a.steps)
            if a.round_warmup == 0:
                cases[c][1]()
            elapsed = time.perf_counter() - t0
            if a.round_warmup > 0:
                cases[c][1]()
            ms = torch.tensor([elapsed * 1e3 / a.steps], dtype=torch.float64)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            times[c].append(ms.item())
    if a.dump:
        net = cases[a.cases[-1]][2]
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        with open(f"{a.dump}.rank{rank}.bin", "wb") as f:
            f.write(flat.to(torch.float32).numpy().tobytes())
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"implementation": "python", "ranks": size, "model": a.model,
                       "topology": a.topology, "optimizer": a.optimizer, "batch": a.batch,
                       "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup,
                       "round_warmup": a.round_warmup,
                       "threads": a.threads,
                       "parameters": sum(p.numel() for p in make_model(nn, a.model).parameters()),
                       "ms": times}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
