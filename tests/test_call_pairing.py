"""Calls pair off in order across ranks, and what a step is built with is agreed: a rank that
skipped or repeated a call is named by the replicated state it passes; a peer that has exited is
a RankFailureError naming the call; a step whose compiled graphs differ in their constants (a
per-rank learning rate) is refused naming the node; the first compile's link probe stays small;
machine figures from a checkpoint that no machine can have are ignored with a warning; zero-size
leaves reach the buckets as they are. 2 gloo ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import raised, run_checks
from _models import mlp_step, regression_batch

import fddp
import fddp.optim as optim
from fddp._ranks import _machine

SIZES = (6, 8, 3)


def _batch() -> dict:
    return regression_batch(fddp.rank(), 4, SIZES[0], SIZES[-1])


def check_machine_figures_from_a_manifest() -> dict:
    """A manifest of impossible (zero) figures: ignored with a warning, measured afresh."""
    fields = len(_machine.Machine.__dataclass_fields__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _machine.restore([["cpu", 2, *([0.0] * fields)]])
    step, params = mlp_step(optim.sgd(0.1), SIZES)
    pstep = fddp.data_parallel(step)
    outcome = raised(lambda: pstep(params, optim.sgd(0.1).init(params), _batch()))
    measured = _machine.measured(None, torch.device("cpu"))
    return {
        "warnings": [str(w.message).split(":")[1] for w in caught],
        "outcome": outcome,
        "restored": _machine.restored(None, torch.device("cpu")),
        "sane": _machine.invalid_figure(measured) is None,
    }


def check_probe_bytes() -> int:
    """The bytes the link probe sends from this rank."""
    sent = [0]
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def counting(name):
        def collective(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return originals[name](tensor, *args, **kwargs)

        return collective

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        _machine.measure(None, torch.device("cpu"))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return sent[0]


def check_a_skipped_call() -> dict:
    """Rank 1 passes the state of one call earlier (it skipped applying a call, or repeated
    one): the call is refused instead of averaging gradients of other batches."""
    opt = optim.adamw(1e-2)
    step, params = mlp_step(opt, SIZES)
    pstep = fddp.data_parallel(step, check_replicas=(0, 1))
    state = opt.init(params)
    history = [(params, state)]
    for _ in range(2):
        params, state, _ = pstep(params, state, _batch())
        history.append((params, state))
    if fddp.rank() == 1:
        params, state = history[1]
    outcome = raised(lambda: pstep(params, state, _batch()))
    params, state = history[2]  # all ranks alike again: the step goes on
    after = raised(lambda: pstep(params, state, _batch()))
    return {"outcome": outcome, "after": after}


def _rank_weighted(params, x):
    """A graph that holds the rank by design: each rank's loss weighted by its index + 1."""
    weight = (fddp.axis_index() + 1).to(x.dtype)
    grads = fddp.pmean(fddp.grad(lambda p: weight * (p["w"] * x).sum())(params))
    return {"w": params["w"] - 0.5 * grads["w"]}, fddp.pmean(weight)


def check_a_per_rank_learning_rate() -> dict:
    """A learning rate that differs by rank is refused; a step that reads the rank is not."""
    opt = optim.sgd(0.1 if fddp.rank() == 0 else 0.2)
    step, params = mlp_step(opt, SIZES)
    pstep = fddp.data_parallel(step)
    refused = raised(lambda: pstep(params, opt.init(params), _batch()))
    x = torch.full((3,), float(fddp.rank() + 1))
    new, mean_weight = fddp.data_parallel(_rank_weighted)({"w": torch.ones(3)}, x)
    return {"refused": refused, "rank_weighted": (new["w"].tolist(), float(mean_weight))}


def _zero_size_step(params, x):
    def loss(p):
        return (p["w"] * x).sum() + p["empty"].sum()

    grads = fddp.pmean(fddp.grad(loss)(params))
    new = {k: params[k] - 0.1 * grads[k] for k in params}
    return new, fddp.pmean({"none": torch.zeros(0, 3), "nested": {}})


