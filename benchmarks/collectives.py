"""The collectives fddp builds on, timed alone on this machine's backend: all-reduce,
reduce-scatter (the backend's own, and as an all-to-all plus a local sum), all-gather.

    python benchmarks/collectives.py [--world-size 2] [--mb 1,4,16] [--repeats 20]

Prints the median milliseconds per call of each, per tensor size (float32, the full tensor's
size: the all-gather's output, the reduce-scatter's input). fddp's ``psum_scatter`` chooses its
gloo form from these figures (``fddp/_collectives/_ops.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mb", default="1,4,16", help="tensor sizes in MiB")
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args(argv)


def probes(mb: float, world: int) -> dict[str, Callable[[], None]]:
    n = int(mb * 2**18) // world * world
    full, shard = torch.randn(n), torch.randn(n // world)
    received = torch.empty(n)

    def exchange_then_sum() -> None:
        dist.all_to_all_single(received, full)
        torch.sum(received.view(world, -1), 0, out=shard)

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_to_all+sum": exchange_then_sum,
        "all_gather": lambda: dist.all_gather_into_tensor(received, shard),
    }


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    ranks.join_world(rank, world, port, threads=1)
    sizes = [float(s) for s in args.mb.split(",")]
    rows = [
        (mb, {k: median_ms(f, args.repeats) for k, f in probes(mb, world).items()}) for mb in sizes
    ]
    if rank == 0:
        names = list(rows[0][1])
        print(f"{dist.get_backend()}, {world} ranks, median ms per call")
        print("MiB".rjust(6) + "".join(name.rjust(16) for name in names))
        for mb, times in rows:
            print(f"{mb:6g}" + "".join(f"{times[name]:16.2f}" for name in names))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    mp.spawn(rank_main, args=(args.world_size, ranks.free_port(), args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
