"""Replication soundness: a mistake that would make replicas differ, hang or retrace forever is a
clear error (or warning) on every rank, on the traced and the eager path, first and later calls.

One spawn of 2 gloo ranks runs the named multi-rank checks in order (the one that breaks its
group in a spawn of its own, beside it); each returns what it saw (the error type and message,
or values), and one test per check asserts every rank's outcome.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import assert_ranks_equal
from _dist import run_checks

import fddp
import fddp.optim as optim

SPAWN_TIMEOUT_S = 240.0


def _outcome(fn, *args):
    try:
        return {"value": fn(*args)}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}


def _quickstart(pmean_grads: bool = True, trace: bool = True):
    """README's quickstart, optionally without its one line about parallelism."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.adamw(lr=1e-2, weight_decay=0.01)

    def loss_fn(params, buffers, batch):
        return F.cross_entropy(apply(params, buffers, batch["x"]), batch["y"])

    def step(params, opt_state, buffers, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, batch)
        if pmean_grads:
            grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss  # loss stays per rank

    pstep = fddp.data_parallel(step, trace=trace)
    return pstep, params, opt.init(params), buffers


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 4, (16,), generator=g)}
    return fddp.shard(batch)


def _train(pstep, params, opt_state, buffers, steps: int):
    for i in range(steps):
        params, opt_state, _ = pstep(params, opt_state, buffers, _batch(i))
    return params, opt_state


def forgotten_pmean(trace: bool):
    pstep, params, opt_state, buffers = _quickstart(pmean_grads=False, trace=trace)
    calls = {"n": 0}

    def run():
        nonlocal params, opt_state
        for i in range(3):
            params, opt_state, _ = pstep(params, opt_state, buffers, _batch(i))
            calls["n"] += 1

    out = _outcome(run)
    out["calls"] = calls["n"]
    return out


def per_rank_metrics_are_fine():
    pstep, params, opt_state, buffers = _quickstart(pmean_grads=True)
    params, opt_state = _train(pstep, params, opt_state, buffers, 3)
    schedule = pstep.schedule(params, opt_state, buffers, _batch(0))
    return {"params": params, "replication": schedule.replication, "table": str(schedule)}


@dataclasses.dataclass(frozen=True)
class Config:
    dropout: float


class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2


def _scaled_step(w, x, config):
    scale = 1.0 if config in (Mode.TRAIN, Config(0.0)) else 2.0
    return w - 0.1 * fddp.pmean(fddp.grad(lambda w: (x @ w * scale).pow(2).mean())(w))


def static_arg_differs(config_on_rank1, trace: bool = True):
    config = (
        config_on_rank1
        if fddp.rank() == 1
        else type(config_on_rank1)(*([0.0] if isinstance(config_on_rank1, Config) else [1]))
    )
    pstep = fddp.data_parallel(_scaled_step, trace=trace)
    return _outcome(pstep, torch.ones(4), torch.ones(2, 4), config)


def _sgd(w, x):
    return {k: v - 0.1 * g for (k, v), g in zip(w.items(), fddp.pmean(_grads(w, x)).values())}


def _grads(w, x):
    return fddp.grad(lambda w: sum((x @ v).pow(2).mean() for v in w.values()))(w)


def permuted_replica(kind: str):
    w = torch.arange(16.0).reshape(4, 4)
    if fddp.rank() == 1:
        w = w.flip(0) if kind == "rows" else w.t().contiguous()
    return _outcome(fddp.data_parallel(_sgd), {"a": torch.ones(4, 4), "w": w}, torch.ones(2, 4))


def eager_shapes_differ(kind: str):
    r = fddp.rank()
    if kind == "shape":
        w = {"a": torch.ones(4, 4), "b": torch.ones(4, 4 + r)}
    else:  # sizes swapped between two leaves: the same total, a different layout
        w = {"a": torch.ones(4, 4 + r), "b": torch.ones(4, 5 - r)}
    step = fddp.data_parallel(_sgd, trace=False, check_replicas=False)
    return _outcome(step, w, torch.ones(2, 4))


def integer_pmean(trace: bool):
    def step(w, count):
        return w + 1, fddp.pmean(count)

    return _outcome(fddp.data_parallel(step, trace=trace), torch.ones(2), torch.tensor(3))


def two_threads():
    pstep, params, opt_state, buffers = _quickstart()
    outcomes = [None, None]
    barrier = threading.Barrier(2)

    def call(i):
        barrier.wait()
        outcomes[i] = _outcome(pstep, params, opt_state, buffers, _batch(0))
        if "value" in outcomes[i]:
            outcomes[i] = {"value": "ok"}

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # The group is still in step: the thread that got in finished on every rank.
    after = pstep(params, opt_state, buffers, _batch(1))
    return {"outcomes": outcomes, "after": after[0]}


