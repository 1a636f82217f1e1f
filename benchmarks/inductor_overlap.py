"""Inductor's overlap scheduling against fddp's own passes, on fddp's captured graph, run eagerly.

    python benchmarks/inductor_overlap.py --workloads mlp,gpt            # loopback, 5-10 min
    python benchmarks/inductor_overlap.py --workloads mlp --link 5gbit   # also behind a shaped link

On 2 gloo ranks each workload's pure training step (compare_ddp's: value_and_grad, pmean of the
gradients, AdamW) is captured once per variant with fddp's own capture (make_fx, one all-reduce
per gradient leaf), then scheduled by:

- **captured**: nothing; each per-leaf all-reduce is waited on where the trace put its wait.
- **fddp**: the graph ``data_parallel(step, donate_argnums=(0, 1))`` runs (``pstep.graph``:
  bucket at the cost model's cap, overlap, optimizer split, gate, in-place buckets and updates).
- **fddp-functional**: the graph ``data_parallel(step, compile=True)`` hands to Inductor
  (``pstep.graph``): the same bucket and overlap passes without reinplacing, scheduling alone,
  every update out of place.
- **inductor**: ``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` with
  collective bucketing on, its analytical estimators (the defaults do not run on CPU: see
  ``probe``) fed with this machine's compute figures, its own bucket limit (2 GB).
- **inductor+costs**: the same pass with fddp's measured cost model as
  ``custom_runtime_estimation`` (gloo's latency and bandwidth instead of NCCL's formulas) and
  the largest bucket fddp built as the bucketer's limit.
- **inductor-prebucket**: Inductor's greedy ``bucketing.bucket_all_reduce`` at that limit first,
  then the overlap pass (fddp's costs) to place the buckets' launches and waits.
- **inductor-bucket**: ``bucket_all_reduce`` with the waits sunk to their first use by
  ``ddp_fusion.schedule_comm_wait`` (Inductor's DDP wait sinking).

Every graph runs as Python code the way fddp's "fx" backend runs it (``fx_runner``),
timed in interleaved blocks; the report gives per variant the median step (slowest rank), the
ratio to fddp paired by round, the buckets, and how much compute sits between each launch and
its wait (compute nodes, matmul-class nodes, and seconds of compute by fddp's cost model), and a
parity check of one step's outputs against the captured graph's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import netns
import optree
import provenance
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._runtime_estimation as runtime_estimation
from compare_ddp import LR, WEIGHT_DECAY, _pure_step
from torch import fx
from torch._dynamo.utils import counters
from workloads import WORKLOADS, build_model, param_count, rank_batches

import fddp
import fddp.optim as optim
from fddp._compiler._backend import fx_runner
from fddp._compiler._capture._trace import Captured, capture_step
from fddp._compiler._graph import is_compute
from fddp._compiler._passes._cost import node_seconds
from fddp._ranks._machine import Machine, measured

VARIANTS = (
    "captured",
    "fddp",
    "fddp-functional",
    "inductor",
    "inductor+costs",
    "inductor-prebucket",
    "inductor-bucket",
)
MIB = 2**20


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workloads", default="mlp,gpt", help="comma-separated, from: " + ", ".join(WORKLOADS)
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated, from: " + ", ".join(VARIANTS),
    )
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    p.add_argument(
        "--bucket-mb", type=float, help="fddp's bucket_cap_mb (default: its cost model's choice)"
    )
    p.add_argument("--block", type=int, default=2, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--link", metavar="RATE", help="also run behind a tbf-shaped link, e.g. 5gbit")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback regime")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--no-write", action="store_true", help="print only, write no result files")
    p.add_argument("--render", metavar="JSON", help="print the tables of a result file again")
    p.add_argument("--regime-json", help=argparse.SUPPRESS)  # internal: run one regime, write
    return p.parse_args(argv)


# ---- what Inductor's pass needs on CPU ------------------------------------------------------


@contextlib.contextmanager
def cpu_figures(machine: Machine) -> Iterator[None]:
    """Inductor's roofline reads the GPU's DRAM bandwidth from Triton (absent with CPU torch:
    ModuleNotFoundError) and its peak FLOP/s from a datasheet (0 on CPU): give it this
    machine's measured figures instead."""
    gbps = 1 / machine.seconds_per_byte_moved / 1e9
    tflops = 1 / machine.seconds_per_flop / 1e12
    with (
        mock.patch.object(runtime_estimation, "get_gpu_dram_gbps", lambda: gbps),
        mock.patch.object(runtime_estimation, "get_device_tflops", lambda dtype: tflops),
    ):
        yield


