"""python benchmarks/low_comm.py --link 100mbit

The character-level GPT of examples/train_gpt.py trained for the same number of tokens, on 2
gloo ranks behind an emulated link (a network namespace whose loopback is shaped by tbf, see
netns.py), by DDP, synchronous fddp, LocalSGD, DiLoCo (H = 10, 50) and streaming DiLoCo.
Reports per variant: training wall time (held-out evaluations excluded), bytes the namespace's
loopback carried per rank (measured, /proc/net/dev), the payload all-reduced per step at its
peak (computed) and the final held-out loss; writes a Markdown report and a plot of held-out
loss against wall time to benchmarks/results/<UTC stamp>_low_comm.*.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import netns
import optree
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, HELD_OUT, Vocab, fixed_windows, load_corpus, sample_batch

import fddp
import fddp.optim as optim
from fddp._low_comm import fragment_bounds

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # ddp, fddp, local_sgd, diloco
    every: int = 1
    fragments: int = 1
    delay: int = 0
    bf16: bool = False


VARIANTS = (
    Variant("DDP", "ddp"),
    Variant("fddp (synchronous)", "fddp"),
    Variant("LocalSGD H=10", "local_sgd", every=10),
    Variant("DiLoCo H=10", "diloco", every=10),
    Variant("DiLoCo H=50", "diloco", every=50),
    Variant("streaming DiLoCo H=50 F=16 tau=1 bf16", "diloco", 50, 16, 1, True),
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--link", default="100mbit", help="tbf rate, e.g. 100mbit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--only", help="comma-separated variant names (default: all)")
    p.add_argument("--inside", help=argparse.SUPPRESS)  # the JSON path, run in the namespace
    return p.parse_args(argv)


def _lo_bytes() -> int:
    """Bytes sent on this network namespace's loopback so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    text = load_corpus()
    vocab = Vocab("".join(sorted(set(text))))
    ids = vocab.encode(text)
    split = int(len(ids) * (1 - HELD_OUT))
    torch.manual_seed(0)
    model = GPT(len(vocab.chars), args.seq, args.dim, args.layers, args.heads)
    return {"model": model, "train": ids[:split], "eval": ids[split:]}


def _peak_bytes_per_step(v: Variant, params: dict[str, torch.Tensor]) -> int:
    """The largest payload all-reduced in one step (the parameters' or gradients' bytes;
    streaming: the largest fragment, in bf16 where it sends bf16)."""
    sizes = [x.numel() for x in optree.tree_leaves(params)]
    width = 2 if v.bf16 else 4
    return max(sum(sizes[a:b]) for a, b in fragment_bounds(sizes, v.fragments)) * width