def check_zero_size_leaves() -> dict:
    """Zero-element leaves, replicated or not, pass through as in eager."""
    params = {"w": torch.ones(3), "empty": torch.zeros(0)}
    x = torch.arange(6.0).reshape(2, 3)[fddp.rank()]
    out = {}
    for name, method, trace in [
        ("make_fx", "make_fx", True),
        ("dynamo", "dynamo", True),
        ("eager", None, False),
    ]:
        pstep = fddp.data_parallel(_zero_size_step, trace=trace)
        if method is not None:
            pstep._capture_method = method
        try:
            out[name] = pstep(params, x)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    replicas = {k: torch.stack([v, v]) for k, v in params.items()}
    new, reduced = fddp.vmap(_zero_size_step)(replicas, torch.arange(6.0).reshape(2, 3))
    out["vmap"] = ({k: v[fddp.rank()] for k, v in new.items()}, {"none": reduced["none"][0]})
    return out


CHECKS = {
    "machine_figures": check_machine_figures_from_a_manifest,  # before any compile
    "probe_bytes": check_probe_bytes,
    "skipped_call": check_a_skipped_call,
    "per_rank_lr": check_a_per_rank_learning_rate,
    "zero_size": check_zero_size_leaves,
}


def check_a_rank_exits_early() -> tuple[str, str] | None:
    """Rank 1 stops after two calls and leaves the group; rank 0 calls a third time: a
    RankFailureError naming the step and the call."""
    opt = optim.sgd(0.1)
    step, params = mlp_step(opt, SIZES)
    pstep = fddp.data_parallel(step)
    state = opt.init(params)
    for _ in range(2):
        params, state, _ = pstep(params, state, _batch())
    if fddp.rank() == 1:
        dist.destroy_process_group()
        return None
    return raised(lambda: pstep(params, state, _batch()))


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, world_size=2)


@pytest.fixture(scope="module")
def exits():
    return run_checks({"exits": check_a_rank_exits_early}, world_size=2)


def test_a_rank_one_call_behind_is_named_by_its_state(runs):
    for out in runs["skipped_call"]:
        kind, message = out["outcome"]
        assert kind == "ScheduleMismatchError", out
        assert "call 3" in message and "skipped or repeated a call" in message, message
        assert "[1][0].count is 1 on rank 1 but 2 on rank 0" in message, message
        assert out["after"] == ("ok", "")


def test_a_rank_that_left_is_a_rank_failure_naming_the_call(exits):
    kind, message = exits["exits"][0]
    assert kind == "RankFailureError", message
    assert message.startswith("step, call 3: a collective failed on rank 0"), message
    assert exits["exits"][1] is None


def test_the_link_probe_sends_a_few_hundred_kilobytes(runs):
    for sent in runs["probe_bytes"]:
        assert 0 < sent <= 512_000
        assert sent == _machine.probe_bytes() + 5 * 8  # and rank 0's five figures


def test_a_per_rank_learning_rate_is_refused_naming_the_node(runs):
    outcomes = [out["refused"] for out in runs["per_rank_lr"]]
    assert outcomes[0] == outcomes[1]
    # the gradient is the mean of (r + 1) * x_r = (r + 1)^2 over ranks 0 and 1: 2.5
    for out in runs["per_rank_lr"]:
        assert out["rank_weighted"] == ([1 - 0.5 * 2.5] * 3, 1.5)
    kind, message = outcomes[0]
    assert kind == "ScheduleMismatchError", message
    assert "node '" in message and "0.2" in message and "0.1" in message, message
    assert "same settings" in message


def test_impossible_machine_figures_are_ignored_with_a_warning(runs):
    for out in runs["machine_figures"]:
        [warning] = out["warnings"]
        assert warning.startswith(" seconds_per_byte=0.0 is not a figure a machine can have")
        assert out["outcome"] == ("ok", "")
        assert out["restored"] is False and out["sane"] is True


def test_zero_size_leaves_pass_through_as_in_eager(runs):
    for out in runs["zero_size"]:
        eager = out["eager"]
        assert not isinstance(eager, str), eager
        for name in ("make_fx", "dynamo", "vmap"):
            got = out[name]
            assert not isinstance(got, str), got
            new, reduced = got
            assert set(new) == set(eager[0])
            for key in new:
                assert torch.equal(new[key], eager[0][key]), (name, key)
            assert torch.equal(reduced["none"], eager[1]["none"])
            assert name == "vmap" or reduced == {"none": reduced["none"], "nested": {}}
