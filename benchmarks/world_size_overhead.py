"""What fddp's cross-rank agreement costs per call as the world grows: 2, 4, 8, 16 gloo ranks.

    python benchmarks/world_size_overhead.py [--world-sizes 2,4,8,16] [--rounds 40] [--block 5]

Every call of a ``data_parallel`` step after the first checks that the ranks agree on what they
call (``fddp/_step/_call_check.py``: the arguments' signature, ``fddp/_ranks/_signature.py``,
and the step's options, one all-reduce of a 56-bit digest); the first call with a signature
also compares the replicated arguments' digests and all-gathers every tensor argument's digest
(``fddp/_ranks/_agree.py``, ``fddp/_ranks/_digests.py``) to learn which are per rank. Timed per
world size, on gloo loopback, beside a bare ``dist.all_reduce`` of one float for scale (median
and p90 of the slowest rank's time per call, microseconds; the probes take turns in blocks of
calls, each round in another order, with a barrier before every call):

- ``all_reduce``: ``dist.all_reduce`` of one float32, the scale;
- ``digest check``: the check's own collective (``DigestCheck``: an all-reduce of two int64);
- ``signature check``: what a cached call adds before its program runs: the signature of a
  training step's arguments (an MLP's parameters, AdamW state and batch, 27 leaves), and its
  check launched and settled (the step object's own ``CallCheck``);
- ``pmean step``: a cached call of ``data_parallel(lambda x: fddp.pmean(x))`` on one float,
  traced (``pmean step``) and ``trace=False`` (``eager step``); the step minus ``all_reduce`` is
  fddp's whole per-call overhead on a step whose only communication is that all-reduce;
- first call: ``replica digests`` (``check_identical`` of the parameters and optimizer state:
  their digests and one all-reduce) and ``varying`` (every tensor argument's digest,
  all-gathered), beside a bare ``all_gather`` of the same ``(27, 2)`` int64 digests.

Each world size is one launch of fresh ranks (``ranks.join_world``, one thread each as under
torchrun). A world larger than the machine's cores is oversubscribed: its ranks take turns on
the cores, so its times are scheduling as much as communication; compare world sizes on one
machine, not machines. Prints the table and writes it to
``benchmarks/results/<UTC time>_world_size_overhead.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import optree
import provenance
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fddp
import fddp.optim as optim
from fddp._ranks._agree import DigestCheck
from fddp._ranks._digests import check_identical, varying
from fddp._ranks._signature import signature_of

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIZES = (64, 64, 64, 64, 8)  # the MLP whose step's arguments are checked: 8 parameter leaves
ROWS = 16

COLUMNS = (  # (probe, heading)
    ("all_reduce", "all_reduce"),
    ("digest_check", "digest check"),
    ("signature_check", "signature check"),
    ("pmean_step", "pmean step"),
    ("eager_step", "eager step"),
    ("replica_digests", "replica digests"),
    ("varying", "varying"),
    ("all_gather", "all_gather"),
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4,8,16", help="comma-separated")
    p.add_argument("--rounds", type=int, default=40, help="rounds of every probe in turn")
    p.add_argument("--block", type=int, default=5, help="calls of one probe per turn")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls of each probe first")
    p.add_argument("--out", default=RESULTS, help="directory of the markdown report")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def _training_arguments() -> tuple:
    """A training step's arguments: an MLP's parameters, its AdamW state, a batch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(SIZES) - 1):
        layers += [torch.nn.Linear(SIZES[i], SIZES[i + 1]), torch.nn.Tanh()]
    params = fddp.state(torch.nn.Sequential(*layers[:-1]))[0]
    batch = {"x": torch.randn(ROWS, SIZES[0]), "y": torch.randn(ROWS, SIZES[-1])}
    return params, optim.adamw(1e-3).init(params), batch


