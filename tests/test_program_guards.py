"""A compiled step is reused only while what its trace read is unchanged: a module attribute
(a dropout's ``p``, a LayerNorm's ``eps``), a field of a plain object passed as an argument,
autocast. Each test changes one of them between calls, as a user would, and the next call
computes what the step computes eagerly with the new value."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks
from torch import nn

import fddp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(6, 3)

        self.gain = torch.tensor(1.0)  # a plain tensor attribute: a constant of the program

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.norm(torch.tanh(self.fc(x))))) * self.gain


class Config:
    """A plain (mutable, unhashable by value) settings object."""

    def __init__(self) -> None:
        self.scale = 1.0


def _setup():
    torch.manual_seed(0)
    net = Net()
    apply = fddp.functional(net)
    params, buffers = fddp.state(net)

    def step(params, x, y, config=None):
        scale = 1.0 if config is None else config.scale

        def loss_fn(p):
            return F.mse_loss(apply(p, buffers, x) * scale, y)

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        grads = fddp.pmean(grads)
        return {k: v - 0.1 * grads[k] for k, v in params.items()}, fddp.pmean(loss)

    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 3)
    return net, step, params, x, y


def _both(step, *args):
    """The traced step's result and the eager step's, for the same arguments."""
    return step[0](*args), step[1](*args)


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("a dropout's p", lambda net, config: setattr(net.drop, "p", 1.0)),
        ("a LayerNorm's eps", lambda net, config: setattr(net.norm, "eps", 10.0)),
        ("a field of a config argument", lambda net, config: setattr(config, "scale", 3.0)),
        (
            "a tensor attribute set anew",
            lambda net, config: setattr(net, "gain", torch.tensor(2.0)),
        ),
    ],
)
def test_a_value_the_trace_read_changed_between_calls(what, change):
    fddp.init()
    net, step, params, x, y = _setup()
    config = Config()
    steps = (fddp.data_parallel(step), fddp.data_parallel(step, trace=False))
    got, want = _both(steps, params, x, y, config)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    change(net, config)
    got, want = _both(steps, params, x, y, config)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_first_call_under_autocast_and_the_next_outside():
    fddp.init()
    _, step, params, x, y = _setup()
    steps = (fddp.data_parallel(step), fddp.data_parallel(step, trace=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = _both(steps, params, x, y)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)
    got, want = _both(steps, params, x, y)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_value_that_keeps_changing_is_named_in_a_warning():
    fddp.init()
    net, step, params, x, y = _setup()
    pstep = fddp.data_parallel(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for eps in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
            net.norm.eps = eps
            pstep(params, x, y)
    named = [w for w in caught if issubclass(w.category, fddp.RetraceWarning)]
    assert len(named) == 1 and "norm.eps" in str(named[0].message)
    assert pstep.retraces == 4


def test_unchanged_values_reuse_the_program():
    fddp.init()
    net, step, params, x, y = _setup()
    pstep = fddp.data_parallel(step)
    config = Config()
    for _ in range(3):
        params, _ = pstep(params, x, y, config)
    net.drop.p = 0.0  # the same value, written again
    config.scale = 1.0
    pstep(params, x, y, config)
    assert pstep.retraces == 0


def _one_rank_changes_p() -> tuple[str, str]:
    """Rank 1 alone sets its dropout's ``p`` between two calls: what each rank raises."""
    net, step, params, x, y = _setup()
    pstep = fddp.data_parallel(step)
    pstep(params, x, y)
    if fddp.rank() == 1:
        net.drop.p = 1.0
    try:
        pstep(params, x, y)
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks({"one rank changes p": _one_rank_changes_p}, world_size=2)


def test_a_value_changed_on_one_rank_is_an_error_on_every_rank(two_ranks):
    """The rank that would compile again and the rank that would run its program agree on
    the verdict first: both raise, naming the value, instead of waiting on each other."""
    for kind, message in two_ranks["one rank changes p"]:
        assert kind == "ScheduleMismatchError", message
        assert "Net.drop.p changed" in message, message
