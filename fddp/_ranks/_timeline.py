"""Timelines: measured compute and communication of every rank as one Chrome trace, and a PNG."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fddp._base import _files

STEP_EVENT = "fddp.step"
_COMM_PREFIXES = ("gloo:", "nccl:")


def is_comm(event: dict) -> bool:
    """A collective executing on a process-group worker thread."""
    return event.get("name", "").startswith(_COMM_PREFIXES)


def is_compute(event: dict) -> bool:
    """An operator on the main thread that does work (not a launch, a wait or the step mark)."""
    name = event.get("name", "")
    return event.get("cat") == "cpu_op" and not name.startswith(("c10d", "_c10d_functional"))


def _relabel(events: list[dict], rank: int, main_tid: int) -> list[dict]:
    """Keep this rank's complete events; pid becomes the rank, lanes become compute and comm."""
    kept = [
        e
        for e in events
        if e.get("ph") == "X" and (e.get("tid") == main_tid or is_comm(e)) and "dur" in e
    ]
    comm_tids = sorted({e["tid"] for e in kept if e["tid"] != main_tid})
    lane = {main_tid: 0, **{tid: 1 + i for i, tid in enumerate(comm_tids)}}
    out = [{**e, "pid": rank, "tid": lane[e["tid"]]} for e in kept]
    _label_buckets(out)
    names = [("process_name", 0, f"rank {rank}"), ("thread_name", 0, "compute")]
    names += [("thread_name", lane[t], f"comm {lane[t]}") for t in comm_tids]
    meta = [{"ph": "M", "name": n, "pid": rank, "tid": t, "args": {"name": v}} for n, t, v in names]
    return meta + out


def _label_buckets(events: list[dict]) -> None:
    """Number the collectives of each step in launch order (the schedule's order)."""
    steps = sorted((e for e in events if e["name"] == STEP_EVENT), key=lambda e: e["ts"])
    comms = sorted((e for e in events if is_comm(e)), key=lambda e: e["ts"])
    for step_index, step in enumerate(steps):
        inside = [c for c in comms if step["ts"] <= c["ts"] <= step["ts"] + step["dur"]]
        for k, c in enumerate(inside):
            c.setdefault("args", {}).update({"step": step_index, "collective": k})


@contextlib.contextmanager
def record(path: str | os.PathLike, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Profile the block on every rank; rank 0 writes the merged Chrome trace to ``path``."""
    main_tid = threading.get_native_id()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f)["traceEvents"]
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = _relabel(events, rank, main_tid)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    if rank == 0:
        merged = [e for rank_events in gathered for e in rank_events]
        trace = json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}).encode()

        def write(f: BinaryIO) -> None:
            f.write(trace)

        _files.replace_atomically(os.fspath(path), write, what="trace")


def step_range() -> contextlib.AbstractContextManager:
    """Marks one step in the trace (a no-op cost when nothing is profiling)."""
    return torch.profiler.record_function(STEP_EVENT)


def plot_timeline(trace_path: str | os.PathLike, png_path: str | os.PathLike) -> None:
    """Render a trace written by ``pstep.trace`` as a PNG: per rank, a compute and a comm lane.

    >>> import fddp, torch, tempfile, os
    >>> step = fddp.data_parallel(lambda w: w - fddp.pmean(w))
    >>> d = tempfile.mkdtemp()
    >>> with step.profile(os.path.join(d, "t.json")):
    ...     _ = step(torch.ones(3))
    >>> fddp.plot_timeline(os.path.join(d, "t.json"), os.path.join(d, "t.png"))
    >>> os.path.exists(os.path.join(d, "t.png"))
    True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise ValueError(f"{trace_path} holds no timed events; record some steps first.")
    start = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(ranks)))
    labels = []
    for i, rank in enumerate(ranks):
        mine = [e for e in events if e["pid"] == rank]
        compute = [e for e in mine if e["tid"] == 0 and is_compute(e)]
        comm = [e for e in mine if is_comm(e)]
        for lane, spans, color in ((2 * i, compute, "tab:blue"), (2 * i + 1, comm, "tab:orange")):
            bars = [((e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in spans]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=color)
        labels += [f"rank {rank} compute", f"rank {rank} comm"]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("fddp timeline: operators (blue) and all-reduces in flight (orange)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