def nested():
    inner = fddp.data_parallel(_sgd)

    def outer(w, x):
        return inner(w, x)

    return _outcome(fddp.data_parallel(outer), {"w": torch.ones(4, 4)}, torch.ones(2, 4))


def stable_static_keys():
    def step(w, x, scale, fn):
        return w - scale * fddp.pmean(fddp.grad(lambda w: fn(x @ w).mean())(w))

    pstep = fddp.data_parallel(step)
    w = torch.ones(4)
    for i in range(4):
        w = pstep(w, torch.ones(2, 4) * i, float("nan"), functools.partial(torch.pow, exponent=2))
    nan_retraces = pstep.retraces
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pstep = fddp.data_parallel(step, cache_size=4)
        for rows in range(2, 14, 2):
            pstep(w, torch.ones(rows, 4), 0.1, torch.square)
    shape_retraces = pstep.retraces
    pstep(w, torch.ones(12, 4), 0.1, torch.square)  # among the 4 kept: no retrace
    kept = pstep.retraces == shape_retraces
    pstep(w, torch.ones(2, 4), 0.1, torch.square)  # the least recently used, dropped: retraced
    dropped = pstep.retraces == shape_retraces + 1
    messages = [str(c.message) for c in caught if c.category.__name__ == "RetraceWarning"]
    return {
        "nan_retraces": nan_retraces,
        "shape_retraces": shape_retraces,
        "kept": kept,
        "dropped": dropped,
        "warnings": messages,
    }


def _destroyed():
    """Last on the spawn: it destroys the group."""
    pstep = fddp.data_parallel(_sgd)
    w = {"w": torch.ones(4, 4)}
    w = pstep(w, torch.ones(2, 4))
    dist.destroy_process_group()
    start = time.monotonic()
    outcome = _outcome(pstep, w, torch.ones(2, 4))
    outcome["seconds"] = time.monotonic() - start
    return outcome


# Run in this order on both ranks, in one spawn.
CHECKS = {
    "forgotten_pmean_traced": functools.partial(forgotten_pmean, True),
    "forgotten_pmean_eager": functools.partial(forgotten_pmean, False),
    "per_rank_metrics": per_rank_metrics_are_fine,
    "static_config_traced": functools.partial(static_arg_differs, Config(0.5)),
    "static_mode_traced": functools.partial(static_arg_differs, Mode.EVAL),
    "static_config_eager": functools.partial(static_arg_differs, Config(0.5), False),
    "permuted_rows": functools.partial(permuted_replica, "rows"),
    "permuted_transpose": functools.partial(permuted_replica, "transpose"),
    "eager_shape": functools.partial(eager_shapes_differ, "shape"),
    "eager_swapped": functools.partial(eager_shapes_differ, "swapped"),
    "integer_pmean_traced": functools.partial(integer_pmean, True),
    "integer_pmean_eager": functools.partial(integer_pmean, False),
    "two_threads": two_threads,
    "nested": nested,
    "stable_static_keys": stable_static_keys,
    "destroyed": _destroyed,
}


@pytest.fixture(scope="module")
def runs():
    # The timeout check breaks its group: it has a spawn of its own, run meanwhile (its rank 1
    # mostly sleeps).
    with ThreadPoolExecutor(1) as pool:
        timeout_run = pool.submit(run_checks, {"timeout": _timeout_applies}, 2, timeout=120)
        results = run_checks(CHECKS, 2, timeout=SPAWN_TIMEOUT_S)
        return {"main": results, "timeout": timeout_run.result()}


@pytest.mark.parametrize("trace", ["traced", "eager"])
def test_a_forgotten_pmean_is_an_error_at_the_second_call_naming_the_leaf(runs, trace):
    for r, out in enumerate(runs["main"][f"forgotten_pmean_{trace}"]):
        assert out.get("error") == "ReplicaMismatchError", (trace, r, out)
        assert out["calls"] == 1, (trace, out)
        assert "pmean" in out["message"]
        if trace == "traced":
            assert "['0.weight']" in out["message"] or "['0.bias']" in out["message"]
            assert "[3]['x']" in out["message"], out["message"]


