"""Benchmark fddp.data_parallel against torch DDP and local training, interleaved in one run.

Top to bottom: the flags; the variants (a function per kind that builds a step); one rank's
interleaved timing loop and memory run; the launch of ranks for each workload; the regimes
(loopback, the emulated link) and main. ``report.py`` turns the results into markdown and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import netns
import provenance
import ranks
import report
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from workloads import SMALL_WORKLOADS, WORKLOADS, Workload, build_model, param_count, rank_batches

import fddp
import fddp.optim as optim

SWEEP_MB = (1.0, 2.0, 5.0, 25.0, 100.0)
# --start-method forkserver: what the ranks import that takes seconds (the server's sys.path is
# Python's default one, so this directory's own modules are imported by each rank, quickly)
FORKSERVER_PRELOAD = ("torch", "torch.distributed.optim", "torch.nn.parallel", "fddp", "fddp.optim")
LR, WEIGHT_DECAY = 1e-3, 0.01
Batch = tuple[torch.Tensor, torch.Tensor]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workloads",
        default="mlp,gpt,cnn",
        help="comma-separated, from: " + ", ".join(WORKLOADS),
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--block", type=int, default=2, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument("--batch", type=int, help="rows per rank instead of each workload's own")
    p.add_argument(
        "--small",
        action="store_true",
        help="the mlp, gpt and cnn workloads at a fraction of their sizes (a quick check)",
    )
    p.add_argument("--sweep", action="store_true", help="bucket sizes 1..100 MiB, fddp and DDP")
    p.add_argument("--sweep-mb", default=",".join(f"{m:g}" for m in SWEEP_MB))
    p.add_argument("--ddp-bucket-mb", type=float, default=5.0, help="DDP 'tuned' without --sweep")
    p.add_argument("--link", metavar="RATE", help="also run behind a tbf-shaped link, e.g. 5gbit")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback regime")
    p.add_argument("--compile", action="store_true", help="also DDP+torch.compile vs compile=True")
    p.add_argument(
        "--zero", action="store_true", help="also sharded optimizer state: shard_state vs ZeRO"
    )
    p.add_argument(
        "--overlap", action="store_true", help="also fddp with overlap_steps=True (fddp+overlap)"
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="also fully sharded parameters: fddp.shard_params (fddp+full, and fddp+full+keep "
        "with reshard_after_forward=False) against FSDP2 (fully_shard per block, fsdp2)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory runs")
    p.add_argument("--memory-steps", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torchrun)")
    p.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how ranks start: spawn (a fresh interpreter each) or forkserver (forked from one "
        "server process that has imported torch and fddp, for quick runs)",
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default="", help="appended to the result file names")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--regime-json", help=argparse.SUPPRESS)  # internal: run one regime, write
    return p.parse_args(argv)


# ---- variants: what runs in each timed block ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """Which variant to build: ``kind`` is local, fddp, ddp, forward or allreduce."""

    kind: str
    bucket_mb: float | None = None
    compile: bool = False
    donate: bool = True
    zero: bool = False  # optimizer state sharded: shard_state / ZeroRedundancyOptimizer
    overlap: bool = False  # fddp's overlap_steps=True
    full: bool = False  # fully sharded parameters (fddp.shard_params)
    keep: bool = False  # ... gathered once per step (reshard_after_forward=False)

    @classmethod
    def from_name(cls, name: str) -> Spec:
        """The spec of a plain variant name: ``fddp``, ``ddp@5``, ``fddp+zero``..."""
        name, zero = name.removesuffix("+zero"), name.endswith("+zero")
        name, overlap = name.removesuffix("+overlap"), name.endswith("+overlap")
        name, keep = name.removesuffix("+keep"), name.endswith("+keep")
        name, full = name.removesuffix("+full"), name.endswith("+full")
        kind, _, mb = name.partition("@")
        return cls(
            kind, float(mb) if mb else None, zero=zero, overlap=overlap, full=full, keep=keep
        )

    @property
    def name(self) -> str:
        name = self.kind + ("" if self.bucket_mb is None else f"@{self.bucket_mb:g}")
        name += "" if self.donate else "-nodonate"
        name += "+overlap" if self.overlap else ""
        name += "+full" if self.full else ""
        name += "+keep" if self.keep else ""
        return name + ("+compile" if self.compile else "") + ("+zero" if self.zero else "")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One timed thing: ``step(batch)`` runs a training step (or a probe) to completion;
    ``info()`` gives facts known after a few steps (bytes per all-reduce, capture time);
    ``parameters()`` the trained parameters by name for the parity check (None for probes)."""

    step: Callable[[Batch], None]
    info: Callable[[], dict[str, Any]] = dict
    parameters: Callable[[], dict[str, torch.Tensor] | None] = lambda: None
    finish: Callable[[], None] = lambda: None  # waits for what a step left in flight


