"""DDP parity: gradient accumulation and uneven inputs.

``accumulate_gradients`` and one ``pmean`` against DDP's ``no_sync()`` on all but the last
microbatch; an epoch over a dataset that does not split evenly (``shard_batches``, ``lockstep``,
``pad_rows``, ``weighted_pmean``) against one process on all of it (DDP's ``join`` does not give
the exact global mean), and a rank that runs out of data early. The 2-rank checks run in the
one spawn of tests/_parity.py; the helpers themselves are also checked in a world of one.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, detached
from _parity import (
    TOL,
    full_batch,
    global_mean,
    local_batch,
    mse_setup,
    named_params,
    sgd_step,
    two_rank_check,
    two_rank_runs,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import fddp
import fddp.optim as optim
from fddp import accumulate_gradients
from fddp.data import lockstep, pad_rows, shard_batches, weighted_pmean

ACCUM_K = 3


# --- gradient accumulation -----------------------------------------------------------------------


@two_rank_check("accumulation")
def _check_accumulation(steps: int = 4) -> dict:
    """accumulate_gradients + one pmean against DDP with no_sync() on k-1 microbatches."""
    model, loss_fn = mse_setup()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.state(model)[0]
    state = opt.init(params)

    @fddp.data_parallel
    def step(params, opt_state, x, y):
        loss, grads = accumulate_gradients(loss_fn, ACCUM_K, batch_argnums=(1, 2))(params, x, y)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    ddp = DistributedDataParallel(copy.deepcopy(model))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    out = {"params": [], "ddp_params": [], "loss": [], "ddp_loss": []}
    for s in range(steps):
        x, y = local_batch(s, 2 * ACCUM_K)
        params, state, loss = step(params, state, x, y)
        torch_opt.zero_grad()
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(ACCUM_K), y.chunk(ACCUM_K))):
            sync = contextlib.nullcontext() if i == ACCUM_K - 1 else ddp.no_sync()
            with sync:
                micro = F.mse_loss(ddp(xi), yi) / ACCUM_K
                micro.backward()
            total += global_mean(micro)
        torch_opt.step()
        out["params"].append(detached(params))
        out["ddp_params"].append(detached(named_params(ddp.module)))
        out["loss"].append(loss.item())
        out["ddp_loss"].append(total)
    x, y = local_batch(0, 2 * ACCUM_K)
    out["reduced_leaves"] = [
        leaf for c in step.schedule(params, state, x, y).collectives for leaf in c.leaves
    ]
    out["param_leaves"] = len(params)
    return out


# --- uneven inputs -------------------------------------------------------------------------------


@two_rank_check("uneven")
def _check_uneven() -> dict:
    """An epoch over a dataset that does not split evenly, against one process on it all."""
    model, loss_fn = mse_setup()
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.1, momentum=0.9)

    def masked_loss(params, x, y, mask):
        per_row = ((apply(params, {}, x) - y) ** 2).mean(1)
        return (per_row * mask).sum() / mask.sum().clamp(min=1)

    @fddp.data_parallel
    def step(params, opt_state, x, y, mask):
        loss, grads = fddp.value_and_grad(masked_loss)(params, x, y, mask)
        rows = mask.sum()
        updates, opt_state = opt.update(weighted_pmean(grads, rows), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, weighted_pmean(loss, rows)

    reference = sgd_step(loss_fn, opt, lambda t: t)
    out = {}
    for n in (23, 17):  # last global batch: 7 rows (4 + 3), then 1 row (1 + 0)
        data_x, data_y = full_batch(500 + n, n)
        params = fddp.state(model)[0]
        ref_params, state, ref_state = params, opt.init(params), opt.init(params)
        run = {"rows": [], "params": [], "ref_params": [], "loss": [], "ref_loss": []}
        order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
        for t, idx in enumerate(lockstep(shard_batches(n, 4, shuffle=True, seed=3))):
            (x, y), mask = pad_rows((data_x[idx], data_y[idx]), 4)
            params, state, loss = step(params, state, x, y, mask)
            rows = order[t * 8 : (t + 1) * 8]
            ref_params, ref_state, ref_loss = reference(
                ref_params, ref_state, data_x[rows], data_y[rows]
            )
            run["rows"].append(len(idx))
            run["params"].append(detached(params))
            run["ref_params"].append(detached(ref_params))
            run["loss"].append(loss.item())
            run["ref_loss"].append(ref_loss.item())
        out[n] = run
    out["retraces"] = step.retraces

    short = shard_batches(21, 4)[: 2 if fddp.rank() == 1 else 3]
    try:
        out["steps_before_error"] = sum(1 for _ in lockstep(short))
        out["early_end"] = None
    except ValueError as e:
        out["early_end"] = str(e)
    return out


# --- the 2-rank tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return two_rank_runs()


def test_accumulation_matches_ddp_no_sync(runs):
    for r in runs["accumulation"]:
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what="params vs DDP no_sync")
        assert_trees_close(r["loss"], r["ddp_loss"], **TOL, what="losses vs DDP no_sync")
        grads = [leaf for leaf in r["reduced_leaves"] if leaf != "<root>"]
        assert sorted(grads) == sorted(set(grads)), "a gradient was all-reduced more than once"
        assert len(grads) == r["param_leaves"]


@pytest.mark.parametrize("n", [23, 17])
def test_uneven_epoch_equals_one_process_on_the_whole_dataset(runs, n):
    results = [r[n] for r in runs["uneven"]]
    last = 7 if n == 23 else 1
    assert [r["rows"][-1] for r in results] == [(last + 1) // 2, last // 2]
    assert all(r["rows"][:-1] == [4, 4] for r in results)  # same number of steps on every rank
    for r in results:
        assert_trees_close(r["params"], r["ref_params"], **TOL, what=f"n={n}: params")
        assert_trees_close(r["loss"], r["ref_loss"], **TOL, what=f"n={n}: losses")
    assert [r["retraces"] for r in runs["uneven"]] == [0, 0]  # padded: one shape


def test_a_rank_that_runs_out_of_data_early_raises_on_every_rank(runs):
    for r in runs["uneven"]:
        assert r["early_end"] is not None
        assert "rank(s) [1] ran out of data after 2 steps" in r["early_end"]


# --- a world of one: the helpers on their own ----------------------------------------------------


def test_accumulate_gradients_with_uneven_microbatches_is_the_full_batch():
    model, loss_fn = mse_setup()
    params = fddp.state(model)[0]
    x, y = full_batch(0, 7)
    loss, grads = accumulate_gradients(loss_fn, 3, batch_argnums=(1, 2))(params, x, y)  # 3+2+2
    ref_loss, ref_grads = fddp.value_and_grad(loss_fn)(params, x, y)
    torch.testing.assert_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads, what="gradients")
    (_, auxes), _ = accumulate_gradients(
        lambda p, x, y: (loss_fn(p, x, y), len(x)), 3, has_aux=True, batch_argnums=(1, 2)
    )(params, x, y)
    assert auxes == [3, 2, 2]


def test_accumulate_gradients_explains_mistakes():
    model, loss_fn = mse_setup()
    params = fddp.state(model)[0]
    x, y = full_batch(0, 2)
    with pytest.raises(ValueError, match="num_microbatches <= rows"):
        accumulate_gradients(loss_fn, 3, batch_argnums=(1, 2))(params, x, y)
    with pytest.raises(ValueError, match="same rows"):
        accumulate_gradients(loss_fn, 2, batch_argnums=(1, 2))(params, *full_batch(0, 3)[:1], y)
    with pytest.raises(ValueError, match="overlap"):
        accumulate_gradients(loss_fn, 2, batch_argnums=0)(params, x, y)
    with pytest.raises(ValueError, match="positive int"):
        accumulate_gradients(loss_fn, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_batches_follows_distributed_sampler_without_padding(shuffle):
    world, batch = 3, 4

    def sampler_batches(n, rank):
        sampler = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=7)
        sampler.set_epoch(2)
        return [b.tolist() for b in DataLoader(range(n), batch_size=batch, sampler=sampler)]

    def ours(n, rank):
        return shard_batches(
            n, batch, shuffle=shuffle, seed=7, epoch=2, num_replicas=world, rank=rank
        )

    for rank in range(world):
        assert ours(36, rank) == sampler_batches(36, rank)  # evenly divisible: identical
    ranks = [ours(31, rank) for rank in range(world)]  # 2 full global batches and 7 samples
    assert {len(r) for r in ranks} == {3}
    for rank, mine in enumerate(ranks):
        assert mine[:2] == sampler_batches(31, rank)[:2]
    assert [len(r[-1]) for r in ranks] == [3, 2, 2]
    assert sorted(i for r in ranks for b in r for i in b) == list(range(31))
    assert [
        len(shard_batches(31, batch, drop_last=True, num_replicas=world, rank=r))
        for r in range(world)
    ] == [2, 2, 2]


def test_weighted_pmean_under_vmap_is_the_row_weighted_mean_and_ignores_empty_replicas():
    values = torch.tensor([[1.0, 2.0], [4.0, 8.0], [float("nan"), float("nan")]])
    weights = torch.tensor([3.0, 1.0, 0.0])
    out = fddp.vmap(lambda v, w: weighted_pmean({"v": v}, w))(values, weights)
    torch.testing.assert_close(out["v"], torch.tensor([[1.75, 3.5]] * 3))
    with pytest.raises(TypeError, match="floating-point"):
        weighted_pmean({"n": torch.arange(3)}, 1)


def test_pad_rows_pads_every_leaf_and_masks_the_padding():
    (x, labels), mask = pad_rows((torch.ones(3, 2), torch.arange(3)), 5)
    assert x.shape == (5, 2) and labels.tolist() == [0, 1, 2, 0, 0]
    assert mask.tolist() == [1, 1, 1, 0, 0] and x[3:].abs().sum() == 0
    assert pad_rows(torch.ones(0, 2), 2)[1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="more than rows"):
        pad_rows(torch.ones(3), 2)
    with pytest.raises(ValueError, match="same leading"):
        pad_rows((torch.ones(3), torch.ones(2)), 4)


def test_lockstep_in_a_world_of_one_is_plain_iteration():
    assert list(lockstep(iter(range(3)))) == [0, 1, 2]