def probes() -> dict[str, Callable[[], Any]]:
    """Every probe, set up on this rank (the steps called once: their later calls are cached)."""
    one = torch.zeros(1)
    args = _training_arguments()
    tensors = [x for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    digests = torch.zeros(len(tensors), 2, dtype=torch.int64)
    gathered = [torch.empty_like(digests) for _ in range(dist.get_world_size())]
    value = 0x1234_5678_9ABC

    def train_step(params, opt_state, batch):  # never run: its step object's check is timed
        return params, opt_state, fddp.pmean(batch["x"].sum())

    training = fddp.data_parallel(train_step, trace=False)
    training(*args)  # the first call: its check is agreed, its signature's lines cached
    calls = training._calls  # the step object's CallCheck

    def signature_check() -> None:
        signature, _ = signature_of(args)
        calls.launch(signature, args, "called the step").settle()

    traced = fddp.data_parallel(fddp.pmean, check_replicas=False)
    eager = fddp.data_parallel(fddp.pmean, check_replicas=False, trace=False)
    x = torch.full((1,), float(dist.get_rank()))
    traced(x), eager(x)
    return {
        "all_reduce": lambda: dist.all_reduce(one),
        "digest_check": lambda: DigestCheck(value, None).same(),
        "signature_check": signature_check,
        "pmean_step": lambda: traced(x),
        "eager_step": lambda: eager(x),
        "replica_digests": lambda: check_identical(list(args[:2]), None, "arguments"),
        "varying": lambda: varying(tensors, None),
        "all_gather": lambda: dist.all_gather(gathered, digests),
    }


def time_probes(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each probe's per-call seconds on this rank, interleaved in rounds of blocks."""
    todo = probes()
    names = list(todo)
    for name in names:
        for _ in range(args.warmup):
            todo[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = todo[name]
            for _ in range(args.block):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return times


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    ranks.join_world(rank, world, port, threads=1)
    mine = time_probes(args)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = {k: [max(t) for t in zip(*(e[k] for e in everyone))] for k in mine}
        with open(path, "w") as f:
            json.dump(slowest, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """One run of fresh ranks; per probe, the slowest rank's seconds of each call."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "times")
        mp.spawn(rank_main, args=(world, ranks.free_port(), args, path), nprocs=world)
        with open(path) as f:
            return json.load(f)


def summarize(times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """(median, p90) microseconds per probe, and fddp's overhead on the pmean step."""
    out = {}
    for name, seconds in times.items():
        us = sorted(s * 1e6 for s in seconds)
        out[name] = (statistics.median(us), us[int(0.9 * (len(us) - 1))])
    bare = out["all_reduce"][0]
    out["overhead"] = (out["pmean_step"][0] - bare, out["eager_step"][0] - bare)
    return out


def table(rows: dict[int, dict[str, tuple[float, float]]]) -> str:
    head = ["ranks", *(h for _, h in COLUMNS), "step - all_reduce (traced / eager)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for world, row in rows.items():
        cells = [str(world)] + [f"{row[k][0]:.0f} ({row[k][1]:.0f})" for k, _ in COLUMNS]
        cells.append(f"{row['overhead'][0]:.0f} / {row['overhead'][1]:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(
    rows: dict, skipped: dict[int, str], meta: dict[str, Any], args: argparse.Namespace
) -> str:
    cores = meta["cores"]
    over = [w for w in rows if w > cores]
    parts = [
        "# fddp's agreement overhead by world size (gloo loopback)",
        "",
        f"{meta['date']} UTC; fddp {meta['fddp']} commit {meta['commit']}"
        f" ({_changes(meta['uncommitted'])}), torch {meta['torch']},"
        f" Python {meta['python']}; {meta['cpu']}, {cores} cores; load average at start"
        f" {meta['load_start']}, at end {meta['load_end']}; {meta['duration_s']:.0f} s.",
        f"`python benchmarks/world_size_overhead.py --world-sizes {args.world_sizes} --rounds"
        f" {args.rounds} --block {args.block}`: {args.rounds * args.block} timed calls per"
        " probe and world size, interleaved.",
        "",
        "Median (p90) microseconds per call, the slowest rank's time; the columns are described"
        " in the script's docstring. `signature check` and `pmean step` are what every call"
        " after the first pays; `replica digests` and `varying` are paid once, on the first"
        " call with a signature.",
        "",
        table(rows),
        "",
    ]
    if over:
        parts.append(
            f"**Oversubscribed**: {', '.join(map(str, over))} ranks on {cores} cores, one thread"
            " each: the ranks take turns on the cores, so these times measure the scheduler as"
            " much as gloo and fddp (compare the columns within a row more than the rows), not"
            " what the same world size costs on machines of its own."
        )
    for world, why in skipped.items():
        parts.append(f"{world} ranks did not run: {why}")
    return "\n".join(parts) + "\n"


def _changes(porcelain: str) -> str:
    if porcelain == "unknown":
        return "changes unknown"
    files = len(porcelain.splitlines())
    return f"{files} uncommitted files in fddp/" if files else "no uncommitted changes"


def main(argv: list[str] | None = None) -> int:
    import compare_ddp  # its machine description; imported here, not in every rank

    args = parse(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    rows: dict[int, dict[str, tuple[float, float]]] = {}
    skipped: dict[int, str] = {}
    for world in (int(w) for w in args.world_sizes.split(",")):
        begin = time.perf_counter()
        try:
            rows[world] = summarize(launch(world, args))
        except Exception as e:  # a world too large for this machine: say so, keep the others
            lines = [line for line in str(e).splitlines() if line.strip()]
            skipped[world] = f"{type(e).__name__}: {lines[-1] if lines else e!r}"
            print(e, flush=True)
            print(f"{world} ranks: skipped ({skipped[world]})", flush=True)
            continue
        row = rows[world]
        print(
            f"{world} ranks ({time.perf_counter() - begin:.0f} s): all_reduce"
            f" {row['all_reduce'][0]:.0f} us, signature check {row['signature_check'][0]:.0f} us,"
            f" pmean step {row['pmean_step'][0]:.0f} us",
            flush=True,
        )
    load = ", ".join(f"{x:.2f}" for x in load_start)
    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M:%S"),
        "fddp": fddp.__version__,
        "commit": provenance.commit(),
        "uncommitted": provenance.git("status", "--porcelain", "--", "."),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu": compare_ddp._cpu_model(),
        "cores": os.cpu_count(),
        "load_start": load,
        "load_end": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "duration_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
    }
    text = report(rows, skipped, meta, args)
    print(text)
    if not args.no_write and rows:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{started.strftime('%Y%m%dT%H%M%S')}_world_size_overhead.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
