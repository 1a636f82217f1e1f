"""What the per-call agreement costs a training step: the default against check_replicas=False.

    python benchmarks/agreement_cost.py [--workloads mlp,gpt] [--rounds 8] [--block 3]

Every call of a ``data_parallel`` step compares, in the one all-reduce its call check makes
anyway, the step, its options and signature, the call count and every input that must be the
same on every rank: the replicated arguments' leaves and what their fed-back outputs were
computed from (``fddp/_step/_replica_guard.py``). A leaf that is a replicated output of the
step's previous call, unchanged since, is known by that origin and not hashed; any other is
hashed (``fddp/_ranks/_digests.py``), as every leaf is on a first call or after a load.

Per workload (benchmarks/workloads.py, 2 gloo ranks, one thread each, AdamW, params and state
donated as in compare_ddp.py) three steps trained side by side, interleaved in blocks (each
round starting with the next, a barrier before every call, the slowest rank's time):

- ``default``: ``fddp.data_parallel(step)``, the state fed back as a training loop does;
- ``check_replicas=False``: the opt-out, which compares no argument's values;
- ``hashed``: the default step with parameters and optimizer state passed as fresh clones
  every call, so that every leaf is hashed (the clone itself is outside the timing: the
  copies are made before the call).

Prints the medians, the default's and the hashed step's cost over the opt-out in
milliseconds and percent of the opt-out's step, and, measured inside each step, the
agreement's own work per call (what the call's inputs are, their digests or origins, the
check's launch, the record of the outputs; the all-reduce it rides on existed before) as a
share of the step (the difference of whole steps is within the noise of a shared machine),
and writes the table to ``benchmarks/results/<UTC time>_agreement_cost.md`` with the load
average: on a shared machine the load moves the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from typing import Any

import optree
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compare_ddp import LR, WEIGHT_DECAY, _pure_step
from workloads import WORKLOADS, build_model, param_count, rank_batches

import fddp
import fddp.optim as optim

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = ("default", "check_replicas=False", "hashed")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="mlp,gpt", help="comma-separated")
    p.add_argument("--rounds", type=int, default=8, help="rounds of every variant in turn")
    p.add_argument("--block", type=int, default=3, help="calls of one variant per turn")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each variant first")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (gloo on the device's tensors)")
    p.add_argument("--out", default=RESULTS, help="directory of the markdown report")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def timed(obj: Any, method: str, spent: list[float]) -> None:
    """Add the seconds each call of ``obj.method`` takes to ``spent[0]``."""
    inner = getattr(obj, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(obj, method, wrapper)


def variant(name: str, workload: str, device: torch.device) -> Any:
    """One step object trained from its own copy of the state: ``call(batch)`` returns the
    call's seconds and the agreement's own seconds in it."""
    spec = WORKLOADS[workload]
    model = build_model(spec, device)
    params, buffers = fddp.state(model)
    opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    state = [params, opt.init(params), buffers]
    checked = name != "check_replicas=False"
    pstep = fddp.data_parallel(
        _pure_step(model, spec, opt, average_grads=True),
        donate_argnums=(0, 1),
        check_replicas=checked,
    )
    spent = [0.0]
    for obj, method in [
        (pstep._replicas, "inputs"),
        (pstep._replicas, "after_call"),
        (pstep._calls, "launch"),
    ]:
        timed(obj, method, spent)

    def fresh() -> list:
        """The arguments of the next call: for ``hashed``, copies the step has never seen."""
        if name != "hashed":
            return state
        return [*(optree.tree_map(torch.clone, tree) for tree in state[:2]), state[2]]

    def call(batch: Any) -> tuple[float, float]:
        args = fresh()
        spent[0] = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        out = pstep(*args, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        state[:] = list(out[:3])
        return seconds, spent[0]

    return call


def time_variants(workload: str, args: argparse.Namespace, device: torch.device) -> dict:
    batches = rank_batches(WORKLOADS[workload], dist.get_world_size(), dist.get_rank(), device)
    calls = {name: variant(name, workload, device) for name in VARIANTS}
    for name in VARIANTS:
        for i in range(args.warmup):
            calls[name](batches[i % len(batches)])
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            for i in range(args.block):
                times[name].append(calls[name](batches[i % len(batches)]))
    return times


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    ranks.join_world(rank, world, port, threads=1)
    device = torch.device(args.device, rank if args.device == "cuda" else None)
    out = {}
    for workload in args.workloads.split(","):
        mine = time_variants(workload, args, device)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        slowest = {
            k: [max(t, key=lambda pair: pair[0]) for t in zip(*(e[k] for e in everyone))]
            for k in mine
        }
        params = param_count(build_model(WORKLOADS[workload], torch.device("cpu")))
        out[workload] = {"params": params, "seconds": slowest}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict) -> str:
    head = [
        "workload",
        "params",
        *(f"{v} (ms)" for v in VARIANTS),
        "default - opt-out",
        "hashed - opt-out",
        *(f"agreement work, {v}" for v in VARIANTS),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for workload, found in results.items():
        steps = {k: [pair[0] for pair in v] for k, v in found["seconds"].items()}
        ms = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
        base = ms["check_replicas=False"]
        cells = [workload, f"{found['params']:,}", *(f"{ms[v]:.1f}" for v in VARIANTS)]
        for name in ("default", "hashed"):
            cells.append(f"{ms[name] - base:+.2f} ms ({100 * (ms[name] - base) / base:+.1f} %)")
        for name in VARIANTS:
            work = statistics.median(pair[1] for pair in found["seconds"][name]) * 1e3
            cells.append(f"{work:.2f} ms ({100 * work / ms[name]:.2f} %)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "times")
        mp.spawn(rank_main, args=(2, ranks.free_port(), args, path), nprocs=2)
        with open(path) as f:
            results = json.load(f)
    load = os.getloadavg()
    text = (
        f"# Agreement cost per call, 2 gloo ranks ({args.device}), median of "
        f"{args.rounds * args.block} calls per variant, load average {load[0]:.1f}\n\n"
        + table(results)
        + "\n"
    )
    print(text)
    if not args.no_write:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        with open(os.path.join(args.out, f"{stamp}_agreement_cost.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
