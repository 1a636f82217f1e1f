"""DDP parity: communication compression and mixed precision.

``comm_dtype=bfloat16/float16`` against DDP's ``bf16_compress_hook``/``fp16_compress_hook``,
``fddp.powersgd`` against DDP's ``powerSGD_hook`` (same rank, start iteration, epsilon and, for
the exact comparison, initial Q), and ``mixed_precision`` (bf16 compute, fp32 master parameters,
gradients and all-reduce) against the same casts in one process. The 2-rank checks run in the
one spawn of tests/_parity.py; the helpers themselves are also checked in a world of one.
"""

from __future__ import annotations

import copy

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_ranks_equal, assert_trees_close, detached, max_abs_diff
from _parity import (
    TOL,
    ddp_train_step,
    full_batch,
    local_batch,
    mse_setup,
    named_params,
    sgd_step,
    two_rank_check,
    two_rank_runs,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd
from torch.nn.parallel import DistributedDataParallel

import fddp
import fddp.optim as optim
from fddp import accumulate_gradients
from fddp.nn import cast_floating, mixed_precision
from fddp.typing import PowerSGDState

PSGD_SIZES = (32, 64, 64, 8)
PSGD_RANK = 2
PSGD_START = 3
PSGD_STEPS = 12
PSGD_EPSILON = 1e-8
PSGD_LOSS_RTOL = 1e-4  # same initial Q as DDP: the trajectories agree to float rounding
PSGD_OWN_SEED_LOSS_RTOL = 0.1  # fddp's own initial Q: another projection, a loss within 10 %
BYTES_RATIO_MIN = 5.0


# --- communication hooks: bf16/fp16 and PowerSGD -------------------------------------------------


@two_rank_check("low_precision_comm")
def _check_low_precision_comm(steps: int = 5) -> dict:
    model, loss_fn = mse_setup()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    out = {}
    for dtype, hook in (
        (torch.bfloat16, default_hooks.bf16_compress_hook),
        (torch.float16, default_hooks.fp16_compress_hook),
    ):
        ddp = DistributedDataParallel(copy.deepcopy(model))
        # DDP refuses a hook *named* bf16_compress_hook without NCCL; gloo reduces bf16 fine
        ddp.register_comm_hook(hook, _call_hook)
        torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        pstep = fddp.data_parallel(sgd_step(loss_fn, opt), comm_dtype=dtype)
        params = fddp.state(model)[0]
        state = opt.init(params)
        run = {"params": [], "ddp_params": []}
        for s in range(steps):
            x, y = local_batch(s, 4)
            params, state, _ = pstep(params, state, x, y)
            ddp_train_step(ddp, torch_opt, x, y)
            run["params"].append(detached(params))
            run["ddp_params"].append(detached(named_params(ddp.module)))
        x, y = local_batch(0, 4)
        run["wire"] = {c.dtype for c in pstep.schedule(params, state, x, y).collectives}
        out[str(dtype)] = run
    return out


def _call_hook(hook, bucket):
    return hook(None, bucket)


def _ddp_initial_qs(params: dict, bucket_shapes: list[tuple[int, ...]]) -> dict:
    """The Q factors DDP's powerSGD_hook draws for a single bucket, keyed like fddp's state.

    The hook seeds torch with ``RandomState(random_seed).randint(1e9)`` and draws one
    ``randn(1, m, r)`` per distinct compressed shape, in bucket order.
    """
    seed = np.random.RandomState(0).randint(1_000_000_000)
    shapes = []
    for shape in bucket_shapes:
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, PSGD_RANK)
        if len(shape) > 1 and ddp_powersgd._should_compress(n, m, r, 2)[0] and shape not in shapes:
            shapes.append(shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draws = {shape: torch.randn(1, int(np.prod(shape[1:])), PSGD_RANK)[0] for shape in shapes}
    return {f"[{k!r}]": draws[tuple(v.shape)] for k, v in params.items() if tuple(v.shape) in draws}


@two_rank_check("powersgd")
def _check_powersgd() -> dict:
    """fddp.powersgd against DDP's powerSGD_hook: same rank, start iteration and epsilon."""
    model, loss_fn = mse_setup(PSGD_SIZES)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_state = ddp_powersgd.PowerSGDState(
        None,
        matrix_approximation_rank=PSGD_RANK,
        start_powerSGD_iter=PSGD_START,
        orthogonalization_epsilon=PSGD_EPSILON,
    )
    bucket_shapes: list[tuple[int, ...]] = []

    def hook(state, bucket):
        if state.iter == PSGD_START and bucket.index() == 0 and not bucket_shapes:
            bucket_shapes.extend(tuple(g.shape) for g in bucket.gradients())
        return ddp_powersgd.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(ddp_state, hook)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp_losses = []
    for s in range(PSGD_STEPS):
        ddp_losses.append(ddp_train_step(ddp, torch_opt, *local_batch(s, 8, PSGD_SIZES)))

    dense = fddp.data_parallel(sgd_step(loss_fn, opt))
    psgd = fddp.powersgd(approximation_rank=PSGD_RANK, epsilon=PSGD_EPSILON)

    @fddp.data_parallel
    def compressed(params, opt_state, comm_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        grads, comm_state = psgd.update(grads, comm_state)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, comm_state, fddp.pmean(loss)

    def train(comm_state: PowerSGDState) -> tuple[dict, list[float], list[int]]:
        params = fddp.state(model)[0]
        state, losses, nbytes = opt.init(params), [], []
        for s in range(PSGD_STEPS):
            x, y = local_batch(s, 8, PSGD_SIZES)
            if s < PSGD_START:  # DDP's start_powerSGD_iter: plain all-reduce first
                nbytes.append(
                    sum(c.nbytes for c in dense.schedule(params, state, x, y).collectives)
                )
                params, state, loss = dense(params, state, x, y)
            else:
                plan = compressed.schedule(params, state, comm_state, x, y)
                nbytes.append(sum(c.nbytes for c in plan.collectives))
                params, state, comm_state, loss = compressed(params, state, comm_state, x, y)
            losses.append(loss.item())
        return params, losses, nbytes

    params = fddp.state(model)[0]
    own = psgd.init(params)
    same_q = own._replace(qs={**own.qs, **_ddp_initial_qs(params, bucket_shapes)})
    final, losses, nbytes = train(same_q)
    _, own_losses, _ = train(own)
    before, after = ddp_state.compression_stats()[1:]
    return {
        "params": detached(final),
        "ddp_params": detached(named_params(ddp.module)),
        "loss": losses,
        "ddp_loss": ddp_losses,
        "own_seed_loss": own_losses,
        "compressed_leaves": sorted(same_q.qs),
        "bytes": nbytes,
        "ddp_ratio": before / after,
    }


# --- mixed precision -----------------------------------------------------------------------------


@two_rank_check("mixed_precision")
def _check_mixed_precision(steps: int = 4) -> dict:
    """bf16 compute, fp32 master params, grads and all-reduce; against the same casts locally."""
    model, loss_fn = mse_setup()
    low = mixed_precision(loss_fn, torch.bfloat16)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.state(model)[0]
    state = opt.init(params)
    pstep = fddp.data_parallel(sgd_step(low, opt))
    # one process, the same casts on each rank's half, the halves' gradients averaged in fp32
    accumulated = accumulate_gradients(low, fddp.world_size(), batch_argnums=(1, 2))

    def split(params, opt_state, x, y):
        loss, grads = accumulated(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    full32 = sgd_step(loss_fn, opt, lambda t: t)
    ref, ref_state, ref32, ref32_state = params, state, params, state
    out = {"params": [], "ref_params": [], "fp32_params": []}
    for s in range(steps):
        x, y = full_batch(s, 8)
        params, state, _ = pstep(params, state, fddp.shard(x), fddp.shard(y))
        ref, ref_state, _ = split(ref, ref_state, x, y)
        ref32, ref32_state, _ = full32(ref32, ref32_state, x, y)
        out["params"].append(detached(params))
        out["ref_params"].append(detached(ref))
        out["fp32_params"].append(detached(ref32))
    x, y = local_batch(0, 4)
    out["param_dtypes"] = {str(v.dtype) for v in params.values()}
    out["grad_dtypes"] = {str(g.dtype) for g in fddp.grad(low)(params, x, y).values()}
    out["wire"] = {c.dtype for c in pstep.schedule(params, state, x, y).collectives}
    return out


# --- the 2-rank tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return two_rank_runs()


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_comm_dtype_matches_ddp_compress_hook(runs, dtype):
    for r in runs["low_precision_comm"]:
        run = r[dtype]
        assert run["wire"] == {dtype.removeprefix("torch.")}
        assert_trees_close(run["params"], run["ddp_params"], **TOL, what=f"{dtype} vs DDP hook")


def test_powersgd_matches_ddp_powersgd_hook_and_sends_fewer_bytes(runs):
    results = runs["powersgd"]
    for r in results:
        assert_trees_close(r["params"], r["ddp_params"], **TOL, what="params vs DDP")
        assert_trees_close(r["loss"], r["ddp_loss"], rtol=PSGD_LOSS_RTOL, atol=0, what="losses")
        own, ddp = r["own_seed_loss"][-1], r["ddp_loss"][-1]
        assert abs(own - ddp) <= PSGD_OWN_SEED_LOSS_RTOL * ddp
        assert r["compressed_leaves"] == ["['0.weight']", "['2.weight']", "['4.weight']"]
        dense, compressed = r["bytes"][0], r["bytes"][-1]
        ratio = (dense - 4) / (compressed - 4)  # less the 4-byte loss riding along
        assert ratio > BYTES_RATIO_MIN
        assert ratio == pytest.approx(r["ddp_ratio"], rel=1e-3)
        print(f"PowerSGD rank {PSGD_RANK}: {dense} -> {compressed} bytes/step, {ratio:.2f}x")
    assert_ranks_equal([r["params"] for r in results], "powersgd params")


def test_mixed_precision_keeps_fp32_master_params_and_matches_the_same_casts(runs):
    for r in runs["mixed_precision"]:
        assert r["param_dtypes"] == {"torch.float32"} and r["grad_dtypes"] == {"torch.float32"}
        assert r["wire"] == {"float32"}
        assert_trees_close(r["params"], r["ref_params"], **TOL, what="bf16 vs same casts")
        assert_trees_close(r["params"], r["fp32_params"], rtol=0, atol=2e-3, what="bf16 vs fp32")
        assert max_abs_diff(r["params"][-1], r["params"][0]) > 0.05  # it trains
        assert max_abs_diff(r["params"][-1], r["fp32_params"][-1]) > 0  # it did compute in bf16


# --- a world of one: the helpers on their own ----------------------------------------------------


def test_powersgd_error_feedback_keeps_the_mean_and_exact_low_rank_gradients():
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(3, 16, 12, generator=g), "b": torch.randn(3, 16, generator=g)}
    psgd = fddp.powersgd(approximation_rank=2)
    state = psgd.init({"w": grads["w"][0], "b": grads["b"][0]})
    assert list(state.qs) == ["['w']"]
    states = optree.tree_map(lambda t: t.expand(3, *t.shape), state)
    mean, new = fddp.vmap(psgd.update)(grads, states)
    torch.testing.assert_close(mean["b"], grads["b"].mean(0).expand(3, 16))
    # what was not transmitted stays in the errors: mean(approximation + error) = mean(grads)
    torch.testing.assert_close(
        mean["w"][0] + new.errors["['w']"].mean(0), grads["w"].mean(0), rtol=1e-5, atol=1e-5
    )
    # a gradient of rank 2, the same on every replica, comes through exactly
    factors = torch.randn(16, 2, generator=g), torch.randn(12, 2, generator=g)
    low = {"w": factors[0] @ factors[1].T, "b": torch.zeros(16)}
    out, _ = psgd.update(low, state)
    torch.testing.assert_close(out["w"], low["w"], rtol=1e-5, atol=1e-4)


def test_powersgd_explains_a_state_for_other_parameters():
    psgd = fddp.powersgd()
    state = psgd.init({"w": torch.zeros(16, 12)})
    with pytest.raises(ValueError, match=r"powersgd\(...\).init"):
        psgd.update({"w": torch.zeros(12, 16)}, state)
    with pytest.raises(ValueError, match="lacks"):
        psgd.update({"v": torch.zeros(16, 12)}, state)


def test_mixed_precision_casts_floats_only_and_returns_fp32_grads():
    tree = cast_floating({"w": torch.ones(2), "ids": torch.arange(2), "n": 3}, torch.bfloat16)
    assert (tree["w"].dtype, tree["ids"].dtype, tree["n"]) == (torch.bfloat16, torch.int64, 3)
    seen = []

    def loss_fn(w, x, labels):
        seen.append((w.dtype, x.dtype, labels.dtype))
        return F.cross_entropy(x @ w, labels)

    w = torch.randn(4, 3)
    loss, g = fddp.value_and_grad(mixed_precision(loss_fn))(
        w, torch.randn(5, 4), torch.zeros(5, dtype=torch.long)
    )
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.int64)]
    assert loss.dtype == g.dtype == torch.float32
