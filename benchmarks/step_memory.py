"""Bytes allocated at once within one training step, per variant, on 2 gloo ranks:
python benchmarks/step_memory.py --workload mlp --variants fddp,fddp+zero,ddp,ddp+zero
(fully sharded parameters against FSDP2: --variants fddp+zero,fddp+full,fsdp2,ddp; --live 8 lists
what is alive at each variant's peak, by the op that allocated it)

Peak RSS (compare_ddp.py's memory runs) also counts memory the allocator keeps after a free;
this counts live tensor bytes: the torch profiler's allocation events of one step after warm-up,
summed in time order, from the step's start (parameters and optimizer state already held).
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compare_ddp import Spec, build
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from workloads import WORKLOADS, rank_batches


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split(":")[0])
    p.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    p.add_argument("--variants", default="fddp,fddp+zero,ddp,ddp+zero")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument(
        "--live",
        type=int,
        default=0,
        metavar="N",
        help="also list, on rank 0, the N ops whose allocations hold the most bytes at the peak",
    )
    return p.parse_args(argv)


def peak_bytes(prof: profile) -> int:
    """The most bytes alive at once, counting from the start of the profiled region."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _allocations(prof: profile) -> list[tuple[int, int, int, str]]:
    """(time, address, bytes, the outermost op around it) of every allocation and free (negative
    bytes), in time order."""
    out = []

    def walk(event: Any, op: str | None) -> None:
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            out.append((event.start_time_ns, fields.ptr, fields.alloc_size, op or "(no op)"))
        if op is None and event.tag == _EventType.TorchOp:
            op = event.name
        for child in event.children:
            walk(child, op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    return sorted(out)


def live_at_peak(prof: profile) -> list[tuple[str, int, int]]:
    """(op, bytes, allocations) of what the step allocated and still holds at its peak, most
    bytes first; a free of a tensor made before the step lowers the peak but is not listed."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for _, address, nbytes, op in _allocations(prof):
        now += nbytes
        if nbytes > 0:
            live[address] = (nbytes, op)
        else:
            live.pop(address, None)
        if now > peak:
            peak, at_peak = now, dict(live)
    by_op: dict[str, list[int]] = collections.defaultdict(list)
    for nbytes, op in at_peak.values():
        by_op[op].append(nbytes)
    return sorted(((op, sum(b), len(b)) for op, b in by_op.items()), key=lambda t: -t[1])


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    ranks.join_world(rank, world, port, 1)
    workload = WORKLOADS[args.workload]
    batches = rank_batches(workload, world, rank, torch.device("cpu"))
    for name in args.variants.split(","):
        variant = build(Spec.from_name(name), workload, torch.device("cpu"))
        for i in range(args.warmup):
            variant.step(batches[i % len(batches)])
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            variant.step(batches[0])
        info = variant.info()
        rest = info.get("param_bytes", 0) + (info.get("state_bytes") or 0)
        peaks = [None] * world
        dist.all_gather_object(peaks, (peak_bytes(prof), rest))
        if rank == 0:
            step, at_rest = max(p for p, _ in peaks), max(r for _, r in peaks)
            print(
                f"{args.workload} {name}: {step / 2**20:.1f} MiB allocated at most within the "
                f"step; parameters + optimizer state at rest {at_rest / 2**20:.1f} MiB; "
                f"together {(step + at_rest) / 2**20:.1f} MiB"
            )
            for op, nbytes, count in live_at_peak(prof)[: args.live]:
                print(f"    {nbytes / 2**20:7.2f} MiB in {count:3d} from {op}")
        del variant
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    mp.spawn(_rank_main, args=(2, ranks.free_port(), args), nprocs=2)


if __name__ == "__main__":
    main()