def variant_specs(args: argparse.Namespace) -> tuple[Spec, ...]:
    """The variants of every workload, in block order."""
    main = [Spec("fddp"), Spec("ddp")]
    if not args.sweep:
        main.append(Spec("ddp", args.ddp_bucket_mb))
    main += [Spec("local"), Spec("forward"), Spec("allreduce")]
    if args.compile:
        main += [Spec("fddp", compile=True), Spec("ddp", compile=True)]
    if args.zero:
        main += [Spec("fddp", zero=True), Spec("ddp", zero=True)]
    if args.overlap:
        main.insert(1, Spec("fddp", overlap=True))
    if args.fsdp:
        main[1:1] = [Spec("fddp", full=True), Spec("fddp", full=True, keep=True), Spec("fsdp2")]
    sweep = []
    if args.sweep:
        sizes = [float(s) for s in args.sweep_mb.split(",")]
        # DDP's default is 25 MiB, so "ddp" is that point of the sweep; fddp has its own default
        sweep = [
            Spec(kind, mb) for mb in sizes for kind in ("fddp", "ddp") if (kind, mb) != ("ddp", 25)
        ]
    return (*main, *sweep)


def _adamw(model: nn.Module, zero: bool = False) -> torch.optim.Optimizer:
    kwargs = {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True}
    if zero:
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs
        )
    return torch.optim.AdamW(model.parameters(), **kwargs)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (ZeroRedundancyOptimizer: its shard)."""
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return optim.state_bytes([list(s.values()) for s in inner.state.values()])


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v.detach() for k, v in model.named_parameters()}


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer, workload: Workload) -> Callable:
    def step(batch: Batch) -> None:
        x, y = batch
        workload.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def local(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """Plain eager training of this rank's share, no communication."""
    model = build_model(workload, device)
    return Variant(_eager_step(model, _adamw(model), workload), parameters=lambda: _named(model))


