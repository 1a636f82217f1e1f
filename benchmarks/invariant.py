"""Invariant mode against the default mode, side by side: step time and bytes on the wire.

    python benchmarks/invariant.py [--workloads mlp gpt] [--rounds 4] [--block 3] [--out DIR]
        [--link RATE]

Two ranks (gloo, one thread each) run every variant of a workload in interleaved blocks
(A B C, B C A, ...): the default ``data_parallel`` step, and the invariant mode with one chunk
per rank and with four. Reports the median step time of the slowest rank, its ratio to the
default, the bytes each rank sends into its all-reduces per step (from ``schedule()``), and the
largest parameter difference from the default after the timed steps. ``--link 2gbit`` runs the
ranks in a network namespace whose loopback is shaped to that rate (root, iproute2), where
communication waits on the wire instead of on the two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
import fddp
import fddp.optim as optim
from benchmarks import netns, provenance, ranks
from benchmarks.workloads import WORKLOADS, build_model, rank_batches

WORLD = 2


@dataclasses.dataclass(frozen=True)
class Job:
    workload: str
    rounds: int
    block: int
    warmup: int


def _variants(per_rank: int) -> dict[str, int | None]:
    """Name -> chunk size (None: the default mode)."""
    return {
        "default": None,
        f"invariant chunk={per_rank}": per_rank,
        f"invariant chunk={per_rank // 4}": per_rank // 4,
    }


def _build(workload: Any, chunk: int | None) -> tuple[Any, list[Any]]:
    model = build_model(workload, torch.device("cpu"))
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.adamw(lr=1e-4, weight_decay=0.01)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return workload.loss(apply(params, buffers, x), y)

    def step(params, opt_state, buffers, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, batch)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, invariant=chunk)
    return pstep, [params, opt.init(params), buffers]


def _wire_bytes(pstep: Any, state: list[Any], batch: Any) -> dict[str, int]:
    plan = pstep.schedule(*state, batch)
    out: dict[str, int] = {}
    for c in plan.collectives:
        out[c.dtype] = out.get(c.dtype, 0) + c.nbytes
    return out


def _gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def run(job: Job) -> dict[str, Any]:
    workload = WORKLOADS[job.workload]
    batches = rank_batches(workload, WORLD, dist.get_rank(), torch.device("cpu"))
    variants = _variants(workload.per_rank)
    built, states, wire, first = {}, {}, {}, {}
    for name, chunk in variants.items():
        built[name], states[name] = _build(workload, chunk)
        wire[name] = _wire_bytes(built[name], states[name], batches[0])
        start = time.perf_counter()
        states[name][:2] = built[name](*states[name], batches[0])[:2]
        first[name] = time.perf_counter() - start
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-job.warmup, job.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            dist.barrier()
            for i in range(job.block):
                batch = batches[(r * job.block + i) % len(batches)]
                start = time.perf_counter()
                params, opt_state, loss = built[name](*states[name], batch)
                float(loss)
                elapsed = time.perf_counter() - start
                states[name][:2] = params, opt_state
                if r >= 0:
                    times[name].append(elapsed)
    slowest = {n: [max(t) for t in zip(*_gather(times[n]))] for n in names}
    reference = states["default"][0]
    return {
        "workload": job.workload,
        "params": sum(p.numel() for p in reference.values()),
        "per_rank": workload.per_rank,
        "variants": {
            n: {
                "chunk": variants[n],
                "median_s": statistics.median(slowest[n]),
                "times_s": slowest[n],
                "first_call_s": first[n],
                "wire_bytes": wire[n],
                "max_param_diff_from_default": max(
                    float((states[n][0][k] - reference[k]).abs().max()) for k in reference
                ),
            }
            for n in names
        },
    }


def _rank_main(rank: int, port: int, jobs: list[Job], out_path: str) -> None:
    ranks.join_world(rank, WORLD, port, threads=1)
    results = [run(job) for job in jobs]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def report(results: list[dict[str, Any]], started: str, link: str | None = None) -> str:
    where = f"a loopback shaped to {link}" if link else "loopback"
    lines = [
        f"# Invariant mode against the default mode ({started})",
        "",
        f"{WORLD} gloo ranks on {where}, one thread each, commit {provenance.commit()}; "
        "interleaved blocks, median step of the slowest rank; bytes: what each rank puts into "
        "its all-reduces per step.",
        "",
        "| workload | variant | step ms | x default | wire MiB | x default | max param diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        base = res["variants"]["default"]
        base_bytes = sum(base["wire_bytes"].values())
        for name, v in res["variants"].items():
            wire_total = sum(v["wire_bytes"].values())
            lines.append(
                f"| {res['workload']} ({res['params'] / 1e6:.1f}M params, {res['per_rank']}/rank)"
                f" | {name} | {v['median_s'] * 1e3:.0f} | {v['median_s'] / base['median_s']:.2f}"
                f" | {wire_total / 2**20:.1f} | {wire_total / base_bytes:.2f}"
                f" | {v['max_param_diff_from_default']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--out", default=None, help="directory for the .json and .md report")
    parser.add_argument("--link", metavar="RATE", help="run behind a tbf-shaped link, e.g. 2gbit")
    parser.add_argument("--regime-json", help=argparse.SUPPRESS)  # internal: the run behind it
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    if args.link:
        why = netns.unavailable()
        if why is not None:
            print(f"--link: {why}")
            return 1
        inner = ["--workloads", *args.workloads, "--rounds", str(args.rounds)]
        inner += ["--block", str(args.block), "--warmup", str(args.warmup)]
        results = netns.run_behind(args.link, __file__, inner)["results"]
    else:
        jobs = [Job(w, args.rounds, args.block, args.warmup) for w in args.workloads]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            mp.spawn(_rank_main, args=(ranks.free_port(), jobs, path), nprocs=WORLD, join=True)
            with open(path) as f:
                results = json.load(f)
    if args.regime_json:
        with open(args.regime_json, "w") as f:
            json.dump({"results": results}, f)
        return 0
    text = report(results, started, args.link)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{started}_invariant.json").write_text(json.dumps(results, indent=1))
        (out / f"{started}_invariant.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
