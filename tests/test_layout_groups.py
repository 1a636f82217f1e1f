"""Sharded layouts record the process group they were cut over, and meshes are agreed, on 4 gloo
ranks: parameters or optimizer state used over another group of the same size are refused
(naming both groups), a mesh whose axes are not a partition, the same on every rank, is refused
instead of hanging, hybrid sharding without an orthogonal replicate axis is refused, the full
parameters of a hybrid-sharded run come back with a plain ``full_params``, and ``full_params``
without its peers raises :class:`fddp.RankFailureError`.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks

import fddp
import fddp.optim as optim

WORLD = 4
STEPS = 2
LR = 0.1


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)


def _loss(p, x, y):
    return F.mse_loss(x @ p["w"] + p["b"], y)


def _local(i):
    return tuple(t.chunk(WORLD)[dist.get_rank()] for t in _batch(i))


def _groups(*members):
    """Every rank makes every group (torch.distributed requires it); each rank gets the first
    group that holds it."""
    made = [dist.new_group(list(m)) for m in members]
    return next(g for g, m in zip(made, members) if dist.get_rank() in m)


def _pairs():
    return _groups((0, 1), (2, 3))


def _peers():
    return _groups((0, 2), (1, 3))


def _outcome(fn):
    """What ``fn()`` did, the same kind of value on every rank: ("raised", type, message) or
    ("returned", value)."""
    try:
        return ("returned", fn())
    except Exception as e:
        return ("raised", type(e).__name__, str(e))


def _step(opt, axis_name="data"):
    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss, axis_name)

    return step


def check_wrong_pairing():
    """Parameters sharded over the pairs {0, 1}, {2, 3}, a traced step over {0, 2}, {1, 3}."""
    pair, peer = _pairs(), _peers()
    opt = optim.shard_state(optim.sgd(LR))
    state = fddp.data_parallel(opt.init, trace=False, group=peer)(_params())
    sharded = fddp.shard_params(_params(), group=pair)
    step = fddp.data_parallel(_step(opt), group=peer)
    return _outcome(lambda: step(sharded, state, *_local(0))[2].item())


def check_full_params_over_another_group():
    sharded = fddp.shard_params(_params(), group=_pairs())
    peer = _peers()
    return _outcome(lambda: fddp.full_params(sharded, group=peer))


def check_state_over_another_group():
    pair, peer = _pairs(), _peers()
    opt = optim.shard_state(optim.sgd(LR))
    state = fddp.data_parallel(opt.init, trace=False, group=pair)(_params())
    step = fddp.data_parallel(_step(opt), trace=False, group=peer)
    return _outcome(lambda: step(_params(), state, *_local(0))[2].item())


def _hybrid(mesh, **shard_state_options):
    """``STEPS`` hybrid-sharded AdamW steps over ``mesh``; the sharded parameters."""
    opt = optim.shard_state(optim.adamw(LR), axis_name="shard", **shard_state_options)
    state = fddp.data_parallel(opt.init, trace=False, axes=mesh)(_params())
    params = fddp.shard_params(_params(), "shard", group=mesh["shard"])
    step = fddp.data_parallel(_step(opt), axes=mesh)
    for i in range(STEPS):
        params, state, _ = step(params, state, *_local(i))
    return params


def _reference():
    """One process, the whole batch."""
    opt = optim.adamw(LR)
    params = _params()
    state = opt.init(params)
    for i in range(STEPS):
        grads = fddp.grad(_loss)(params, *_batch(i))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def check_hybrid_full_params():
    sharded = _hybrid({"shard": _pairs(), "replicate": _peers()}, replicate_axis="replicate")
    return {"full": fddp.full_params(sharded), "reference": _reference()}


def _trained(mesh, **shard_state_options):
    """The full parameters after ``_hybrid`` (to compare when it is not refused)."""
    return fddp.full_params(_hybrid(mesh, **shard_state_options), group=mesh["shard"])


def check_replicate_is_the_world():
    mesh = {"shard": _pairs(), "replicate": dist.group.WORLD}
    return _outcome(lambda: _trained(mesh, replicate_axis="replicate"))


def check_replicate_is_the_shard_pair():
    pair = _pairs()
    return _outcome(
        lambda: _trained({"shard": pair, "replicate": pair}, replicate_axis="replicate")
    )


def check_no_replicate_axis():
    return _outcome(lambda: _trained({"shard": _pairs(), "replicate": _peers()}))


def _replicated_step(mesh):
    """One SGD step averaged over the mesh's "shard" axis; its loss."""

    def step(p, x, y):
        loss, g = fddp.value_and_grad(_loss)(p, x, y)
        g = fddp.pmean(g, "shard")
        return optim.apply_updates(p, optree.tree_map(lambda v: -LR * v, g)), fddp.pmean(loss)

    return fddp.data_parallel(step, axes=mesh)(_params(), *_local(0))[1].item()