def _collective_bytes(node: fx.Node) -> int:
    val = node.args[0].meta["val"]
    return val.numel() * val.element_size()


def _is_launch(node: fx.Node) -> bool:
    op = node.target
    return (
        isinstance(op, torch._ops.OpOverload)
        and op.namespace in ("_c10d_functional", "c10d_functional")
        and op._opname != "wait_tensor"
    )


def _is_wait(node: fx.Node) -> bool:
    op = node.target
    return isinstance(op, torch._ops.OpOverload) and op._opname == "wait_tensor"


def fddp_costs(machine: Machine) -> Callable[[fx.Node, int | None], float | None]:
    """``custom_runtime_estimation`` for Inductor from fddp's measured cost model (ms): an
    all-reduce costs the link's latency plus its bytes over the measured bandwidth; any other
    node, what fddp's cost model (``node_seconds``) predicts for it."""

    known: dict[fx.Node, float] = {}

    def estimate(node: fx.Node, override_size: int | None) -> float | None:
        if _is_launch(node):
            size = _collective_bytes(node) if override_size is None else override_size
            return (machine.latency + size * machine.seconds_per_byte) * 1e3
        if node.op != "call_function" or _is_wait(node):
            return None
        if node not in known:  # the graph's nodes, predicted together
            known.update(zip(node.graph.nodes, node_seconds(node.graph, machine)))
        return known[node] * 1e3

    return estimate


@contextlib.contextmanager
def bucket_limit(max_bytes: int) -> Iterator[None]:
    """Inductor's overlap pass gives its bucketer a fixed 2 GB limit; use ``max_bytes``."""
    from torch._inductor.fx_passes import overlap_preserving_bucketer as opb

    real = opb.finalize_overlap_scheduling

    def finalize(*args: Any, **kwargs: Any) -> None:
        kwargs["max_bucket_memory_gb"] = max_bytes / 2**30
        return real(*args, **kwargs)

    with mock.patch.object(opb, "finalize_overlap_scheduling", finalize):
        yield


