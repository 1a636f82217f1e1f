"""Benchmark fddp.data_parallel against torch DDP and local training, interleaved in one run."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import netns
import ranks
import report
import torch
from variants import Spec

SWEEP_MB = (1.0, 2.0, 5.0, 25.0, 100.0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", default="mlp,gpt,cnn", help="comma-separated: mlp, gpt, cnn")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--block", type=int, default=2, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument("--batch", type=int, help="rows per rank instead of each workload's own")
    p.add_argument("--sweep", action="store_true", help="bucket sizes 1..100 MiB, fddp and DDP")
    p.add_argument("--sweep-mb", default=",".join(f"{m:g}" for m in SWEEP_MB))
    p.add_argument("--ddp-bucket-mb", type=float, default=5.0, help="DDP 'tuned' without --sweep")
    p.add_argument("--link", metavar="RATE", help="also run behind a tbf-shaped link, e.g. 5gbit")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback regime")
    p.add_argument("--compile", action="store_true", help="also DDP+torch.compile vs compile=True")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory runs")
    p.add_argument("--memory-steps", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torchrun)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default="", help="appended to the result file names")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--regime-json", help=argparse.SUPPRESS)  # internal: run one regime, write
    return p.parse_args(argv)


def specs(args: argparse.Namespace) -> tuple[Spec, ...]:
    """The variants of every workload, in block order."""
    main = [Spec("fddp"), Spec("ddp")]
    if not args.sweep:
        main.append(Spec("ddp", args.ddp_bucket_mb))
    main += [Spec("local"), Spec("forward"), Spec("allreduce")]
    if args.compile:
        main += [Spec("fddp", compile=True), Spec("ddp", compile=True)]
    sweep = []
    if args.sweep:
        sizes = [float(s) for s in args.sweep_mb.split(",")]
        # DDP's default is 25 MiB, so "ddp" is that point of the sweep; fddp has its own default
        sweep = [
            Spec(kind, mb) for mb in sizes for kind in ("fddp", "ddp") if (kind, mb) != ("ddp", 25)
        ]
    return (*main, *sweep)


def run_regime(args: argparse.Namespace, regime: str) -> dict[str, Any]:
    """Time every workload in one launch of ranks per workload; returns raw per-step times."""
    all_specs = specs(args)
    out = {}
    for name in args.workloads.split(","):
        job = ranks.Job(
            workloads=(name,),
            specs={name: all_specs},
            warmup=args.warmup,
            block=args.block,
            rounds=math.ceil(args.steps / args.block),
            device=args.device,
            threads=args.threads,
            batch=args.batch,
        )
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            out[name] = ranks.launch(job, args.world_size, os.path.join(tmp, "r.json"))[name]
        out[name]["wall_s"] = time.perf_counter() - start
        _progress(regime, name, out[name])
    return {"workloads": out, "loadavg": os.getloadavg()}


def _progress(regime: str, name: str, raw: dict[str, Any]) -> None:
    rows = report.variant_rows(raw)
    print(f"[{regime}] {name}: " + ", ".join(f"{r['name']} {r['median_ms']:.1f}" for r in rows))
    sys.stdout.flush()


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant alone in fresh ranks, so that its peak RSS is its own."""
    memory_specs = [Spec("local"), Spec("fddp"), Spec("fddp", donate=False), Spec("ddp")]
    out: dict[str, Any] = {}
    for name in args.workloads.split(","):
        out[name] = {}
        for spec in memory_specs:
            job = ranks.Job(
                workloads=(name,),
                specs={},
                warmup=args.warmup,
                block=args.block,
                rounds=0,
                device=args.device,
                threads=args.threads,
                memory=spec,
                memory_steps=args.memory_steps,
                batch=args.batch,
            )
            with tempfile.TemporaryDirectory() as tmp:
                raw = ranks.launch(job, args.world_size, os.path.join(tmp, "m.json"))
            out[name][spec.name] = raw[name]
            print(f"[memory] {name} {spec.name}: {report.memory_line(raw[name])}")
    return out


def run_link(args: argparse.Namespace, argv: list[str]) -> dict[str, Any] | str:
    """Re-run this script inside a shaped namespace for the link regime; a str says why not."""
    why = netns.unavailable()
    if why is not None:
        return f"emulated link skipped: {why}"
    try:
        with netns.rate_limited(args.link) as name, tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "link.json")
            cmd = ["ip", "netns", "exec", name, sys.executable, os.path.abspath(__file__)]
            subprocess.run([*cmd, *argv, "--regime-json", path], check=True)
            with open(path) as f:
                result = json.load(f)
            result["qdisc"] = netns.qdisc_stats(name)
    except subprocess.CalledProcessError as e:
        if e.cmd[:3] == ("ip", "netns", "add"):
            return f"emulated link skipped: {e.stderr.strip()}"
        raise
    result["rate"] = args.link
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print(f"skipped: --device cuda needs {args.world_size} GPUs, found {_gpus()}")
        return 0
    if args.regime_json:
        with open(args.regime_json, "w") as f:
            json.dump(run_regime(args, "link"), f)
        return 0
    started = datetime.datetime.now()
    meta = report.machine(args, started)
    regimes: dict[str, Any] = {}
    notes: list[str] = []
    if not args.no_loopback:
        regimes["loopback"] = run_regime(args, "loopback")
    if args.link:
        link = run_link(args, argv)
        if isinstance(link, str):
            print(link)
            notes.append(link)
        else:
            regimes["link"] = link
    memory = {} if args.no_memory else run_memory(args)
    meta["loadavg_end"] = os.getloadavg()
    meta["duration_s"] = (datetime.datetime.now() - started).total_seconds()
    results = report.summarize(meta, regimes, memory, notes, vars(args))
    paths = report.write(results, args.out, args.tag, plot=not args.no_plot)
    print(report.headline(results))
    print("wrote " + ", ".join(paths))
    return 0


def _gpus() -> int:
    return torch.cuda.device_count()


if __name__ == "__main__":
    sys.exit(main())