def _train(rank: int, port: int, v: Variant, args: argparse.Namespace, out: str) -> None:
    ranks.join_world(rank, 2, port, threads=1)
    world = fddp.world_size()
    setup = _setup(args)
    model = setup["model"]
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    eval_x, eval_y = fddp.shard(fixed_windows(setup["eval"], args.seq))

    def loss_fn(p, x, y):
        return F.cross_entropy(apply(p, buffers, x).flatten(0, 1), y.flatten())

    inner = optim.adamw(lr=args.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)

    def batch():
        return fddp.shard(sample_batch(setup["train"], world * args.batch, args.seq, gen))

    if v.kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.1)

        def run(x, y):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
            opt.step()

        def current():
            return dict(model.named_parameters())

    else:
        opt_state = inner.init(params)
        holder: dict[str, Any] = {"params": params, "opt": opt_state}
        if v.kind == "fddp":

            def sync_step(p, s, x, y):
                loss, g = fddp.value_and_grad(loss_fn)(p, x, y)
                u, s = inner.update(fddp.pmean(g), s, p)
                return optim.apply_updates(p, u), s, loss

            pstep = fddp.data_parallel(sync_step, donate_argnums=(0, 1))
            x, y = batch()
            pstep.schedule(params, opt_state, x, y)  # compile before the clock starts

            def run(x, y):
                holder["params"], holder["opt"], _ = pstep(holder["params"], holder["opt"], x, y)

        else:

            def inner_step(p, s, x, y):
                loss, g = fddp.value_and_grad(loss_fn)(p, x, y)
                u, s = inner.update(g, s, p)
                return optim.apply_updates(p, u), s, loss

            if v.kind == "local_sgd":
                lstep = fddp.local_sgd(inner_step, every=v.every, donate_argnums=(1, 2))
            else:
                lstep = fddp.diloco(
                    inner_step,
                    every=v.every,
                    fragments=v.fragments,
                    delay=v.delay,
                    comm_dtype=torch.bfloat16 if v.bf16 else None,
                    donate_argnums=(1, 2),
                )
            holder["state"] = lstep.init(params)
            x, y = batch()
            for c in range(v.every + v.delay):  # compile every phase before the clock starts
                s = holder["state"]._replace(step=torch.tensor(c))
                lstep.schedule(s, params, opt_state, x, y)

            def run(x, y):
                holder["state"], holder["params"], holder["opt"], _ = lstep(
                    holder["state"], holder["params"], holder["opt"], x, y
                )

        def current():
            return holder["params"]

    gen.manual_seed(1)

    @torch.no_grad()
    def evaluate() -> float:
        return fddp.pmean(loss_fn(current(), eval_x, eval_y)).item()

    curve = [(0.0, evaluate())]
    dist.barrier()
    sent = _lo_bytes()
    train_s = 0.0
    for i in range(1, args.steps + 1):
        x, y = batch()
        t = time.perf_counter()
        run(x, y)
        train_s += time.perf_counter() - t
        if i % args.eval_every == 0:
            curve.append((train_s, evaluate()))  # evaluates each rank's own parameters
    sent = _lo_bytes() - sent  # both ranks' traffic (and the tiny evaluations)
    if rank == 0:
        result = {
            "name": v.name,
            "wall_s": train_s,
            "bytes_per_rank": sent / world,
            "peak_bytes_per_step": _peak_bytes_per_step(v, params) if v.kind != "ddp" else None,
            "final_eval_loss": curve[-1][1],
            "curve": curve,
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _inside(args: argparse.Namespace) -> None:
    results = []
    chosen = [v for v in VARIANTS if args.only is None or v.name in args.only.split(",")]
    for v in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            mp.spawn(_train, args=(ranks.free_port(), v, args, path), nprocs=2, join=True)
            results.append(json.loads(Path(path).read_text()))
        r = results[-1]
        print(
            f"{r['name']}: {r['wall_s']:.1f} s, {r['bytes_per_rank'] / 1e6:.1f} MB/rank, "
            f"eval loss {r['final_eval_loss']:.4f}",
            flush=True,
        )
    Path(args.inside).write_text(json.dumps(results))


def _report(results: list[dict], args: argparse.Namespace, stamp: str, qdisc: str) -> str:
    ddp = results[0]
    grad_bytes = sum(p.numel() for p in _setup(args)["model"].parameters()) * 4
    rows = [
        "| variant | wall s | x DDP | MB sent per rank | peak payload per step | x DDP | "
        "held-out loss | vs DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peak = r["peak_bytes_per_step"] or grad_bytes
        loss = r["final_eval_loss"]
        rows.append(
            f"| {r['name']} | {r['wall_s']:.1f} | {r['wall_s'] / ddp['wall_s']:.2f} | "
            f"{r['bytes_per_rank'] / 1e6:.1f} | {peak / 1e3:.0f} kB | {peak / grad_bytes:.3f} | "
            f"{r['final_eval_loss']:.4f} | {loss / ddp['final_eval_loss'] - 1:+.1%} |"
        )
    return "\n".join(
        [
            f"# Low-communication data parallelism behind a {args.link} link ({stamp})",
            "",
            f"`python benchmarks/low_comm.py --link {args.link} --steps {args.steps}`: 2 gloo "
            f"ranks, GPT {args.layers} layers x {args.dim}, seq {args.seq}, batch {args.batch} "
            f"per rank, {grad_bytes / 1e6:.2f} MB of fp32 parameters, inner AdamW lr {args.lr}, "
            f"{args.steps} steps each (the same tokens). Wall time: the training calls only "
            "(compiles done before, evaluations excluded). MB sent: the namespace's loopback, "
            "both ranks' traffic halved (headers and the per-call 16-byte checks included). "
            "Peak payload: the largest all-reduce of one step (DDP: every gradient, fp32).",
            "",
            *rows,
            "",
            f"torch {torch.__version__}, fddp commit {_git_commit()}, {os.cpu_count()} cores.",
            "",
            "```",
            qdisc,
            "```",
        ]
    )


def _git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def _plot(results: list[dict], path: Path, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t, loss = zip(*r["curve"])
        ax.plot(t, loss, marker="o", ms=3, label=r["name"])
    ax.set_xlabel("training wall time, s")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"GPT on 2 ranks behind a {link} link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.inside:
        _inside(args)
        return 0
    why = netns.unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    with netns.rate_limited(args.link) as name, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.json")
        cmd = ["ip", "netns", "exec", name, sys.executable, os.path.abspath(__file__)]
        subprocess.run([*cmd, *argv, "--inside", path], check=True)
        results = json.loads(Path(path).read_text())
        qdisc = netns.qdisc_stats(name)
    RESULTS.mkdir(exist_ok=True)
    base = RESULTS / f"{stamp}_low_comm"
    Path(f"{base}.json").write_text(json.dumps({"args": vars(args), "results": results}))
    Path(f"{base}.md").write_text(_report(results, args, stamp, qdisc) + "\n")
    _plot(results, Path(f"{base}.png"), args.link)
    print(Path(f"{base}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