def ddp(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """``DistributedDataParallel`` (its defaults unless a bucket size is given), AdamW foreach;
    with ``zero``, AdamW inside ``ZeroRedundancyOptimizer``."""
    kwargs: dict[str, Any] = {}
    if spec.bucket_mb is not None:
        kwargs["bucket_cap_mb"] = spec.bucket_mb
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    module = DistributedDataParallel(build_model(workload, device), **kwargs)
    model = torch.compile(module) if spec.compile else module
    opt = _adamw(module, spec.zero)

    def info() -> dict[str, Any]:
        data = module._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
        return {
            "allreduce_bytes": [int(s) for s in str(sizes).split(",") if s.strip()],
            "state_bytes": _state_bytes(opt),
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        }

    step = _eager_step(model, opt, workload)
    return Variant(step, info, parameters=lambda: _named(module))


def fddp_(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """``fddp.data_parallel`` over a pure step, params and optimizer state donated; its own
    default bucket size unless one is given; with ``zero``, AdamW inside ``shard_state``."""
    model = build_model(workload, device)
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    opt = optim.shard_state(opt) if spec.zero or spec.full else opt
    state = [params, opt.init(params), buffers]
    if spec.full:
        state[0] = fddp.shard_params(params, reshard_after_forward=not spec.keep)
        del params
    kwargs: dict[str, Any] = {} if spec.bucket_mb is None else {"bucket_cap_mb": spec.bucket_mb}
    pstep = fddp.data_parallel(
        _pure_step(model, workload, opt, average_grads=not (spec.zero or spec.full)),
        compile=spec.compile,
        donate_argnums=(0, 1) if spec.donate else (),
        overlap_steps=spec.overlap,
        **kwargs,
    )
    seen: dict[str, Any] = {}  # the first call's seconds, the last batch

    def step(batch: Batch) -> None:
        start = time.perf_counter()
        params, opt_state, buffers, _ = pstep(*state, batch)
        if "first_call_s" not in seen:
            seen["first_call_s"] = time.perf_counter() - start
        state[:] = [params, opt_state, buffers]
        seen["batch"] = batch

    def info() -> dict[str, Any]:
        plan = pstep.schedule(*state, seen["batch"])
        return {
            "allreduce_bytes": [c.nbytes for c in plan.collectives if c.kind.startswith("all_red")],
            "collectives": [
                {"kind": c.kind, "bucket": c.bucket, "nbytes": c.nbytes, "overlap": c.overlapped}
                for c in plan.collectives
            ],
            "capture_s": plan.capture_seconds,
            "first_call_s": seen["first_call_s"],
            "retraces": pstep.retraces,
            "state_bytes": optim.state_bytes(state[1]),
            "param_bytes": optim.state_bytes(state[0]),
            "plan": str(plan),
        }

    def finish() -> None:
        state[:] = fddp.block_until_ready(state)

    def parameters() -> dict[str, torch.Tensor]:
        return dict(fddp.full_params(state[0]) if spec.full else state[0])

    return Variant(step, info, parameters=parameters, finish=finish)


def fsdp2(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """FSDP2: ``fully_shard`` on every block (each child of a ModuleList or Sequential, or
    of the model) and on the root, ``reshard_after_forward=True``; AdamW foreach."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build_model(workload, device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adamw(model)

    def local_bytes(tensors: list[torch.Tensor]) -> int:
        local = [x.to_local() if isinstance(x, DTensor) else x for x in tensors]
        return sum(x.numel() * x.element_size() for x in local)

    def info() -> dict[str, Any]:
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {
            "state_bytes": local_bytes(states),
            "param_bytes": local_bytes(list(model.parameters())),
        }

    def parameters() -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach() for k, v in model.named_parameters()}

    return Variant(_eager_step(model, opt, workload), info, parameters=parameters)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: the children of the model's ModuleLists
    and Sequentials, else its children with parameters."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    found = [c for m in lists for c in m.children() if any(True for _ in c.parameters())]
    return found or [c for c in model.children() if any(True for _ in c.parameters())]


def _pure_step(
    model: nn.Module, workload: Workload, opt: optim.GradientTransformation, average_grads: bool
) -> Callable:
    """The pure step; BatchNorm buffers start from rank 0's values, as DDP broadcasts them.
    ``average_grads=False`` for ``shard_state``, which reduce-scatters the gradients itself."""
    apply = fddp.functional(model, return_buffers=workload.has_buffers)

    def loss_fn(params: dict, buffers: dict, batch: Batch) -> torch.Tensor:
        x, y = batch
        return workload.loss(apply(params, buffers, x), y)

    def loss_bn(params: dict, buffers: dict, batch: Batch) -> tuple[torch.Tensor, dict]:
        x, y = batch
        out, buffers = apply(params, buffers, x)
        return workload.loss(out, y), buffers

    def step(params: dict, opt_state: Any, buffers: dict, batch: Batch) -> tuple:
        if workload.has_buffers:
            buffers = fddp.broadcast(buffers, src=0)
            (loss, buffers), grads = fddp.value_and_grad(loss_bn, has_aux=True)(
                params, buffers, batch
            )
        else:
            loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, batch)
        grads = fddp.pmean(grads) if average_grads else grads
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, buffers, fddp.pmean(loss)

    return step


def forward(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """The forward pass and loss alone (autograd recording on): what no all-reduce can hide."""
    model = build_model(workload, device)

    def step(batch: Batch) -> None:
        x, y = batch
        workload.loss(model(x), y)

    return Variant(step)


def allreduce(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    """One all-reduce of a flat fp32 buffer holding every gradient, as the link sees it."""
    flat = torch.zeros(param_count(build_model(workload, device)), device=device)
    nbytes = flat.numel() * flat.element_size()
    return Variant(lambda batch: dist.all_reduce(flat), lambda: {"allreduce_bytes": [nbytes]})


KINDS = {
    "local": local,
    "fddp": fddp_,
    "ddp": ddp,
    "fsdp2": fsdp2,
    "forward": forward,
    "allreduce": allreduce,
}


def build(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    return KINDS[spec.kind](spec, workload, device)


# ---- one rank: interleaved timing, or one variant's memory ----------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """What every rank of one launch does: time ``specs`` interleaved, or measure ``memory``."""

    workload: str
    specs: tuple[Spec, ...]
    warmup: int
    block: int
    rounds: int  # timed blocks per variant
    device: str
    threads: int
    memory: Spec | None = None
    memory_steps: int = 5
    batch: int | None = None  # rows per rank instead of each workload's own
    small: bool = False  # SMALL_WORKLOADS instead of WORKLOADS


def _timed(variant: Variant, batch: Batch, device: torch.device) -> float:
    start = time.perf_counter()
    variant.step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_variants(job: Job, workload: Workload, device: torch.device) -> dict[str, Any]:
    """Build every variant, then time them in interleaved blocks: A B C D, B C D A, ...

    Every variant plays in every round, untimed ones first (warm-up), and each round starts one
    variant later, so that neither how often nor where in a round a variant runs favours it.
    """
    batches = rank_batches(workload, dist.get_world_size(), dist.get_rank(), device)
    specs, built, first_call = job.specs, {}, {}  # specs in block order
    for spec in specs:
        dist.barrier()
        built[spec.name] = build(spec, workload, device)
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
                if i == job.block - 1:  # the next variant gets an idle wire
                    start = time.perf_counter()
                    built[spec.name].finish()
                    step_s += time.perf_counter() - start
                if r >= 0:
                    times[spec.name].append(step_s)
            if r >= 0:
                cpu[spec.name] += time.process_time() - cpu_start
    infos = {n: v.info() for n, v in built.items()}
    for info in infos.values():  # optimizer state differs between ranks when it is sharded
        info["state_bytes"] = _gather(info.get("state_bytes"))
    out = {
        "params": param_count(workload.build()),
        "per_rank": workload.per_rank,
        "block": job.block,
        "variants": {
            n: {
                **infos[n],
                "first_call_s": first_call[n],
                "times_s": [max(step) for step in zip(*_gather(times[n]))],  # the slowest rank
                "rounds": list(range(job.rounds)),
                # CPU seconds / wall seconds over the timed steps: under 1 when descheduled
                "cpu_share": _gather(cpu[n] / max(sum(times[n]), 1e-9)),
            }
            for n, v in built.items()
        },
        **_parity(built, {s.name: s for s in specs}),
    }
    del built
    gc.collect()
    return out


def _gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# Adam's update is lr * m / sqrt(v): a gradient near zero whose last bits differ between two
# reduction orders can flip its sign, so a few elements differ by ~2 lr while the rest agree to
# float32 rounding; a wrong gradient (unreduced, mis-scaled) moves nearly all by ~lr.
PARITY_TOLERANCE = 1e-4


def _parity(built: dict[str, Variant], specs: dict[str, Spec]) -> dict[str, dict[str, float]]:
    """Per variant, after the same steps as DDP: ``parity``, the largest |difference| of its
    parameters from DDP's, and ``parity_share``, the share of elements farther than
    ``PARITY_TOLERANCE``. Each variant's parameters are gathered once."""
    ref = built["ddp"].parameters() if "ddp" in built else None
    largest, share = {}, {}
    for n, v in built.items():
        if ref is None or specs[n].kind == "local" or n == "ddp":
            continue
        params = v.parameters()
        if params is None:
            continue
        diffs = [(params[k] - ref[k]).abs() for k in ref]
        largest[n] = max(d.max().item() for d in diffs)
        beyond = sum(int((d > PARITY_TOLERANCE).sum()) for d in diffs)
        share[n] = beyond / sum(d.numel() for d in diffs)
    if "fddp+overlap" in built and "fddp" in built:  # the same steps on the same batches
        a, b = built["fddp+overlap"].parameters(), built["fddp"].parameters()
        assert a is not None and b is not None
        largest["fddp+overlap == fddp (bitwise)"] = float(all(torch.equal(a[k], b[k]) for k in b))
    return {"parity": largest, "parity_share": share}


def measure_memory(job: Job, workload: Workload, device: torch.device) -> dict[str, Any]:
    """Peak memory of one variant alone: after its first call and warm-up, over a few steps."""
    assert job.memory is not None
    batches = rank_batches(workload, dist.get_world_size(), dist.get_rank(), device)
    base = _read_status("VmRSS")
    variant = build(job.memory, workload, device)
    first = _timed(variant, batches[0], device)
    for i in range(job.warmup):
        _timed(variant, batches[(i + 1) % len(batches)], device)
    dist.barrier()
    gc.collect()  # a fresh peak: Linux resets VmHWM to the current RSS on clear_refs 5
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
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
    return {"ranks": _gather(out)}


def _read_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rank_main(rank: int, world: int, port: int, job: Job, out_path: str) -> None:
    ranks.join_world(rank, world, port, job.threads)
    device = torch.device("cuda", rank) if job.device == "cuda" else torch.device("cpu")
    workload = (SMALL_WORKLOADS if job.small else WORKLOADS)[job.workload]
    if job.batch is not None:
        workload = dataclasses.replace(workload, per_rank=job.batch)
    run = time_variants if job.memory is None else measure_memory
    result = run(job, workload, device)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(job: Job, world: int, start_method: str = "spawn") -> dict[str, Any]:
    """Run ``job`` on ``world`` fresh processes; rank 0's results come back through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        args = (world, ranks.free_port(), job, path)
        if start_method == "forkserver":  # the server imports these once, for every rank
            multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        mp.start_processes(_rank_main, args, nprocs=world, join=True, start_method=start_method)
        with open(path) as f:
            return json.load(f)


# ---- regimes --------------------------------------------------------------------------------


def _job(args: argparse.Namespace, workload: str, **kwargs: Any) -> Job:
    return Job(
        workload=workload,
        warmup=args.warmup,
        block=args.block,
        device=args.device,
        threads=args.threads,
        batch=args.batch,
        small=args.small,
        **kwargs,
    )


def run_regime(args: argparse.Namespace, regime: str) -> dict[str, Any]:
    """Time every workload in one launch of ranks per workload; returns raw per-step times."""
    every, rounds = variant_specs(args), math.ceil(args.steps / args.block)
    out = {}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        job = _job(args, name, specs=every, rounds=rounds)
        out[name] = launch(job, args.world_size, args.start_method)
        out[name]["wall_s"] = time.perf_counter() - start
        rows = report.variant_rows(out[name])
        medians = ", ".join(f"{r['name']} {r['median_ms']:.1f}" for r in rows)
        print(f"[{regime}] {name}: {medians}", flush=True)
    return {"workloads": out, "loadavg": os.getloadavg()}


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant alone in fresh ranks, so that its peak RSS is its own."""
    memory_specs = [Spec("local"), Spec("fddp"), Spec("fddp", donate=False), Spec("ddp")]
    if args.fsdp:
        memory_specs += [Spec("fddp", full=True), Spec("fsdp2")]
    out: dict[str, Any] = {}
    for name in args.workloads.split(","):
        out[name] = {}
        for spec in memory_specs:
            job = _job(args, name, specs=(), rounds=0, memory=spec, memory_steps=args.memory_steps)
            out[name][spec.name] = launch(job, args.world_size, args.start_method)
            print(f"[memory] {name} {spec.name}: {report.memory_line(out[name][spec.name])}")
    return out


def run_link(args: argparse.Namespace, argv: list[str]) -> dict[str, Any] | str:
    """Re-run this script inside a shaped namespace for the link regime; a str says why not."""
    why = netns.unavailable()
    if why is not None:
        return f"emulated link skipped: {why}"
    try:
        return netns.run_behind(args.link, __file__, argv)
    except subprocess.CalledProcessError as e:
        if e.cmd[:3] == ("ip", "netns", "add"):
            return f"emulated link skipped: {e.stderr.strip()}"
        raise


def machine(args: argparse.Namespace, started: datetime.datetime) -> dict[str, Any]:
    """Versions, machine and configuration, recorded with every result."""
    dirty = provenance.git("status", "--porcelain", "--", "fddp")
    return {
        "date": started.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "fddp": fddp.__version__,
        "fddp_commit": provenance.git("rev-parse", "--short", "HEAD"),
        "fddp_uncommitted_files": len(dirty.splitlines()) if dirty != "unknown" else None,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "world_size": args.world_size,
        "threads_per_rank": args.threads,
        "loadavg_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus < args.world_size:
        print(f"skipped: --device cuda needs {args.world_size} GPUs, found {gpus}")
        return 0
    if args.regime_json:
        with open(args.regime_json, "w") as f:
            json.dump(run_regime(args, "link"), f)
        return 0
    started = datetime.datetime.now()
    meta = machine(args, started)
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


if __name__ == "__main__":
    sys.exit(main())
