"""fddp.recoverable: per-step cost when nothing fails, and recovery time after a SIGKILL.

``python benchmarks/recovery.py [--world 3] [--pairs 12] [--workloads mlp gpt]`` starts, per
workload, ``--world`` gloo ranks on this machine around a ``TCPStore`` this process hosts. Each
rank times a plain ``fddp.data_parallel`` step (its share of the global batch, ``pmean``) and
the ``fddp.recoverable`` step (the global batch, the same rows per rank) interleaved, pair by
pair, after a warm-up; then the last rank SIGKILLs itself before a step, and the survivors
time from the kill (its time stamp in the store) to their next committed step. Writes
``benchmarks/results/<time>_recovery.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import DATA_SEED, WORKLOADS, build_model, param_count

RESULTS = Path(__file__).resolve().parent / "results"


def worker(args: argparse.Namespace) -> None:
    import fddp

    workload = WORKLOADS[args.workload]
    world, rank = args.world, args.rank
    store = dist.TCPStore(
        "127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    model = build_model(workload, torch.device("cpu"))
    apply = fddp.functional(model)
    opt = fddp.optim.adamw(1e-4)

    def loss_fn(params, batch):
        return workload.loss(apply(params, {}, batch[0]), batch[1])

    def plain(params, opt_state, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return fddp.optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    rstep = fddp.recoverable(
        loss_fn,
        opt,
        store=store,
        rank=rank,
        world_size=world,
        micro_batches=world,
        timeout=args.timeout,
        settle=args.settle,
    )
    pstep = fddp.data_parallel(plain)
    params = fddp.state(model)[0]
    opt_state = opt.init(params)
    gen = torch.Generator().manual_seed(DATA_SEED)
    global_batch = workload.make_batch(workload.per_rank * world, gen)
    local = tuple(
        x[rank * workload.per_rank : (rank + 1) * workload.per_rank] for x in global_batch
    )

    def timed(fn, *call_args):
        start = time.perf_counter()
        out = fn(*call_args)
        return time.perf_counter() - start, out

    for _ in range(2):  # warm-up: compiles, the link and compute figures
        pstep(params, opt_state, local)
        rstep(params, opt_state, global_batch)
    times: dict[str, list[float]] = {"plain": [], "recoverable": []}
    for i in range(args.pairs):
        order = ("plain", "recoverable") if i % 2 == 0 else ("recoverable", "plain")
        for name in order:
            if name == "plain":
                t, _ = timed(pstep, params, opt_state, local)
            else:
                t, _ = timed(rstep, params, opt_state, global_batch)
            times[name].append(t)
    if rank == world - 1:
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    params, opt_state, _ = rstep(params, opt_state, global_batch)  # the failed, redone step
    recovered_at = time.time()
    killed_at = float(store.get("killed_at").decode())
    after, _ = timed(rstep, params, opt_state, global_batch)
    (recovery,) = rstep.recoveries
    result = {
        "rank": rank,
        "params": param_count(model),
        "plain_s": times["plain"],
        "recoverable_s": times["recoverable"],
        "kill_to_commit_s": recovered_at - killed_at,
        "agree_and_regroup_s": recovery.seconds,
        "step_after_s": after,
        "members_after": list(rstep.members),
    }
    Path(args.out).write_text(json.dumps(result))
    rstep.close()


def run_workload(name: str, args: argparse.Namespace, directory: Path) -> list[dict]:
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--workload",
                name,
                "--world",
                str(args.world),
                "--rank",
                str(r),
                "--port",
                str(store.port),
                "--pairs",
                str(args.pairs),
                "--timeout",
                str(args.timeout),
                "--settle",
                str(args.settle),
                "--out",
                str(directory / f"{name}{r}.json"),
            ],
            env=env,
        )
        for r in range(args.world)
    ]
    for p in procs:
        p.wait(timeout=1200)
    return [json.loads((directory / f"{name}{r}.json").read_text()) for r in range(args.world - 1)]


def summarize(name: str, ranks: list[dict]) -> dict:
    plain = statistics.median(t for r in ranks for t in r["plain_s"])
    recov = statistics.median(t for r in ranks for t in r["recoverable_s"])
    return {
        "workload": name,
        "params": ranks[0]["params"],
        "plain_ms": plain * 1e3,
        "recoverable_ms": recov * 1e3,
        "overhead_pct": (recov / plain - 1) * 100,
        "pair_ratio_median": statistics.median(
            b / a for r in ranks for a, b in zip(r["plain_s"], r["recoverable_s"])
        ),
        "kill_to_commit_s": max(r["kill_to_commit_s"] for r in ranks),
        "agree_and_regroup_s": max(r["agree_and_regroup_s"] for r in ranks),
        "step_after_ms": statistics.median(r["step_after_s"] for r in ranks) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workload")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    directory = Path(f"/tmp/fddp-recovery-{stamp}")
    directory.mkdir(parents=True)
    rows = [summarize(name, run_workload(name, args, directory)) for name in args.workloads]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stamp}_recovery.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# fddp.recoverable: overhead and recovery time ({stamp}, {args.world} gloo ranks, "
        f"loopback, {os.cpu_count()} cores)",
        "",
        f"Step times are medians over {args.pairs} interleaved pairs on the survivors; recovery "
        f"is from the SIGKILL of rank {args.world - 1} to the survivors' next committed step "
        f"(settle {args.settle:g} s); the redone step traces and compiles the step for the new "
        "group; 'step after' is the next one, on the survivors. Load average during the run: "
        f"{os.getloadavg()[0]:.1f}.",
        "",
        "| workload | params | plain step (ms) | recoverable step (ms) | overhead (medians) | "
        "overhead (median of pair ratios) | kill to commit (s) | of which agree + regroup (s) "
        "| step after (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['params'] / 1e6:.1f}M | {r['plain_ms']:.1f} | "
            f"{r['recoverable_ms']:.1f} | {r['overhead_pct']:+.1f} % | "
            f"{(r['pair_ratio_median'] - 1) * 100:+.1f} % | "
            f"{r['kill_to_commit_s']:.2f} | {r['agree_and_regroup_s']:.2f} | "
            f"{r['step_after_ms']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{stamp}_recovery.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