def _where(e: BaseException) -> str:
    """The innermost torch frame of ``e``'s traceback: file (from torch/ on), line, function."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "torch" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename[f.filename.rfind('torch/') :]}:{f.lineno} in {f.name}"


def probe(fresh: Callable[[], fx.GraphModule], machine: Machine) -> list[dict[str, Any]]:
    """Inductor's pass as shipped, then with one obstacle removed at a time: what each says."""
    from torch._inductor.fx_passes import overlap_scheduling as osched

    attempts: list[tuple[str, Callable[[fx.GraphModule], Any], bool]] = [
        ("schedule_overlap_bucketing(gm) (defaults)", osched.schedule_overlap_bucketing, False),
        (
            "schedule_overlap_bucketing_from_inductor_configs(gm) (config defaults)",
            osched.schedule_overlap_bucketing_from_inductor_configs,
            False,
        ),
        (
            "defaults, CPU roofline figures patched in",
            osched.schedule_overlap_bucketing,
            True,
        ),
        (
            "collective_estimator='benchmark', compute_estimator='analytical', CPU figures",
            functools.partial(
                osched.schedule_overlap_bucketing,
                collective_bucketing=True,
                collective_estimator="benchmark",
                compute_estimator="analytical",
            ),
            True,
        ),
        (
            "compute_estimator='analytical', collective_bucketing=True, CPU figures",
            functools.partial(
                osched.schedule_overlap_bucketing,
                collective_bucketing=True,
                compute_estimator="analytical",
            ),
            True,
        ),
    ]
    out = []
    for name, fn, patched in attempts:
        gm = fresh()
        before = sum(map(_is_launch, gm.graph.nodes))
        start = time.perf_counter()
        try:
            with cpu_figures(machine) if patched else contextlib.nullcontext():
                fn(gm)
            gm.graph.lint()
            after = sum(map(_is_launch, gm.graph.nodes))
            result = {"ran": True, "collectives": f"{before} -> {after}"}
        except Exception as e:
            result = {"ran": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            result["where"] = _where(e)
        result.update(attempt=name, seconds=time.perf_counter() - start)
        out.append(result)
        dist.barrier()
    return out


# ---- the variants ---------------------------------------------------------------------------


def schedule(
    variant: str,
    captured: Captured,
    fddp_graphs: dict[str, fx.GraphModule],
    machine: Machine,
    caps: dict[str, Any],
) -> fx.GraphModule:
    """``captured``'s graph scheduled by ``variant`` (rewritten in place and returned); fddp's
    variants are the graphs its steps run (``fddp_graphs``)."""
    from torch._inductor.fx_passes import bucketing, ddp_fusion
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    gm = captured.graph
    if variant == "captured":
        return gm
    if variant in fddp_graphs:
        return fddp_graphs[variant]
    if variant == "inductor":
        with cpu_figures(machine):
            return schedule_overlap_bucketing(
                gm, collective_bucketing=True, compute_estimator="analytical"
            )
    if variant == "inductor+costs":
        with cpu_figures(machine), bucket_limit(caps["largest"]):
            return schedule_overlap_bucketing(
                gm,
                collective_bucketing=True,
                compute_estimator="analytical",
                custom_runtime_estimation=fddp_costs(machine),
            )
    # greedy_bucket_collective_by_mb reads its cap function for bucket 0 only (it never
    # recomputes the cap as the bucket index grows), so a first-bucket cap would cap them all
    largest_mb = caps["largest"] / MIB
    if variant == "inductor-prebucket":
        bucketing.bucket_all_reduce(gm, lambda i: largest_mb)
        with cpu_figures(machine):
            return schedule_overlap_bucketing(
                gm,
                compute_estimator="analytical",
                custom_runtime_estimation=fddp_costs(machine),
            )
    if variant == "inductor-bucket":
        bucketing.bucket_all_reduce(gm, lambda i: largest_mb)
        ddp_fusion.schedule_comm_wait(gm.graph)
        gm.graph.lint()
        gm.recompile()
        return gm
    raise ValueError(f"unknown variant {variant!r}")


# ---- what a graph does: buckets and overlap -------------------------------------------------

_MATMUL_LIKE = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")


def _matmul_like(node: fx.Node) -> bool:
    name = getattr(node.target, "_opname", "")
    return name in _MATMUL_LIKE or name.startswith("_scaled_dot_product")


def describe(graph: fx.Graph, machine: Machine) -> dict[str, Any]:
    """Per collective: bytes and what runs between its launch and its wait; and the step as
    fddp's cost model replays this order (compute and wire as two queues)."""
    seconds = dict(zip(graph.nodes, node_seconds(graph, machine)))
    compute = mm = 0
    spent = 0.0
    launched: dict[fx.Node, tuple[int, int, float]] = {}
    rows = []
    now = wire_free = 0.0
    arrival: dict[fx.Node, float] = {}
    for node in graph.nodes:
        if _is_launch(node):
            launched[node] = (compute, mm, spent)
            nbytes = _collective_bytes(node)
            wire_free = max(now, wire_free) + machine.latency + nbytes * machine.seconds_per_byte
            arrival[node] = wire_free
        elif _is_wait(node) and node.args[0] in launched:
            start = node.args[0]
            c0, m0, s0 = launched.pop(start)
            rows.append(
                {
                    "bytes": _collective_bytes(start),
                    "compute_nodes": compute - c0,
                    "matmul_nodes": mm - m0,
                    "compute_ms": (spent - s0) * 1e3,
                }
            )
            now = max(now, arrival[start])
        cost = seconds.get(node, 0.0)
        now += cost
        spent += cost
        compute += is_compute(node)
        mm += _matmul_like(node)
    sizes = [r["bytes"] for r in rows]
    return {
        "collectives": len(rows),
        "buckets_over_64KiB": sum(b > 64 * 2**10 for b in sizes),
        "bytes": sizes,
        "rows": rows,
        "compute_nodes": compute,
        "matmul_nodes": mm,
        "in_flight_compute_nodes_median": statistics.median(r["compute_nodes"] for r in rows)
        if rows
        else 0,
        "in_flight_matmul_nodes_total": sum(r["matmul_nodes"] for r in rows),
        "model_compute_ms": spent * 1e3,
        "model_step_ms": max(now, wire_free) * 1e3,
        "model_exposed_ms": (max(now, wire_free) - spent) * 1e3,
    }


# Inductor's own account of its pass: buckets it made, collectives it expects exposed
_COUNTERS = (
    "collective_buckets",
    "overlap_scheduling_exposed",
    "overlap_scheduling_bad_exposed",
    "overlap_scheduling_potentially_hidden",
)


def estimates(graph: fx.Graph, machine: Machine) -> dict[str, float]:
    """All the graph's all-reduces, in ms: Inductor's analytical (NCCL) estimate against fddp's
    model of this link (measured latency and bandwidth)."""
    from torch._inductor.fx_passes.overlap_scheduling import estimate_collective_time

    launches = [n for n in graph.nodes if _is_launch(n)]
    per_byte = machine.seconds_per_byte
    fddp_ms = sum(machine.latency + _collective_bytes(n) * per_byte for n in launches)
    return {
        "inductor_ms": sum(estimate_collective_time(n) for n in launches),
        "fddp_model_ms": fddp_ms * 1e3,
    }


# ---- one rank -------------------------------------------------------------------------------


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _clone_tree(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def run_workload(name: str, variants: list[str], args: argparse.Namespace) -> dict[str, Any]:
    workload = WORKLOADS[name]
    device = torch.device("cpu")
    model = build_model(workload, device)
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    step = _pure_step(model, workload, opt, average_grads=True)
    pstep = fddp.data_parallel(step, donate_argnums=(0, 1), bucket_cap_mb=args.bucket_mb)
    batch = rank_batches(workload, dist.get_world_size(), dist.get_rank(), device)[0]
    state = (params, opt.init(params), buffers, batch)
    machine = measured(None, device)  # what fddp's default cap is chosen from
    tensors0 = [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]

    def fresh() -> Captured:
        return capture_step(step, state)

    result: dict[str, Any] = {"params": param_count(model), "machine": str(machine)}
    result["loadavg_start"] = os.getloadavg()
    result["probe"] = probe(lambda: fresh().graph, machine)
    result["collective_estimates"] = estimates(fresh().graph.graph, machine)

    # the graphs fddp's steps run (their inputs are a fresh capture's: the step is the same),
    # and the seconds of their passes: graph() less the capture
    functional = fddp.data_parallel(step, compile=True, bucket_cap_mb=args.bucket_mb)
    fddp_graphs, passes_s = {}, {}
    for v, variant_step in (("fddp", pstep), ("fddp-functional", functional)):
        start = time.perf_counter()
        fddp_graphs[v] = variant_step.graph(*state)
        seconds = time.perf_counter() - start
        passes_s[v] = seconds - variant_step.schedule(*state).capture_seconds
    caps: dict[str, Any] = {"bucket_cap": pstep.schedule(*state).bucket_cap}
    order = ["fddp"] + [v for v in variants if v != "fddp"]  # fddp first: the caps come from it
    inputs, runners, info = {}, {}, {}
    for v in order:
        captured = fresh()
        before = {k: counters["inductor"][k] for k in _COUNTERS}
        start = time.perf_counter()
        error = None
        try:
            gm = schedule(v, captured, fddp_graphs, machine, caps)
            gm.graph.lint()
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0]} ({_where(e)})"
        errors = _gather(error)
        if any(errors):
            info[v] = {"error": next(e for e in errors if e)}
            continue
        seconds = passes_s.get(v, time.perf_counter() - start)
        info[v] = {"pass_s": seconds, **describe(gm.graph, machine), "inductor_counters": {}}
        for key in _COUNTERS:
            info[v]["inductor_counters"][key] = counters["inductor"][key] - before.get(key, 0)
        if v == "fddp":
            caps["largest"] = max(info[v]["bytes"])
        copy = [x.clone() for x in tensors0]  # each variant its own state (fddp's is in place)
        inputs[v] = [copy[i] if isinstance(i, int) else i for i in captured.inputs]
        runners[v] = fx_runner(gm)
    kept = [v for v in variants if v in runners]

    # parity: one step from the same state, every output against the captured graph's
    fresh_inputs = {v: [_clone_tree(x) for x in inputs[v]] for v in kept}
    outputs = {v: [t.clone() for t in runners[v](fresh_inputs[v])] for v in kept}
    del fresh_inputs
    ref = outputs.get("captured")
    parity = {}
    for v in kept:
        if ref is not None:
            parity[v] = max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(outputs[v], ref)
            )
    del outputs
    gc.collect()

    # interleaved timing: A B C, B C A, ... (untimed warm-up rounds first)
    rounds = math.ceil(args.steps / args.block)
    warm = math.ceil(args.warmup / args.block)
    times: dict[str, list[float]] = {v: [] for v in kept}
    for r in range(-warm, rounds):
        for v in kept[r % len(kept) :] + kept[: r % len(kept)]:
            gc.collect()
            dist.barrier()
            for _ in range(args.block):
                t = _timed(functools.partial(runners[v], inputs[v]))
                if r >= 0:
                    times[v].append(t)
    for v in kept:
        info[v]["times_s"] = [max(s) for s in zip(*_gather(times[v]))]  # the slowest rank
        info[v]["parity_max_abs"] = parity.get(v)
    result["variants"] = info
    result["block"] = args.block
    result["caps"] = caps
    result["order"] = variants
    result["loadavg_end"] = os.getloadavg()
    return result


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    ranks.join_world(rank, world, port, args.threads)
    variants = args.variants.split(",")
    out = {}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        out[name] = run_workload(name, variants, args)
        out[name]["wall_s"] = time.perf_counter() - start
        if rank == 0:
            medians = ", ".join(
                f"{v} {statistics.median(i['times_s']) * 1e3:.1f}"
                for v, i in out[name]["variants"].items()
                if "times_s" in i
            )
            print(f"{name}: {medians} ms", flush=True)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"workloads": out, "loadavg": os.getloadavg()}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_regime(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_rank_main, args=(2, ranks.free_port(), args, path), nprocs=2, join=True)
        with open(path) as f:
            return json.load(f)


