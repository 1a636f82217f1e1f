"""Per-rank side: spawn ranks, time variants in interleaved blocks, or measure one's memory."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import resource
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import variants
from workloads import WORKLOADS, Workload, param_count, rank_batches

import fddp


@dataclasses.dataclass(frozen=True)
class Job:
    """What every rank of one launch does; ``memory`` names a variant to measure alone."""

    workloads: tuple[str, ...]
    specs: dict[str, tuple[variants.Spec, ...]]
    warmup: int
    block: int
    rounds: int  # timed blocks per variant
    device: str
    threads: int
    memory: variants.Spec | None = None
    memory_steps: int = 5
    batch: int | None = None  # rows per rank instead of each workload's own

    def workload(self, name: str) -> Workload:
        if self.batch is None:
            return WORKLOADS[name]
        return dataclasses.replace(WORKLOADS[name], per_rank=self.batch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: Job, world: int, out_path: str) -> dict[str, Any]:
    """Run ``job`` on ``world`` fresh processes; rank 0's results come back through a file."""
    port = free_port()
    mp.spawn(_rank_main, args=(world, port, job, out_path), nprocs=world, join=True)
    with open(out_path) as f:
        return json.load(f)


def join_world(rank: int, world: int, port: int, threads: int) -> None:
    """Set the environment torchrun would set for a single-node job, then ``fddp.init()``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    fddp.init()


def _rank_main(rank: int, world: int, port: int, job: Job, out_path: str) -> None:
    join_world(rank, world, port, job.threads)
    device = _device(job.device, rank)
    if job.memory is not None:
        results = {name: _memory(job, name, device) for name in job.workloads}
    else:
        results = {name: _time_workload(job, name, device) for name in job.workloads}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(variant: variants.Variant, batch: variants.Batch, device: torch.device) -> float:
    start = time.perf_counter()
    variant.step(batch)
    _sync(device)
    return time.perf_counter() - start


def _time_workload(job: Job, name: str, device: torch.device) -> dict[str, Any]:
    """Build every variant, then time them in interleaved blocks: A B C D, B C D A, ...

    Every variant plays in every round, untimed ones first (warm-up), and each round starts one
    variant later, so that neither how often nor where in a round a variant runs favours it.
    """
    workload = job.workload(name)
    batches = rank_batches(workload, dist.get_world_size(), dist.get_rank(), device)
    specs = job.specs[name]
    built, first_call = {}, {}
    for spec in specs:
        dist.barrier()
        built[spec.name] = variants.build(spec, workload, device)
        first_call[spec.name] = _timed(built[spec.name], batches[0], device)
    times: dict[str, list[float]] = {n: [] for n in built}
    cpu: dict[str, float] = dict.fromkeys(built, 0.0)
    warm = math.ceil(job.warmup / job.block)
    for r in range(-warm, job.rounds):
        for spec in specs[r % len(specs) :] + specs[: r % len(specs)]:
            gc.collect()
            dist.barrier()
            cpu_start = time.process_time()
            for i in range(job.block):
                batch = batches[(r * job.block + i) % len(batches)]
                step_s = _timed(built[spec.name], batch, device)
                if r >= 0:
                    times[spec.name].append(step_s)
            if r >= 0:
                cpu[spec.name] += time.process_time() - cpu_start
    out = {
        "params": param_count(workload.build()),
        "per_rank": workload.per_rank,
        "block": job.block,
        "variants": {
            n: {
                **v.info(),
                "first_call_s": first_call[n],
                "times_s": _max_over_ranks(times[n]),
                "rounds": list(range(job.rounds)),
                "cpu_share": _cpu_share(cpu[n], times[n]),
            }
            for n, v in built.items()
        },
        "parity": _parity(built),
    }
    del built
    gc.collect()
    return out


def _cpu_share(cpu_s: float, wall: list[float]) -> list[float]:
    """Per rank, CPU seconds / wall seconds over the timed steps: under 1 when descheduled."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cpu_s / max(sum(wall), 1e-9))
    return gathered


def _max_over_ranks(times: list[float]) -> list[float]:
    """Per step, the slowest rank's time: a step is done when every rank is done."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return [max(step) for step in zip(*gathered)]


def _parity(built: dict[str, variants.Variant]) -> dict[str, float]:
    """Largest |difference| of each model's parameters from DDP's, after the same steps."""
    ref = built["ddp"].parameters() if "ddp" in built else None
    out = {}
    for n, v in built.items():
        params = v.parameters()
        if ref is None or params is None or v.spec.kind == "local" or n == "ddp":
            continue
        out[n] = max((params[k] - ref[k]).abs().max().item() for k in ref)
    return out


def _memory(job: Job, name: str, device: torch.device) -> dict[str, Any]:
    """Peak memory of one variant alone: after its first call and warm-up, over a few steps."""
    workload = job.workload(name)
    batches = rank_batches(workload, dist.get_world_size(), dist.get_rank(), device)
    base = _rss_now()
    variant = variants.build(job.memory, workload, device)
    first = _timed(variant, batches[0], device)
    for i in range(job.warmup):
        _timed(variant, batches[(i + 1) % len(batches)], device)
    dist.barrier()
    _reset_peak(device)
    for i in range(job.memory_steps):
        _timed(variant, batches[i % len(batches)], device)
    out = {
        "first_call_s": first,
        "rss_base_bytes": base,
        "rss_step_peak_bytes": _read_status("VmHWM"),
        "rss_process_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "info": variant.info(),
    }
    if device.type == "cuda":
        out["cuda_step_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


def _reset_peak(device: torch.device) -> None:
    """Start a fresh peak: Linux resets VmHWM to the current RSS on ``clear_refs`` 5."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _read_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_now() -> int:
    return _read_status("VmRSS")
