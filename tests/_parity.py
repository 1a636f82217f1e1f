"""What the DDP parity tests (tests/test_parity_*.py) share: reference helpers and one spawn.

Each parity module compares a DDP feature with fddp's, side by side on the same model, data and
seed. Its 2-rank checks register with :func:`two_rank_check`; the first test that asks for
:func:`two_rank_runs` runs every registered check, of every parity module collected, by name in
one run of 2 ranks (tests/_dist.py's ``run_checks``). A check returns plain values (parameter
trees after every step, which the tests compare with tests/_compare.py); one that raises fails
the tests that read it, without hiding the other checks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import _models
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import CheckResults, run_checks
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
def two_rank_runs() -> CheckResults:
    """``runs[name][rank]``: every registered check's result, from one run of 2 ranks."""
    return run_checks(dict(_TWO_RANK_CHECKS), WORLD, timeout=SPAWN_TIMEOUT_S)


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