def test_per_rank_metrics_are_allowed_and_the_schedule_shows_them(runs):
    ranks = runs["main"]["per_rank_metrics"]
    assert_ranks_equal([out["params"] for out in ranks], "params")
    replication = dict(ranks[0]["replication"])
    assert replication["[0]['0.weight']"] == "replicated"
    assert replication["[2]"].startswith("per-rank (from argument leaf [3]")
    assert re.search(
        r"^outputs: \d+ replicated, 1 per-rank: \[2\] \(from argument leaf \[3\]",
        ranks[0]["table"],
        re.M,
    ), ranks[0]["table"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("static_config_traced", "Config(dropout=0.5)"),
        ("static_mode_traced", "Mode.EVAL"),
        ("static_config_eager", "Config(dropout=0.5)"),
    ],
)
def test_static_arguments_that_differ_are_named_with_both_values(runs, name, expected):
    for out in runs["main"][name]:
        assert out.get("error") == "ScheduleMismatchError", out
        assert "argument leaf [2]" in out["message"] and expected in out["message"]


@pytest.mark.parametrize("kind", ["rows", "transpose"])
def test_permuted_or_transposed_replicas_are_caught_by_the_digest(runs, kind):
    for out in runs["main"][f"permuted_{kind}"]:
        assert out.get("error") == "ReplicaMismatchError", out
        assert "['w']" in out["message"]


@pytest.mark.parametrize("kind", ["shape", "swapped"])
def test_trace_false_agrees_on_the_signature_too(runs, kind):
    for out in runs["main"][f"eager_{kind}"]:
        assert out.get("error") == "ScheduleMismatchError", out
        assert "[0]['a']" in out["message"] or "[0]['b']" in out["message"]


@pytest.mark.parametrize("trace", ["traced", "eager"])
def test_pmean_of_integers_is_one_type_error(runs, trace):
    for out in runs["main"][f"integer_pmean_{trace}"]:
        assert out.get("error") == "UsageTypeError", out  # a TypeError
        assert "psum" in out["message"] and "int64" in out["message"]


def test_two_threads_one_call_runs_and_the_other_is_refused(runs):
    for rank_out in runs["main"]["two_threads"]:
        kinds = sorted(o.get("error", "ok") for o in rank_out["outcomes"])
        assert kinds == ["RuntimeError", "ok"], rank_out
        message = next(o["message"] for o in rank_out["outcomes"] if "message" in o)
        assert "another thread" in message


def test_nesting_data_parallel_is_refused(runs):
    for out in runs["main"]["nested"]:
        assert out.get("error") == "UsageValueError", out  # a ValueError
        assert "nesting data_parallel is not supported" in out["message"]


def test_static_keys_are_stable_and_the_cache_keeps_the_recent_programs(runs):
    for out in runs["main"]["stable_static_keys"]:
        assert out["nan_retraces"] == 0
        assert out["shape_retraces"] == 5 and out["kept"] and out["dropped"]
        assert len(out["warnings"]) == 1 and "[1]" in out["warnings"][0]
        assert "tensor" in out["warnings"][0]


def _timeout_applies():
    fddp.rank()  # joins the group with the default timeout
    fddp.init(timeout=2)
    start = time.monotonic()
    if fddp.rank() == 1:
        time.sleep(6)
        return None
    try:
        dist.all_reduce(torch.ones(1))
        out = {"seconds": time.monotonic() - start, "message": None}
    except RuntimeError as e:
        out = {"seconds": time.monotonic() - start, "message": str(e)}
    pstep = fddp.data_parallel(_sgd)
    out["later"] = [_outcome(pstep, {"w": torch.ones(4, 4)}, torch.ones(2, 4)) for _ in range(2)]
    return out


def test_later_explicit_timeout_applies_to_the_existing_group(runs):
    out = runs["timeout"]["timeout"][0]
    assert out["message"] is not None
    assert out["seconds"] < 5.5, out
    for later in out["later"]:  # every later call names the failure the same way
        assert later.get("error") == "RankFailureError", later


def test_a_step_after_destroy_process_group_raises_at_once(runs):
    for out in runs["main"]["destroyed"]:
        assert out.get("error") == "RuntimeError", out
        assert "destroy_process_group" in out["message"] and "fddp.init()" in out["message"]
        assert out["seconds"] < 2


def test_a_python_float_that_changes_every_step_is_named_in_one_warning():
    step = fddp.data_parallel(lambda w, x, lr: w - lr * fddp.pmean(x), check_replicas=False)
    w = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            w = step(w, torch.ones(2), 0.1 / (i + 1))
    messages = [str(c.message) for c in caught if c.category is fddp.RetraceWarning]
    assert len(messages) == 1
    assert "argument leaf [2]" in messages[0] and "torch.tensor(value)" in messages[0]


def test_integer_pmean_under_vmap_is_the_same_type_error():
    sim = fddp.vmap(lambda c: fddp.pmean(c), axis_name="data")
    with pytest.raises(TypeError, match="psum"):
        sim(torch.tensor([1, 2]))
