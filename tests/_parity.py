"""What the DDP parity tests (tests/test_parity_*.py) share: reference helpers and one spawn.

Each parity module compares a DDP feature with fddp's, side by side on the same model, data and
seed. Its 2-rank checks register with :func:`two_rank_check`; the first test that asks for
:func:`two_rank_runs` runs every registered check, of every parity module collected, in one
spawn of 2 ranks (spawning costs seconds: every rank imports torch and traces its first step).
A check returns plain values that the tests compare; one that raises is reported by the tests
that read it, without hiding the other checks.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import _models
import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import fddp
import fddp.optim as optim

WORLD = 2
SIZES = (16, 32, 32, 4)
TOL = {"rtol": 1e-5, "atol": 1e-5}
SPAWN_TIMEOUT_S = 600

_TWO_RANK_CHECKS: dict[str, Callable[[], Any]] = {}


# --- one spawn for the 2-rank checks of every parity module --------------------------------------


def two_rank_check(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register a module-level, zero-argument check whose result the tests read as ``name``."""

    def register(check: Callable[[], Any]) -> Callable[[], Any]:
        assert name not in _TWO_RANK_CHECKS, f"two parity checks are named {name!r}"
        _TWO_RANK_CHECKS[name] = check
        return check

    return register


@functools.cache
def two_rank_runs() -> list[dict]:
    """``runs[rank][name]``: every registered check's result (or traceback), from one spawn."""
    return run_ranks(_run_checks, WORLD, dict(_TWO_RANK_CHECKS), timeout=SPAWN_TIMEOUT_S)


def _run_checks(checks: dict[str, Callable[[], Any]]) -> dict:
    """Each check in turn, its result or its traceback, so one failure hides no other check.

    Each check fails or passes alike on every rank, so no rank is left waiting in a collective.
    """
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def results_of(runs: list[dict], name: str) -> list:
    """Check ``name``'s result on each rank; a check that raised fails the test with its trace."""
    values = [run[name] for run in runs]
    for r, value in enumerate(values):
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"{name} raised on rank {r}:\n{value['error']}", pytrace=False)
    return values


# --- models, data, steps -------------------------------------------------------------------------


def mse_setup(sizes=SIZES, seed=0):
    """An MLP and its MSE ``loss_fn(params, x, y)``."""
    model = _models.mlp(sizes, seed=seed)
    apply = fddp.functional(model)

    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, {}, x), y)

    return model, loss_fn


def full_batch(step: int, rows: int, sizes=SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: ``rows`` rows of ``(x, y)``."""
    b = _models.regression_batch(step, rows, sizes[0], sizes[-1])
    return b["x"], b["y"]


def local_batch(step: int, rows: int, sizes=SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``rows`` rows of the global batch of ``rows * world_size`` rows."""
    x, y = full_batch(step, rows * fddp.world_size(), sizes)
    return fddp.shard(x), fddp.shard(y)


def sgd_step(loss_fn, opt, reduce=fddp.pmean):
    """``step(params, opt_state, *batch)``: grads reduced with ``reduce``, loss averaged alike."""

    def step(params, opt_state, *batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(reduce(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, reduce(loss)

    return step


def ddp_step(ddp, opt, x, y) -> torch.Tensor:
    """One DDP training step on MSE; this rank's loss."""
    opt.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return loss


def ddp_train_step(ddp, opt, x, y) -> float:
    """One DDP training step on MSE; the loss averaged over the ranks."""
    return global_mean(ddp_step(ddp, opt, x, y))


# --- values and comparisons ----------------------------------------------------------------------


def flat(tree) -> torch.Tensor:
    """Every leaf of ``tree``, flattened into one float32 vector."""
    return torch.cat([t.detach().reshape(-1).float() for t in optree.tree_leaves(tree)])


def named_params(module: nn.Module) -> dict:
    """Parameters by name, flattened in the same (sorted-key) order as fddp's params dicts."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def global_mean(x: torch.Tensor) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def from_rank0(tree):
    """Rank 0's values of ``tree`` on every rank (a plain broadcast, outside fddp)."""
    leaves, spec = optree.tree_flatten(optree.tree_map(torch.clone, tree))
    for leaf in leaves:
        dist.broadcast(leaf, 0)
    return optree.tree_unflatten(spec, leaves)


def assert_steps_close(actual: list, expected: list, what: str, **tol) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m, i=i: f"{what}, step {i + 1}: {m}")


def assert_ranks_equal(values: list, what: str) -> None:
    for r in range(1, len(values)):
        for a, b in zip(optree.tree_leaves(values[0]), optree.tree_leaves(values[r])):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), f"{what}: rank {r} != 0"
