"""First call against depth: capture, passes and a restarted job's first call per layer.

For each depth, a pre-norm decoder (width 128, 4 heads, vocabulary 256, sequences of 32, AdamW,
``donate_argnums=(0, 1)``) trains on ``--world-size`` gloo ranks in two jobs that share a
program cache directory: the first compiles (and writes its programs), the second is the same
job restarted, which loads them. Each job reports rank 0's first call (capture + passes +
agreement + one run, from a barrier: a peer still importing is not counted), the capture
alone, and the median of the following steps. A fresh process pays a fixed cost on its first
capture (torch's lazy imports and first dispatches), so the table gives the first call per
layer and the cost of each added layer between rows, which stays flat when every part of the
first call is linear in the graph.

    python benchmarks/depth.py --layers 8,16,32,64,128

``--baseline REV`` also runs the same jobs on git revision REV (its own ``benchmarks/depth.py``,
from a temporary worktree), interleaved depth by depth with this checkout's, and adds its first
calls and the ratio of the two: on a shared machine whose speed drifts by tens of percent
between runs, a comparison within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fddp
import fddp.optim as optim
from benchmarks.provenance import commit, git
from benchmarks.ranks import free_port, join_world
from benchmarks.workloads import GPT

VOCAB, SEQ, WIDTH, HEADS, ROWS = 256, 32, 128, 4, 4


def _job(rank: int, world: int, port: int, layers: int, cache: str, steps: int, out) -> None:
    join_world(rank, world, port, threads=1)
    fddp.set_cache_dir(cache)
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, WIDTH, HEADS, layers)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)
    opt = optim.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = apply(p, buffers, x)
            return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, donate_argnums=(0, 1))
    state = opt.init(params)
    gen = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen) for _ in range(2))
    torch.distributed.barrier()  # the ranks start the first call together
    start = time.perf_counter()
    params, state, loss = pstep(params, state, x, y)
    loss.item()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, state, loss = pstep(params, state, x, y)
        loss.item()
        times.append(time.perf_counter() - start)
    plan = pstep.schedule(params, state, x, y)
    if rank == 0:
        out.put(
            {
                "leaves": len(params),
                "first": first,
                "capture": plan.capture_seconds,
                "how": plan.captured_with,
                "step": statistics.median(times),
            }
        )


def run_job(world: int, layers: int, cache: str, steps: int) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_job, args=(r, world, port, layers, cache, steps, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
    return result


def baseline_row(tree: Path, layers: int, args: argparse.Namespace) -> list[str]:
    """The cells of the row that ``tree``'s own depth.py prints for ``layers``."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [
                sys.executable,
                str(tree / "benchmarks" / "depth.py"),
                "--layers",
                str(layers),
                "--world-size",
                str(args.world_size),
                "--steps",
                str(args.steps),
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {layers} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def seconds(cell: str) -> float:
    return float(cell.removesuffix(" s"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,16,32,64,128")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps after the first call")
    p.add_argument("--baseline", help="a git revision to run interleaved with this checkout")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        tree = None
        if args.baseline:
            tree = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "baseline"
            git("worktree", "add", "--detach", str(tree), args.baseline)
            stack.callback(git, "worktree", "remove", "--force", str(tree))
        run(args, tree)


def run(args: argparse.Namespace, tree: Path | None) -> None:
    rows = []
    header = (
        "| layers | leaves | first call | per layer | per added layer | capture | "
        "passes, agreement, run | restarted first call | steady step |"
    )
    columns = 9
    if tree is not None:
        header += " baseline first call | baseline restarted | first call / baseline |"
        columns += 3
    lines = [header, "|" + "---|" * columns]
    previous: tuple[int, float] | None = None
    print(header, flush=True)
    for layers in (int(x) for x in args.layers.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            fresh = run_job(args.world_size, layers, cache, args.steps)
            again = run_job(args.world_size, layers, cache, args.steps)
        assert again["how"].endswith("loaded from cache"), again["how"]
        added = (
            ""
            if previous is None
            else (f"{(fresh['first'] - previous[1]) / (layers - previous[0]) * 1e3:.0f} ms")
        )
        previous = (layers, fresh["first"])
        row = (
            f"| {layers} | {fresh['leaves']} | {fresh['first']:.2f} s | "
            f"{fresh['first'] / layers * 1e3:.0f} ms | {added} | {fresh['capture']:.2f} s | "
            f"{fresh['first'] - fresh['capture']:.2f} s | {again['first']:.2f} s | "
            f"{fresh['step'] * 1e3:.1f} ms |"
        )
        if tree is not None:
            base = baseline_row(tree, layers, args)
            row += f" {base[2]} | {base[7]} | {fresh['first'] / seconds(base[2]):.2f} |"
        rows.append(row)
        lines.append(row)
        print(row, flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    report = Path(args.out) / f"{stamp}_depth.md"
    report.write_text(
        f"# First call against depth ({args.world_size} gloo ranks, torch {torch.__version__}, "
        f"{os.cpu_count()} cores)\n\n"
        f"`python benchmarks/depth.py{' --baseline ' + args.baseline if args.baseline else ''}` "
        f"at commit {commit()} — rank 0's figures; the restarted job loads the first job's "
        "programs from the cache directory (`fddp.set_cache_dir`)."
        + (
            f" The baseline columns are revision {args.baseline}'s own depth.py, run "
            "interleaved with this checkout's, depth by depth."
            if args.baseline
            else ""
        )
        + "\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
