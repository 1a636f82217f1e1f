"""Fully sharded parameters composed with the rest of fddp: each option changes nothing but
where the parameters live, so every run equals the replicated step (``shard_state``) with the
same option on the same global batch.

Covered here: ``overlap_steps=True``, ``compile=True`` (Inductor), ``fddp.nn.mixed_precision``,
``apply_if_finite`` (a step with a non-finite gradient is skipped on every rank),
``donate_argnums`` and a step that only Dynamo can capture, on 2 gloo ranks in one spawn; and
simulated replicas (``fddp.vmap``) in this process.
"""

from __future__ import annotations

import functools
import math

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks
from _models import mlp, next_token_loss, regression_batch, tiny_decoder, token_batch

import fddp
import fddp.optim as optim

STEPS = 8
TINY = 200 / 2**20  # 200-byte buckets: several per model, uneven over 2 ranks


def _only_dynamo_can_trace(x):
    """A branch on a tensor's value outside Dynamo (as Hugging Face's mask code has): make_fx
    stops there, so data_parallel captures the step with Dynamo."""
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):
        raise AssertionError("unreachable")


def _mlp(precision=None, dynamo=False):
    model = mlp((6, 9, 9, 5))
    apply = fddp.functional(model)

    def loss_fn(p, x, y):
        if dynamo:
            _only_dynamo_can_trace(x)
        return F.mse_loss(apply(p, {}, x), y)

    if precision is not None:
        loss_fn = fddp.nn.mixed_precision(loss_fn, precision)
    return model, loss_fn, lambda i: _halves(regression_batch(i, 8, 6, 5))


def _gpt(precision=None):
    model = tiny_decoder(layers=2)  # tied weights: the output layer is the token embedding
    apply = fddp.functional(model)

    def loss_fn(p, ids, _):
        return next_token_loss(apply(p, {}, ids), ids)

    if precision is not None:
        loss_fn = fddp.nn.mixed_precision(loss_fn, precision)
    return model, loss_fn, lambda i: (_half(token_batch(i, 8)), None)


def _half(x):
    r = torch.distributed.get_rank()
    return x.chunk(2)[r]


def _halves(batch):
    return _half(batch["x"]), _half(batch["y"])


def _nan_at(i, batch):
    """Step 3's batch holds a NaN on rank 1 only: apply_if_finite must skip it everywhere."""
    x, y = batch
    if i == 3 and torch.distributed.get_rank() == 1 and x.is_floating_point():
        x = x.clone()
        x.view(-1)[0] = math.nan
    return x, y


def _train(model_name, full, *, precision=None, guard=False, steps=STEPS, **options):
    if model_name == "gpt":
        model, loss_fn, data = _gpt(precision)
    else:
        model, loss_fn, data = _mlp(precision, dynamo=model_name == "dynamo mlp")
    params, _ = fddp.state(model)
    inner = optim.adamw(1e-2, weight_decay=0.1)
    if guard:
        inner = optim.apply_if_finite(inner, max_consecutive_errors=5)
    opt = optim.shard_state(inner, bucket_cap_mb=TINY)

    @functools.partial(fddp.data_parallel, **options)
    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    state = fddp.data_parallel(opt.init, trace=False)(params)
    if full:
        params = fddp.shard_params(params, bucket_cap_mb=TINY)
    losses = []
    for i in range(steps):
        batch = data(i)
        if guard:
            batch = _nan_at(i, batch)
        params, state, loss = step(params, state, *batch)
        losses.append(loss)
    plan = step.schedule(params, state, *batch)
    if full:  # the gathers are in the schedule, and so is the deferred tail
        assert any(c.gather for c in plan.collectives), plan
        assert bool(plan.across_steps) == options.get("overlap_steps", False), plan
        assert plan.captured_with.startswith("dynamo") == (model_name == "dynamo mlp"), plan
        # Inductor moves waits: two gloo all-gathers at once corrupt its heap (a segfault)
        native = {c.kind for c in plan.collectives} & {"all_gather_into_tensor"}
        assert not (options.get("compile") and native), plan
    params = fddp.full_params(params) if full else params
    return optree.tree_map(torch.Tensor.clone, params), torch.stack(losses)


CASES = {
    "overlap_steps mlp": ("mlp", {"overlap_steps": True}),
    "overlap_steps gpt": ("gpt", {"overlap_steps": True}),
    "compile mlp": ("mlp", {"compile": True}),
    "mixed_precision mlp": ("mlp", {"precision": torch.bfloat16}),
    "mixed_precision gpt": ("gpt", {"precision": torch.bfloat16}),
    "apply_if_finite mlp": ("mlp", {"guard": True}),
    "donated gpt": ("gpt", {"donate_argnums": (0, 1)}),
    "dynamo capture mlp": ("dynamo mlp", {}),
}


def _check(case: str):
    model, options = CASES[case]
    return _train(model, False, **options), _train(model, True, **options)


def _rank0_only():
    model, _, _ = _gpt()
    params, _ = fddp.state(model)
    sharded = fddp.shard_params(params, bucket_cap_mb=TINY)
    return params, fddp.full_params(sharded, rank0_only=True), fddp.full_params(sharded)


@pytest.fixture(scope="module")
def runs():
    checks = {c: functools.partial(_check, c) for c in CASES}
    return run_checks({**checks, "rank0_only": _rank0_only}, 2, timeout=420)


def test_full_params_on_rank_0_only(runs):
    (params, on_root, everywhere), (_, on_other, everywhere_too) = runs["rank0_only"]
    assert_trees_close(on_root, params, rtol=0, atol=0)
    assert on_other is None
    assert_trees_close(everywhere, params, rtol=0, atol=0)
    assert_trees_close(everywhere_too, params, rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_fully_sharded_composes(runs, case):
    for (want, want_losses), (got, got_losses) in runs[case]:
        assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
        nan_safe = functools.partial(torch.nan_to_num, nan=-1.0)  # step 3's loss in the guard case
        assert_trees_close(nan_safe(got_losses), nan_safe(want_losses), rtol=1e-6, atol=1e-6)
        assert torch.isfinite(got_losses).sum() >= (STEPS - 1 if "finite" in case else STEPS)


def _simulated(full: bool, lr: float = 1e-2, replicas: int = 3):
    model, loss_fn, _ = _mlp()
    params, _ = fddp.state(model)
    opt = optim.shard_state(optim.adamw(lr, weight_decay=0.1), bucket_cap_mb=TINY)

    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    p = optree.tree_map(lambda x: x.expand(replicas, *x.shape).clone(), params)
    s = fddp.vmap(opt.init)(p)
    if full:
        p = fddp.vmap(functools.partial(fddp.shard_params, bucket_cap_mb=TINY))(p)
        total, kept = sum(x.numel() for x in params.values()), sum(x.shape[1] for x in p.shards)
        assert total <= kept * replicas < total + replicas * len(p.shards)  # 1/N each, + padding
    for i in range(STEPS):
        batch = regression_batch(i, 4 * replicas, 6, 5)
        x, y = batch["x"].view(replicas, 4, 6), batch["y"].view(replicas, 4, 5)
        p, s, loss = fddp.vmap(step)(p, s, x, y)
    return (fddp.vmap(fddp.full_params)(p) if full else p), loss


def test_simulated_replicas_fully_sharded_equal_the_replicated_step():
    """fddp.vmap: three simulated replicas, each holding its shards, train as three with full
    parameters (and as real ranks would: fddp.vmap's collectives are the ranks')."""
    (want, want_loss), (got, got_loss) = _simulated(False), _simulated(True)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert_trees_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
