"""Where a step's time goes, fddp vs DDP: python benchmarks/profile_step.py --workload mlp"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compare_ddp import Spec, build
from torch.profiler import ProfilerActivity, profile
from workloads import WORKLOADS, rank_batches

COMM_MARKERS = ("all_reduce", "allreduce", "wait_tensor", "broadcast", "gloo", "c10d")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split(":")[0])
    p.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    p.add_argument(
        "--variants",
        default="fddp,ddp,local",
        help="fddp, ddp, local, fddp@MB, fddp+zero, ddp+zero ...",
    )
    p.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=15, help="ops listed per variant")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="directory for Chrome traces (rank 0), none if unset")
    return p.parse_args(argv)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    ranks.join_world(rank, world, port, args.threads)
    workload = WORKLOADS[args.workload]
    device = torch.device("cpu")
    batches = rank_batches(workload, world, rank, device)
    for name in args.variants.split(","):
        variant = build(Spec.from_name(name), workload, device)
        for i in range(args.warmup + 1):
            variant.step(batches[i % len(batches)])
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for i in range(args.steps):
                variant.step(batches[i % len(batches)])
            wall = (time.perf_counter() - start) / args.steps
        if rank == 0:
            print(summary(name, prof, wall, args.steps, args.rows))
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.out, f"{args.workload}_{name}.json"))
        del variant
        dist.barrier()
    dist.destroy_process_group()


def summary(name: str, prof: profile, wall_s: float, steps: int, rows: int) -> str:
    """Per step: wall time, op self-time split into communication and compute, the top ops."""
    events = prof.key_averages()
    top = [e for e in events if not e.key.startswith("ProfilerStep")]
    comm = sum(e.self_cpu_time_total for e in top if _is_comm(e.key)) / steps / 1e3
    ops = sum(e.self_cpu_time_total for e in top if e.key.startswith("aten::")) / steps / 1e3
    lines = [
        f"== {name}: {wall_s * 1e3:.1f} ms/step wall; per step, self time of aten ops "
        f"{ops:.1f} ms, of communication ops (launch + wait) {comm:.1f} ms, the rest "
        f"(Python, dispatch, framework) {wall_s * 1e3 - ops - comm:.1f} ms",
        events.table(sort_by="self_cpu_time_total", row_limit=rows),
    ]
    return "\n".join(lines)


def _is_comm(key: str) -> bool:
    return any(m in key.lower() for m in COMM_MARKERS) and not key.startswith("aten::")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mp.spawn(_rank_main, args=(2, ranks.free_port(), args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
