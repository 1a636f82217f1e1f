"""A compiled step is reused only while the globals and closure variables its Python read are
unchanged: a global number, a global dict's entry, a global object's attribute, a closure
variable of the step, a global rebound to another tensor. Each test changes one of them between
calls, as a user would, and every call computes what the step computes eagerly."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from _compare import assert_trees_close
from _dist import run_checks

import fddp


class Settings:
    """A plain settings object the step reads through a global."""

    def __init__(self) -> None:
        self.scale = 1.0


LR = 0.1
CONFIG = {"lr": 1.0}
SETTINGS = Settings()
GAIN = torch.tensor(1.0)


@pytest.fixture(autouse=True)
def _fresh_globals():
    global LR, CONFIG, SETTINGS, GAIN
    LR, CONFIG, SETTINGS, GAIN = 0.1, {"lr": 1.0}, Settings(), torch.tensor(1.0)
    fddp.init()


def step(w, x):
    g = fddp.grad(lambda w: (x @ w).pow(2).mean())(w)
    return w - LR * CONFIG["lr"] * SETTINGS.scale * GAIN * fddp.pmean(g)


def make_closure_step():
    """A step closing over ``lr``, and what sets it anew (``nonlocal``)."""
    lr = 0.1

    def closure_step(w, x):
        g = fddp.grad(lambda w: (x @ w).pow(2).mean())(w)
        return w - lr * fddp.pmean(g)

    def set_lr(value):
        nonlocal lr
        lr = value

    return closure_step, set_lr


def _set_lr(value):
    global LR
    LR = value


def _set_gain(value):
    global GAIN
    GAIN = torch.tensor(value)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, generator=gen), torch.randn(4, 3, generator=gen)


CHANGES = {
    "a global float": (step, lambda v: _set_lr(v), "test_step_globals.LR"),
    "a global dict's entry": (
        step,
        lambda v: CONFIG.__setitem__("lr", v),
        "test_step_globals.CONFIG",
    ),
    "a global object's attribute": (
        step,
        lambda v: setattr(SETTINGS, "scale", v),
        "test_step_globals.SETTINGS",
    ),
    "a global rebound to another tensor": (step, _set_gain, "test_step_globals.GAIN"),
}


def _changes(name):
    if name != "a closure variable":
        return CHANGES[name]
    closure_step, set_lr = make_closure_step()
    return closure_step, set_lr, "the closure variable lr"


@pytest.mark.parametrize("name", [*CHANGES, "a closure variable"])
def test_a_value_the_step_read_changed_between_calls(name):
    fn, change, named = _changes(name)
    pstep = fddp.data_parallel(fn)
    w, x = _inputs()
    assert_trees_close(pstep(w, x), fn(w, x), rtol=1e-6, atol=1e-7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (0.5, 2.0, 3.0, 4.0):
            change(value)
            assert_trees_close(pstep(w, x), fn(w, x), rtol=1e-6, atol=1e-7)
    assert pstep.retraces == 4
    warned = [str(w.message) for w in caught if issubclass(w.category, fddp.RetraceWarning)]
    assert len(warned) == 1 and named in warned[0], warned


@pytest.mark.parametrize("name", [*CHANGES, "a closure variable"])
def test_unchanged_values_reuse_the_program(name):
    fn, change, _ = _changes(name)
    pstep = fddp.data_parallel(fn)
    w, x = _inputs()
    for _ in range(3):
        w = pstep(w, x)
    if name != "a global rebound to another tensor":  # the same value, written again
        change(1.0 if name != "a global float" and name != "a closure variable" else 0.1)
    assert_trees_close(pstep(w, x), fn(w, x), rtol=1e-6, atol=1e-7)
    assert pstep.retraces == 0  # the one program compiled first


def test_a_global_tensor_changed_in_place_is_seen_without_a_retrace():
    """A global tensor is a constant of the program held by reference."""
    pstep = fddp.data_parallel(step)
    w, x = _inputs()
    pstep(w, x)
    GAIN.fill_(3.0)
    assert_trees_close(pstep(w, x), step(w, x), rtol=1e-6, atol=1e-7)
    assert pstep.retraces == 0


def test_a_global_the_step_writes_is_its_trace_time_side_effect():
    """Python the step runs besides reading runs while it is traced, not on the calls that
    reuse the program: a counter it bumps moves once, and the program is reused."""
    pstep = fddp.data_parallel(counting_step)
    w, x = _inputs()
    for _ in range(3):
        pstep(w, x)
    assert CALLS == [1] and pstep.retraces == 0


CALLS: list[int] = []


def counting_step(w, x):
    global CALLS
    CALLS = [len(CALLS) + 1]
    return step(w, x)


def _one_rank_changes_a_global() -> tuple[str, str]:
    """Rank 1 alone sets the global ``LR`` between two calls: what each rank raises."""
    pstep = fddp.data_parallel(step)
    w, x = _inputs()
    pstep(w, x)
    if fddp.rank() == 1:
        _set_lr(0.5)
    try:
        pstep(w, x)
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks({"one rank changes a global": _one_rank_changes_a_global}, world_size=2)


def test_a_global_changed_on_one_rank_is_an_error_on_every_rank(two_ranks):
    for kind, message in two_ranks["one rank changes a global"]:
        assert kind == "ScheduleMismatchError", message
        assert "test_step_globals.LR changed" in message, message


def test_under_another_trace_function_the_log_says_globals_are_not_checked(caplog):
    """A debugger's or coverage's trace function stays in place: the step's code is not
    followed while it is captured, and the log says what that leaves unchecked."""
    pstep = fddp.data_parallel(step)
    w, x = _inputs()
    sys.settrace(lambda frame, event, arg: None)
    try:
        with caplog.at_level(logging.INFO, logger="fddp"):
            got = pstep(w, x)
    finally:
        sys.settrace(None)
    assert_trees_close(got, step(w, x), rtol=1e-6, atol=1e-7)
    said = [r.getMessage() for r in caplog.records if "another trace function" in r.getMessage()]
    assert said and "globals and closure variables" in said[0], said
