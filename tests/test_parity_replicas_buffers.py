"""DDP parity: initial values, buffers and synchronised BatchNorm.

``fddp.replicate`` against DDP's broadcast of rank 0's parameters at construction, a replica
mismatch caught before it trains apart, ``sync_buffers(how="broadcast"/"mean")`` against DDP's
``broadcast_buffers=True``/``False``, and ``convert_sync_batchnorm`` against BatchNorm on the
global batch (DDP's ``SyncBatchNorm`` refuses CPU tensors). The 2-rank checks run in the one
spawn of tests/_parity.py; the helpers themselves are also checked in a world of one.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from _compare import (
    assert_ranks_equal,
    assert_trees_close,
    assert_trees_equal,
    detached,
    max_abs_diff,
)
from _parity import (
    TOL,
    ddp_train_step,
    from_rank0,
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
from fddp import ReplicaMismatchError
from fddp.nn import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm, sync_buffers

# --- initial values ------------------------------------------------------------------------------


@two_rank_check("replicas")
def _check_replicas() -> dict:
    r = fddp.rank()
    model, loss_fn = mse_setup(seed=10 + r)  # every rank starts from different values
    opt = optim.sgd(lr=0.1, momentum=0.9)
    pstep = fddp.data_parallel(sgd_step(loss_fn, opt))
    out = {}

    same = fddp.state(mse_setup(seed=0)[0])[0]
    if r == 1:
        same = {**same, "2.weight": same["2.weight"] + 1e-3}
    x, y = local_batch(0, 4)
    try:
        pstep(same, opt.init(same), x, y)
        out["mismatch"] = None
    except ReplicaMismatchError as e:
        out["mismatch"] = str(e)

    params = fddp.replicate(fddp.state(model)[0])
    ddp = DistributedDataParallel(copy.deepcopy(model))  # broadcasts rank 0's at construction
    out["replicated"] = detached(params)
    out["ddp_initial"] = detached(named_params(ddp.module))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = opt.init(params)
    out["params"], out["ddp_params"] = [], []
    for s in range(4):
        x, y = local_batch(s, 4)
        params, state, _ = pstep(params, state, x, y)
        ddp_train_step(ddp, torch_opt, x, y)
        out["params"].append(detached(params))
        out["ddp_params"].append(detached(named_params(ddp.module)))
    return out


# --- buffers: broadcast or mean, and synchronised BatchNorm --------------------------------------


def _bn_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def _bn_loss(apply):
    def loss_fn(params, buffers, x, y):
        out, new_buffers = apply(params, buffers, x)
        return F.mse_loss(out, y), new_buffers

    return loss_fn


def _bn_step(loss_fn, opt, reduce, buffer_sync):
    def step(params, opt_state, buffers, x, y):
        (_, new_buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = opt.update(reduce(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, buffer_sync(new_buffers)

    return step


def _floats(buffers: dict) -> dict:
    return {k: v for k, v in buffers.items() if v.is_floating_point()}


@two_rank_check("buffers")
def _check_buffers(steps: int = 4) -> dict:
    """fddp's two buffer choices against DDP's broadcast_buffers=True and =False."""
    model = _bn_mlp()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    loss_fn = _bn_loss(fddp.functional(model, return_buffers=True))
    out = {}
    for how, broadcast_buffers in (("broadcast", True), ("mean", False)):
        ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=broadcast_buffers)
        torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        params, buffers = fddp.state(model)
        state = opt.init(params)
        pstep = fddp.data_parallel(
            _bn_step(loss_fn, opt, fddp.pmean, functools.partial(sync_buffers, how=how))
        )
        run = {"params": [], "ddp_params": [], "buffers": [], "ddp_buffers": [], "counts": []}
        for s in range(steps):
            x, y = local_batch(s, 4)
            params, state, buffers = pstep(params, state, buffers, x, y)
            ddp_train_step(ddp, torch_opt, x, y)
            ddp_buffers = _floats(dict(ddp.module.named_buffers()))
            # broadcast_buffers=True: DDP broadcasts rank 0's buffers before each forward, so
            # rank 0's are the ones every rank trains with. False: DDP keeps per-rank buffers,
            # whose mean follows the same linear update as fddp's averaged ones.
            reference = from_rank0(ddp_buffers) if how == "broadcast" else fddp.pmean(ddp_buffers)
            run["params"].append(detached(params))
            run["ddp_params"].append(detached(named_params(ddp.module)))
            run["buffers"].append(detached(_floats(buffers)))
            run["ddp_buffers"].append(detached(reference))
            run["counts"].append(int(buffers["1.num_batches_tracked"]))
        out[how] = run
    return out


@two_rank_check("sync_batchnorm")
def _check_sync_batchnorm(steps: int = 4) -> dict:
    """convert_sync_batchnorm under data_parallel against BatchNorm on the global batch."""
    base = _bn_mlp()
    synced = convert_sync_batchnorm(base)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params, buffers = fddp.state(synced)
    state = opt.init(params)
    pstep = fddp.data_parallel(
        _bn_step(
            _bn_loss(fddp.functional(synced, return_buffers=True)), opt, fddp.pmean, lambda b: b
        )
    )
    ref_step = _bn_step(
        _bn_loss(fddp.functional(base, return_buffers=True)), opt, lambda t: t, lambda b: b
    )
    ref_params, ref_buffers, ref_state = params, buffers, state
    out = {"params": [], "ref_params": [], "buffers": [], "ref_buffers": []}
    for s in range(steps):
        x, y = full_batch(s, 8)
        params, state, buffers = pstep(params, state, buffers, fddp.shard(x), fddp.shard(y))
        ref_params, ref_state, ref_buffers = ref_step(ref_params, ref_state, ref_buffers, x, y)
        out["params"].append(detached(params))
        out["ref_params"].append(detached(ref_params))
        out["buffers"].append(detached(buffers))
        out["ref_buffers"].append(detached(ref_buffers))
    x = full_batch(99, 6)[0]
    synced.eval(), base.eval()
    out["eval"] = fddp.functional(synced)(params, buffers, x)
    out["ref_eval"] = fddp.functional(base)(ref_params, ref_buffers, x)
    synced.train(), base.train()
    return out


# --- the 2-rank tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return two_rank_runs()


def test_data_parallel_refuses_replicas_that_differ_naming_the_leaf(runs):
    for message in runs["replicas"]:
        assert message["mismatch"] is not None, "differing parameters were not detected"
        assert "['2.weight']" in message["mismatch"] and "fddp.replicate" in message["mismatch"]


def test_replicate_gives_rank0_values_like_ddp_and_trains_like_ddp(runs):
    results = runs["replicas"]
    for r in results:
        assert_trees_equal(r["replicated"], results[0]["replicated"], "replicated params")
        assert_trees_equal(r["replicated"], r["ddp_initial"], "replicated vs DDP's initial")
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what="params vs DDP")


@pytest.mark.parametrize(
    "how",
    ["broadcast", "mean"],
)
def test_buffers_broadcast_or_mean_match_ddp(runs, how):
    results = [r[how] for r in runs["buffers"]]
    for r in results:
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what=f"{how}: params vs DDP")
        assert_trees_close(r["buffers"], r["ddp_buffers"], **TOL, what=f"{how}: buffers vs DDP")
        assert r["counts"] == list(range(1, len(r["counts"]) + 1))
    assert_ranks_equal([r["buffers"] for r in results], f"{how}: buffers")


def test_buffer_choices_differ_so_the_tests_can_tell_them_apart(runs):
    (r0, *_) = runs["buffers"]
    assert max_abs_diff(r0["broadcast"]["buffers"][-1], r0["mean"]["buffers"][-1]) > 1e-3


def test_sync_batchnorm_matches_batchnorm_on_the_global_batch(runs):
    results = runs["sync_batchnorm"]
    for r in results:
        assert_trees_close(r["params"], r["ref_params"], **TOL, what="params vs global batch")
        assert_trees_close(r["buffers"], r["ref_buffers"], **TOL, what="buffers vs global batch")
        assert_trees_close(r["eval"], r["ref_eval"], **TOL, what="eval outputs")
    assert_ranks_equal([r["params"] for r in results], "sync batchnorm params")


# --- a world of one: the helpers on their own ----------------------------------------------------


def test_sync_batch_norm_under_vmap_is_batchnorm_over_all_replicas_with_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 4, generator=g) * 2 + 1  # 2 replicas of 5 rows
    w, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    mean, var = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5

    def synced(w, b, x):
        out, m, v = sync_batch_norm(x, mean, var, w, b, momentum=0.3)
        return (out**3).sum(), (m, v)

    def replica(x):
        (gw, gb, gx), stats = fddp.grad(synced, argnums=(0, 1, 2), has_aux=True)(w, b, x)
        return fddp.psum((gw, gb)), gx, stats

    (gw, gb), gx, (m, v) = fddp.vmap(replica)(x)

    def single(w, b, x):
        m, v = mean.clone(), var.clone()
        out = F.batch_norm(x, m, v, w, b, True, 0.3, 1e-5)
        return (out**3).sum(), (m, v)

    (rw, rb, rx), (rm, rv) = fddp.grad(single, argnums=(0, 1, 2), has_aux=True)(
        w, b, x.reshape(10, 3, 4)
    )
    torch.testing.assert_close(gw[0], rw, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gb[0], rb)
    torch.testing.assert_close(gx.reshape(10, 3, 4), rx, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(m[0], rm)
    torch.testing.assert_close(v[0], rv)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_converted_model_in_one_process_is_the_original(momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())
    synced = convert_sync_batchnorm(model)
    assert isinstance(synced[1], SyncBatchNorm) and isinstance(model[1], nn.BatchNorm2d)
    params, buffers = fddp.state(model)
    assert (sorted(params), sorted(buffers)) == tuple(sorted(d) for d in fddp.state(synced))
    x = torch.randn(6, 3, 5, 5)
    sbuffers = buffers
    for _ in range(2):
        out, buffers = fddp.functional(model, return_buffers=True)(params, buffers, x)
        sout, sbuffers = fddp.functional(synced, return_buffers=True)(params, sbuffers, x)
    torch.testing.assert_close(sout, out)
    assert_trees_close(sbuffers, buffers, what="synced buffers")
    model.eval(), synced.eval()
    torch.testing.assert_close(
        fddp.functional(synced)(params, buffers, x), fddp.functional(model)(params, buffers, x)
    )


def test_sync_buffers_rejects_an_unknown_choice():
    with pytest.raises(ValueError, match="'mean' or 'broadcast'"):
        sync_buffers({"running_mean": torch.zeros(2)}, "average")