def run_link(args: argparse.Namespace, argv: list[str]) -> dict[str, Any] | str:
    """This script again inside a shaped namespace; a str says why not."""
    why = netns.unavailable()
    if why is not None:
        return f"emulated link skipped: {why}"
    return netns.run_behind(args.link, __file__, argv)


# ---- the report -----------------------------------------------------------------------------


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _paired(a: list[float], b: list[float], block: int) -> float:
    """Median over rounds of (a's block median / b's block median)."""
    ra = [statistics.median(a[i : i + block]) for i in range(0, len(a), block)]
    rb = [statistics.median(b[i : i + block]) for i in range(0, len(b), block)]
    return statistics.median(x / y for x, y in zip(ra, rb))


def tables(regime: str, result: dict[str, Any]) -> str:
    lines = [f"### {regime}", ""]
    for name, w in result["workloads"].items():
        variants, block = w["variants"], w["block"]
        ref = variants.get("fddp", {}).get("times_s")
        functional = variants.get("fddp-functional", {}).get("times_s")
        cap = w["caps"]
        if "bucket_cap" in cap:  # "bucket cap 1.5 MiB, chosen by ..."
            chosen = cap["bucket_cap"].split(",")[0]
        else:  # a result file written before the cap came from schedule()
            chosen = f"cap {cap.get('cap', 0) / MIB:.3g} MiB, first bucket "
            chosen += f"{cap.get('first', 0) / MIB:.3g} MiB"
        lines += [
            f"**{name}** ({w['params'] / 1e6:.1f}M params; machine: {w['machine']}; fddp's "
            f"{chosen}; "
            f"{w['wall_s']:.0f} s; load average {w['loadavg_start'][0]:.1f} at the start, "
            f"{w['loadavg_end'][0]:.1f} at the end)",
            "",
            "| variant | median ms | p90 ms | /fddp (paired) | /fddp (medians) "
            "| /fddp-functional (paired) | all-reduces "
            "| > 64 KiB | compute nodes in flight (median) | matmul nodes in flight (sum) "
            "| modelled exposed comm ms | pass s | parity max abs |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in w["order"]:
            i = variants.get(v)
            if i is None:
                continue
            if "error" in i:
                lines.append(f"| {v} | failed: {i['error']} |" + " |" * 11)
                continue
            t = i["times_s"]
            p90 = sorted(t)[int(0.9 * (len(t) - 1))] * 1e3
            paired = f"{_paired(t, ref, block):.3f}" if ref else ""
            plain = f"{_median_ms(t) / _median_ms(ref):.3f}" if ref else ""
            scheduling = f"{_paired(t, functional, block):.3f}" if functional else ""
            parity = i["parity_max_abs"]
            lines.append(
                f"| {v} | {_median_ms(t):.1f} | {p90:.1f} | {paired} | {plain} | {scheduling} "
                f"| {i['collectives']} | {i['buckets_over_64KiB']} "
                f"| {i['in_flight_compute_nodes_median']:g} | {i['in_flight_matmul_nodes_total']} "
                f"| {i['model_exposed_ms']:.1f} | {i['pass_s']:.2f} "
                f"| {'' if parity is None else f'{parity:.2g}'} |"
            )
        lines.append("")
        lines.append(
            "Collectives in launch order: MiB (matmul-class nodes; ms of compute by fddp's model) "
            "between launch and wait:"
        )
        lines.append("")
        for v in w["order"]:
            i = variants.get(v)
            if i and "bytes" in i:
                shown = i["rows"] if len(i["rows"]) <= 24 else i["rows"][-8:]
                rows = ", ".join(
                    f"{r['bytes'] / MIB:.2f} ({r['matmul_nodes']}; {r['compute_ms']:.1f})"
                    for r in shown
                )
                if len(shown) < len(i["rows"]):
                    flight = [r["matmul_nodes"] for r in i["rows"]]
                    rows = (
                        f"{len(flight)} collectives, matmul-class nodes in flight: max "
                        f"{max(flight)}, sum {sum(flight)}; the last 8: {rows}"
                    )
                lines.append(f"- {v}: {rows}")
        lines.append("")
        est = w["collective_estimates"]
        lines.append(
            "All the captured graph's per-leaf all-reduces together: Inductor's analytical (NCCL) "
            f"estimate {est['inductor_ms']:.2f} ms, fddp's model of this link "
            f"{est['fddp_model_ms']:.2f} ms."
        )
        lines.append("")
        lines.append(
            "Inductor's own counters per variant: buckets its bucketer made; collectives it left "
            "fully exposed (bad: of those, ones some compute could have hidden); collectives some "
            "compute could hide:"
        )
        lines.append("")
        for v in w["order"]:
            c = variants.get(v, {}).get("inductor_counters")
            if c and v.startswith("inductor"):
                exposed, bad = c["overlap_scheduling_exposed"], c["overlap_scheduling_bad_exposed"]
                lines.append(
                    f"- {v}: {c['collective_buckets']} buckets; exposed {exposed} (bad {bad}); "
                    f"potentially hidden {c['overlap_scheduling_potentially_hidden']}"
                )
        lines.append("")
        lines.append("Inductor's pass as shipped, then with one obstacle removed at a time:")
        lines.append("")
        lines.append("| attempt | outcome |")
        lines.append("|---|---|")
        for p in w["probe"]:
            outcome = (
                f"ran ({p['collectives']} collectives, {p['seconds']:.2f} s)"
                if p["ran"]
                else f"`{p['error']}` at `{p['where']}`"
            )
            lines.append(f"| {p['attempt']} | {outcome} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        print("\n".join(tables(regime, r) for regime, r in saved["regimes"].items()))
        return 0
    if args.regime_json:  # inside the shaped namespace
        with open(args.regime_json, "w") as f:
            json.dump(run_regime(args), f)
        return 0
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, Any] = {}
    if not args.no_loopback:
        results["loopback"] = run_regime(args)
    if args.link:
        link = run_link(args, list(argv))
        if isinstance(link, str):
            print(link)
        else:
            results[f"emulated link {args.link}"] = link
    text = "\n".join(tables(regime, r) for regime, r in results.items())
    print(text)
    if not args.no_write:
        stamp = started.strftime("%Y%m%dT%H%M%S")
        os.makedirs(args.out, exist_ok=True)
        meta = {
            "date": started.isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "fddp_commit": provenance.commit(),
            "argv": argv,
            "cores": os.cpu_count(),
        }
        path = os.path.join(args.out, f"{stamp}_inductor_overlap.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "regimes": results}, f)
        with open(path.removesuffix(".json") + "_tables.md", "w") as f:
            f.write(text + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
