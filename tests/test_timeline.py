"""pstep.profile writes a Chrome trace of every rank; plot_timeline renders it."""

from __future__ import annotations

import functools
import json
import os

import torch
from _dist import run_checks
from _models import mlp

import fddp
import fddp.optim as optim

SIZES = (64, 256, 256, 256, 8)
STEP_EVENT = "fddp.step"  # the range each step is recorded under
LAUNCH = "_c10d_functional::all_reduce_"  # the main thread's launch of a collective
WAIT = "_c10d_functional::wait_tensor"


def _is_comm(event: dict) -> bool:
    """A collective, as gloo's worker thread records it."""
    return event["name"].startswith("gloo:")


def _is_compute(event: dict) -> bool:
    """An operator (the profiler's cpu_op category) other than a collective's launch or wait."""
    name = event["name"]
    return event.get("cat") == "cpu_op" and not name.startswith(("c10d", "_c10d_functional"))


def _record(path: str) -> list[dict]:
    model = mlp(SIZES)
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.01)

    def step(params, opt_state, x, y):
        loss, grads = fddp.value_and_grad(
            lambda p: torch.nn.functional.mse_loss(apply(p, {}, x), y)
        )(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    pstep = fddp.data_parallel(step, bucket_cap_mb=0.25, first_bucket_cap_mb=0.05)
    params, _ = fddp.state(model)
    opt_state = opt.init(params)
    x, y = torch.randn(256, SIZES[0]), torch.randn(256, SIZES[-1])
    params, opt_state, _ = pstep(params, opt_state, x, y)
    with pstep.profile(path):
        for _ in range(4):
            params, opt_state, _ = pstep(params, opt_state, x, y)
    return [c.overlapped for c in pstep.schedule(params, opt_state, x, y).collectives]


def _overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def test_trace_is_chrome_json_with_overlapping_compute_and_comm(tmp_path):
    path = os.fspath(tmp_path / "trace.json")
    overlapped = run_checks({"record": functools.partial(_record, path)}, 2, timeout=180)
    overlapped = overlapped["record"][0]
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert all({"ph", "pid", "name"} <= e.keys() for e in events)
    timed = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in timed} == {0, 1}
    most = max(range(len(overlapped)), key=overlapped.__getitem__)
    assert overlapped[most] > 0, "the schedule must put compute between a launch and its wait"
    for rank in (0, 1):
        mine = [e for e in timed if e["pid"] == rank]
        steps = [e for e in mine if e["name"] == STEP_EVENT]
        comms = [e for e in mine if _is_comm(e)]
        compute = [e for e in mine if _is_compute(e)]
        assert len(steps) == 4 and compute and len(comms) >= 4 * len(overlapped)
        flagged = [c for c in comms if c["args"].get("collective") == most]
        assert len(flagged) == 4, "every step's collectives are numbered in launch order"
        for n, step in enumerate(steps):
            inside = [e for e in mine if _overlaps(e, step)]
            launches = sorted((e for e in inside if e["name"] == LAUNCH), key=lambda e: e["ts"])
            waits = [e for e in inside if e["name"] == WAIT]
            assert len(launches) == len(waits) == len(overlapped), (rank, n)
            launched = launches[most]["ts"] + launches[most]["dur"]
            waited = max(e["ts"] for e in waits)
            between = [
                op for op in compute if launched <= op["ts"] < waited and _overlaps(op, step)
            ]
            assert between, (
                f"rank {rank}, step {n}: no operator ran after collective {most}'s launch"
            )
    png = tmp_path / "trace.png"
    fddp.plot_timeline(path, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
