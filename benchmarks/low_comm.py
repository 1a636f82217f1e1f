"""python benchmarks/low_comm.py --link 100mbit [--outer 0.7:0.9,1.0:0.0]

The character-level GPT of examples/train_gpt.py on 2 gloo ranks behind an emulated link (a
network namespace whose loopback is shaped by tbf, see netns.py), trained by DDP, synchronous
fddp, LocalSGD, DiLoCo (H = 10, 50) and streaming DiLoCo, the last two for every outer
optimizer setting of --outer. DDP and synchronous fddp train --steps steps; the
low-communication variants train --max-factor times as many (more tokens). Every
--eval-every steps the held-out loss of the synchronized parameters (DiLoCo's outer
parameters; LocalSGD's averaged ones) is taken.

Reports per variant, at DDP's token count: training wall time (held-out evaluations
excluded), bytes the namespace's loopback carried per rank (measured, /proc/net/dev), the
payload all-reduced per step at its peak (computed) and the held-out loss; and the time to
target: the wall time (and bytes) at which its held-out loss first came within 2 % of DDP's
final held-out loss, and that time over DDP's wall time. Writes a Markdown report, the JSON
and a plot of held-out loss against wall time to benchmarks/results/<UTC stamp>_low_comm.*.
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
from fddp._lowcomm._low_comm import fragment_bounds

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # ddp, fddp, local_sgd, diloco
    every: int = 1
    fragments: int = 1
    delay: int = 0
    bf16: bool = False
    outer_lr: float = 0.7  # DiLoCo's outer optimizer: SGD, Nesterov where momentum > 0
    outer_momentum: float = 0.9

    @property
    def synchronous(self) -> bool:
        return self.kind in ("ddp", "fddp")


TARGET = 0.02  # time to target: held-out loss within 2 % of DDP's final one


def variants(args: argparse.Namespace) -> list[Variant]:
    """DDP, synchronous fddp, LocalSGD H=10, then per outer setting DiLoCo at each H of
    --every and streaming DiLoCo H=50 F=16 tau=1 bf16."""
    chosen = [
        Variant("DDP", "ddp"),
        Variant("fddp (synchronous)", "fddp"),
        Variant("LocalSGD H=10", "local_sgd", every=10),
    ]
    for lr, momentum in args.outer:
        outer = dict(outer_lr=lr, outer_momentum=momentum)
        tag = f"outer {lr:g}/{momentum:g}"
        for h in args.every:
            chosen.append(Variant(f"DiLoCo H={h} {tag}", "diloco", every=h, **outer))
        chosen.append(
            Variant(
                f"streaming DiLoCo H=50 F=16 tau=1 bf16 {tag}", "diloco", 50, 16, 1, True, **outer
            )
        )
    if args.only is not None:
        chosen = [v for v in chosen if v.name in args.only.split(",")]
    for v in chosen:
        if v.kind == "local_sgd" and args.eval_every % v.every:
            raise SystemExit(
                f"--eval-every {args.eval_every}: {v.name} is synchronized only "
                f"every {v.every} steps; use a multiple of {v.every}"
            )
    return chosen


def _steps(v: Variant, args: argparse.Namespace) -> int:
    return args.steps if v.synchronous else round(args.max_factor * args.steps)


def _outer_settings(text: str) -> list[tuple[float, float]]:
    """``"0.7:0.9,1.0:0.0"``: (outer lr, outer momentum) pairs."""
    return [tuple(float(x) for x in pair.split(":")) for pair in text.split(",")]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--link", default="100mbit", help="tbf rate, e.g. 100mbit")
    p.add_argument("--steps", type=int, default=200, help="DDP's and synchronous fddp's steps")
    p.add_argument(
        "--max-factor",
        type=float,
        default=3.0,
        help="the low-communication variants train this many times --steps",
    )
    p.add_argument("--eval-every", type=int, default=10, help="divides --steps")
    p.add_argument(
        "--outer",
        type=_outer_settings,
        default=_outer_settings("0.7:0.9"),
        help="DiLoCo's outer SGD settings to sweep, LR:MOMENTUM[,...] "
        "(Nesterov where momentum > 0; 1.0:0.0 is LocalSGD's parameter average)",
    )
    p.add_argument(
        "--every",
        type=lambda s: [int(h) for h in s.split(",")],
        default=[10, 50],
        help="DiLoCo's H values (non-streaming)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--only", help="comma-separated variant names (default: all)")
    p.add_argument("--inside", help=argparse.SUPPRESS)  # the JSON path, run in the namespace
    args = p.parse_args(argv)
    if args.steps % args.eval_every:
        p.error("--eval-every must divide --steps (the same-tokens figures are taken there)")
    return args


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
                    outer=optim.sgd(
                        v.outer_lr, momentum=v.outer_momentum, nesterov=v.outer_momentum > 0
                    ),
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

        def current():  # the synchronized parameters: DiLoCo's outer ones, else the inner
            return holder["state"].params if v.kind == "diloco" else holder["params"]

    gen.manual_seed(1)

    @torch.no_grad()
    def evaluate() -> float:
        return fddp.pmean(loss_fn(current(), eval_x, eval_y)).item()

    curve = [(0, 0.0, 0.0, evaluate())]  # (step, training wall s, bytes sent per rank, loss)
    loads = []  # the machine's 1-minute load average at each evaluation (2: the ranks alone)
    dist.barrier()
    start = _lo_bytes()
    train_s = 0.0
    for i in range(1, _steps(v, args) + 1):
        x, y = batch()
        t = time.perf_counter()
        run(x, y)
        train_s += time.perf_counter() - t
        if i % args.eval_every == 0:  # bytes: both ranks' traffic (and the tiny evaluations)
            curve.append((i, train_s, (_lo_bytes() - start) / world, evaluate()))
            loads.append(os.getloadavg()[0])
    if rank == 0:
        at = next(c for c in curve if c[0] == args.steps)  # DDP's token count
        result = {
            "name": v.name,
            "variant": dataclasses.asdict(v),
            "steps": _steps(v, args),
            "wall_s": at[1],
            "bytes_per_rank": at[2],
            "peak_bytes_per_step": _peak_bytes_per_step(v, params) if v.kind != "ddp" else None,
            "eval_loss": at[3],
            "curve": curve,
            "load": sum(loads) / len(loads),
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _inside(args: argparse.Namespace) -> None:
    results = []
    for v in variants(args):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            mp.spawn(_train, args=(ranks.free_port(), v, args, path), nprocs=2, join=True)
            results.append(json.loads(Path(path).read_text()))
        r = results[-1]
        last = r["curve"][-1]
        print(
            f"{r['name']}: at step {args.steps} {r['wall_s']:.1f} s, "
            f"{r['bytes_per_rank'] / 1e6:.1f} MB/rank, eval loss {r['eval_loss']:.4f}; "
            f"at step {last[0]} {last[1]:.1f} s, eval loss {last[3]:.4f}",
            flush=True,
        )
    Path(args.inside).write_text(json.dumps(results))


def _first_within(r: dict, target: float) -> list | None:
    """The first evaluation (step, wall s, bytes per rank, loss) at or below ``target``."""
    return next((c for c in r["curve"] if c[3] <= target), None)


def _report(
    results: list[dict], args: argparse.Namespace, stamp: str, qdisc: str, command: str
) -> str:
    ddp = results[0]
    ddp_loss = ddp["eval_loss"]
    target = ddp_loss * (1 + TARGET)
    grad_bytes = sum(p.numel() for p in _setup(args)["model"].parameters()) * 4
    same = [
        "| variant | wall s | x DDP | MB sent per rank | peak payload per step | x DDP | "
        "held-out loss | vs DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        peak = r["peak_bytes_per_step"] or grad_bytes
        same.append(
            f"| {r['name']} | {r['wall_s']:.1f} | {r['wall_s'] / ddp['wall_s']:.2f} | "
            f"{r['bytes_per_rank'] / 1e6:.1f} | {peak / 1e3:.0f} kB | {peak / grad_bytes:.3f} | "
            f"{r['eval_loss']:.4f} | {r['eval_loss'] / ddp_loss - 1:+.1%} |"
        )
    reach = [
        "| variant | steps trained | within 2 % at step | wall s | x DDP's wall time | "
        "MB sent per rank | best held-out loss | vs DDP | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hit = _first_within(r, target)
        best = min(c[3] for c in r["curve"])
        if hit is None:
            cells = "not reached | | | | "
        else:
            cells = (
                f"{hit[0]} | {hit[1]:.1f} | {hit[1] / ddp['wall_s']:.2f} | {hit[2] / 1e6:.1f} | "
            )
        reach.append(
            f"| {r['name']} | {r['steps']} | {cells}{best:.4f} | {best / ddp_loss - 1:+.1%} | "
            f"{r['load']:.1f} |"
        )
    low = round(args.max_factor * args.steps)
    return "\n".join(
        [
            f"# Low-communication data parallelism behind a {args.link} link ({stamp})",
            "",
            f"`{command}`: 2 gloo ranks, GPT {args.layers} layers x {args.dim}, seq {args.seq}, "
            f"batch {args.batch} per rank, {grad_bytes / 1e6:.2f} MB of fp32 parameters, inner "
            f"AdamW lr {args.lr}. DDP and synchronous fddp train {args.steps} steps; LocalSGD "
            f"and DiLoCo {low} ({args.max_factor:g}x the tokens). DiLoCo's outer optimizer: SGD "
            "with lr/momentum as named (Nesterov where the momentum is not 0; 1/0 is LocalSGD's "
            f"parameter average). Held-out loss every {args.eval_every} steps, of the "
            "synchronized parameters (DiLoCo's outer parameters, LocalSGD's averaged ones, "
            "the replicated ones of DDP and fddp). Wall time: the training calls only (compiles "
            "done before, evaluations excluded). MB sent: the namespace's loopback, both ranks' "
            "traffic halved (headers, the per-call 16-byte checks and the evaluations' scalar "
            "all-reduces included). Peak payload: the largest all-reduce of one step (DDP: every "
            "gradient, fp32).",
            "",
            f"## The same tokens: every variant at step {args.steps}",
            "",
            *same,
            "",
            f"## Time to target: held-out loss within 2 % of DDP's final {ddp_loss:.4f} "
            f"(<= {target:.4f})",
            "",
            "The first evaluation at or below the target; x DDP's wall time: that time over DDP's "
            f"whole {args.steps}-step wall time ({ddp['wall_s']:.1f} s). Best: the lowest "
            "held-out loss of the whole run. Load: the machine's 1-minute load average at the "
            "evaluations, their mean (the 2 ranks alone make 2 on these "
            f"{os.cpu_count()} cores; more is other work slowing the compute). The losses are "
            "seeded and the same from run to run; the wall times are not.",
            "",
            *reach,
            "",
            f"torch {torch.__version__}, fddp commit {_git_commit()}, {os.cpu_count()} cores.",
            "",
            "```",
            qdisc,
            "```",
        ]
    )


def _git_commit() -> str:
    root = RESULTS.parents[1]
    git = ["git", "-C", str(root)]
    done = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "fddp", "benchmarks"]).returncode
    return (done.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def _plot(results: list[dict], path: Path, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    outers = sorted({(r["variant"]["outer_lr"], r["variant"]["outer_momentum"]) for r in results})
    for r in results:
        v = r["variant"]
        dashed = v["kind"] == "diloco" and (v["outer_lr"], v["outer_momentum"]) != outers[0]
        _, t, _, loss = zip(*r["curve"])
        wide = v["kind"] == "ddp"  # under synchronous fddp's identical curve
        ax.plot(t, loss, ls="--" if dashed else "-", lw=3 if wide else 1.2, label=r["name"])
    target = results[0]["eval_loss"] * (1 + TARGET)
    ax.axhline(target, color="k", lw=0.8, ls=":", label="DDP's final held-out loss + 2 %")
    lowest = min(c[3] for r in results for c in r["curve"])
    ax.set_ylim(lowest - 0.05, target + 0.75)
    ax.set_xlabel("training wall time, s")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"GPT on 2 ranks behind a {link} link")
    ax.legend(fontsize=7)
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
    command = " ".join(["python benchmarks/low_comm.py", *argv])
    Path(f"{base}.md").write_text(_report(results, args, stamp, qdisc, command) + "\n")
    _plot(results, Path(f"{base}.png"), args.link)
    print(Path(f"{base}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