def check_overlapping_groups():
    """Each rank with its next: {0, 1}, {1, 2}, {2, 3}, {3, 0}, equal sizes, no partition."""
    made = [dist.new_group(sorted({r, (r + 1) % WORLD})) for r in range(WORLD)]
    return _outcome(lambda: _replicated_step({"shard": made[dist.get_rank()]}))


def check_unequal_groups():
    return _outcome(lambda: _replicated_step({"shard": _groups((0, 1, 2), (3,))}))


def check_full_params_alone():
    """Rank 0 gathers; the others never call full_params (they return, and their processes
    end)."""
    sharded = fddp.shard_params(_params())
    if dist.get_rank() != 0:
        return None
    fddp.init(timeout=20)
    return _outcome(lambda: fddp.full_params(sharded))


CHECKS = {
    "wrong pairing": check_wrong_pairing,
    "full_params over another group": check_full_params_over_another_group,
    "state over another group": check_state_over_another_group,
    "hybrid full_params": check_hybrid_full_params,
    "replicate is the world": check_replicate_is_the_world,
    "replicate is the shard pair": check_replicate_is_the_shard_pair,
    "no replicate_axis": check_no_replicate_axis,
    "overlapping groups": check_overlapping_groups,
    "unequal groups": check_unequal_groups,
    "full_params alone": check_full_params_alone,  # last: it leaves the group broken
}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, WORLD, timeout=240)


def _raised_on_every_rank(outcomes, error, *parts):
    for rank, outcome in enumerate(outcomes):
        assert outcome[:2] == ("raised", error), (rank, outcome)
        for part in parts:
            assert part in outcome[2], (rank, part, outcome[2])


def _own(pairs, rank):
    return next(str(p) for p in pairs if rank in p)


@pytest.mark.parametrize(
    "name", ["wrong pairing", "full_params over another group", "state over another group"]
)
def test_a_layout_used_over_another_group_is_refused_naming_both(runs, name):
    for rank, outcome in enumerate(runs[name]):
        _raised_on_every_rank([outcome], "UsageValueError")
        cut, used = ((0, 1), (2, 3)), ((0, 2), (1, 3))
        if name == "state over another group":
            assert "cut over the group of ranks" in outcome[2]
        else:
            assert "sharded over the group of ranks" in outcome[2]
        assert _own(cut, rank) in outcome[2] and _own(used, rank) in outcome[2], outcome[2]


def test_full_params_of_hybrid_sharding_equal_the_single_process_parameters(runs):
    for out in runs["hybrid full_params"]:
        assert_trees_close(out["full"], out["reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["replicate is the world", "replicate is the shard pair"])
def test_a_replicate_axis_that_is_not_orthogonal_is_refused(runs, name):
    _raised_on_every_rank(runs[name], "UsageValueError", "replicate_axis='replicate'", "meet in")


def test_hybrid_sharding_without_replicate_axis_is_refused(runs):
    _raised_on_every_rank(runs["no replicate_axis"], "UsageValueError", "replicate_axis=")


def test_groups_that_overlap_differently_on_each_rank_are_refused_not_hung(runs):
    _raised_on_every_rank(
        runs["overlapping groups"], "ScheduleMismatchError", "axes['shard']", "disjoint"
    )


def test_groups_of_different_sizes_are_refused(runs):
    _raised_on_every_rank(runs["unequal groups"], "UsageValueError", "(0, 1, 2)", "(3,)")


def test_full_params_without_its_peers_raises_rank_failure(runs):
    outcome = runs["full_params alone"][0]
    assert outcome[:2] == ("raised", "RankFailureError"), outcome
    assert "fddp.full_params (a collective" in outcome[2]
