"""DDP parity: unused parameters and process groups.

A branch taken on some steps, or on some ranks, against DDP's ``find_unused_parameters=True``;
a Python branch on the rank raises instead of letting the ranks train apart. Two independent
data-parallel groups of a 4-rank world (``group=``) against DDP's ``process_group=`` and single
process training. The 2-rank checks run in the one spawn of tests/_parity.py; the 4-rank
check in a spawn of its own.
"""

from __future__ import annotations

import copy

import _models
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import assert_ranks_equal, assert_trees_close, detached, max_abs_diff
from _dist import run_checks
from _parity import (
    SIZES,
    TOL,
    ddp_step,
    full_batch,
    local_batch,
    mse_setup,
    named_params,
    sgd_step,
    two_rank_check,
    two_rank_runs,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fddp
import fddp.optim as optim
from fddp import ScheduleMismatchError

# --- unused parameters ---------------------------------------------------------------------------


class _Branchy(nn.Module):
    """A trunk, an optional residual branch and a head; ``use_branch`` a bool or a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool | torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if isinstance(use_branch, torch.Tensor):  # the pattern that works per rank: mask
            h = torch.where(use_branch, h + torch.tanh(self.branch(h)), h)
        elif use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _branchy_run(steps, ddp_use_branch, step_arg, fddp_use_branch, *, momentum: float) -> dict:
    """DDP (find_unused_parameters=True) and fddp on _Branchy; ``step_arg(s)`` is passed to the
    fddp step, which turns it into the model's ``use_branch`` with ``fddp_use_branch``."""
    torch.manual_seed(0)
    model = _Branchy()
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.1, momentum=momentum)
    ddp = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)

    @fddp.data_parallel
    def step(params, opt_state, x, y, arg):
        def loss_fn(params):
            return F.mse_loss(apply(params, {}, x, fddp_use_branch(arg)), y)

        grads = fddp.grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    params = fddp.state(model)[0]
    state = opt.init(params)
    out = {"params": [], "ddp_params": [], "branch_moved": []}
    for s in range(steps):
        x, y = local_batch(s, 4)
        before = params["branch.weight"]
        params, state = step(params, state, x, y, step_arg(s))
        torch_opt.zero_grad()
        F.mse_loss(ddp(x, ddp_use_branch(s)), y).backward()
        torch_opt.step()
        out["params"].append(detached(params))
        out["ddp_params"].append(detached(named_params(ddp.module)))
        out["branch_moved"].append(not torch.equal(before, params["branch.weight"]))
    out["retraces"] = step.retraces
    return out


@two_rank_check("some_steps")
def _check_unused_on_some_steps() -> dict:
    """On some steps, on every rank: the choice is a step argument (one graph per value).

    Plain SGD: torch.optim skips a parameter whose .grad is None, fddp gives it a zero
    gradient; both leave it in place only when the optimizer has no momentum.
    """
    return _branchy_run(
        4, lambda s: s % 2 == 0, lambda s: s % 2 == 0, lambda use: use, momentum=0.0
    )


@two_rank_check("some_ranks")
def _check_unused_on_some_ranks() -> dict:
    """On some ranks: fddp computes the branch everywhere and masks it with the replica index."""
    rank = fddp.rank()
    return _branchy_run(
        4, lambda s: rank == 0, lambda s: None, lambda _: fddp.axis_index() == 0, momentum=0.9
    )


@two_rank_check("python_branch_on_rank")
def _check_python_branch_on_rank() -> dict:
    rank = fddp.rank()
    try:
        run = _branchy_run(
            1, lambda s: rank == 0, lambda s: None, lambda _: rank == 0, momentum=0.9
        )
    except ScheduleMismatchError as e:
        return {"raised": str(e)}
    return {"raised": None, "params": run["params"][-1]}


# --- the 2-rank tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return two_rank_runs()


@pytest.mark.parametrize("where", ["some_steps", "some_ranks"])
def test_unused_parameters_train_like_ddp_find_unused(runs, where):
    results = runs[where]
    for r in results:
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what=f"{where}: params vs DDP")
    assert_ranks_equal([r["params"] for r in results], where)
    if where == "some_steps":
        assert results[0]["branch_moved"] == [True, False, True, False]
        assert results[0]["retraces"] == 1  # one program per value


def test_python_branch_on_the_rank_raises_instead_of_diverging(runs):
    results = runs["python_branch_on_rank"]
    for r in results:
        assert r["raised"] is not None, "ranks traced different steps and trained apart"
        assert "no branch depends on the rank" in r["raised"]


# --- process groups: 4 ranks, two independent data-parallel groups -------------------------------


def _groups_worker() -> dict:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    index = rank // 2
    group = groups[index]
    model, loss_fn = mse_setup(seed=rank)  # different everywhere until replicated per group
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.replicate(fddp.state(model)[0], src=0, group=group)
    state = opt.init(params)
    pstep = fddp.data_parallel(sgd_step(loss_fn, opt), group=group)
    ddp = DistributedDataParallel(_models.mlp(SIZES, seed=rank), process_group=group)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    reference = sgd_step(loss_fn, opt, lambda t: t)
    ref, ref_state = params, state
    out = {"group": index, "params": [], "ddp_params": [], "ref_params": []}
    for s in range(3 + 2 * index):  # the groups do not even make the same number of steps
        x, y = full_batch(100 * index + s, 8)
        local = fddp.shard((x, y), group=group)
        params, state, _ = pstep(params, state, *local)
        ddp_step(ddp, torch_opt, *local)  # no world-wide loss mean: the groups are apart
        ref, ref_state, _ = reference(ref, ref_state, x, y)
        out["params"].append(detached(params))
        out["ddp_params"].append(detached(named_params(ddp.module)))
        out["ref_params"].append(detached(ref))
    return out


def test_two_process_groups_train_independently():
    results = run_checks({"two_groups": _groups_worker}, 4, timeout=300)["two_groups"]
    for r in results:
        assert_trees_close(r["params"], r["ref_params"], **TOL, what=f"group {r['group']}")
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what=f"group {r['group']} DDP")
    assert [len(r["params"]) for r in results] == [3, 3, 5, 5]
    assert_ranks_equal([r["params"] for r in results[:2]], "group 0")
    assert_ranks_equal([r["params"] for r in results[2:]], "group 1")
    assert max_abs_diff(results[0]["params"][-1], results[2]["params"][-1]) > 1e-3  # apart
