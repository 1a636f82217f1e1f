"""Compositions with torch.compile: around a data_parallel step (the step runs as one opaque call
inside the compiled region) and fddp's transforms inside a user's torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from _dist import run_checks

import fddp
import fddp.optim as optim


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.1, momentum=0.9)

    def loss_fn(p, b, batch):
        return F.cross_entropy(apply(p, b, batch["x"]), batch["y"])

    def step(p, s, b, batch):
        loss, g = fddp.value_and_grad(loss_fn)(p, b, batch)
        updates, s = opt.update(fddp.pmean(g), s, p)
        return optim.apply_updates(p, updates), s, fddp.pmean(loss)

    g = torch.Generator().manual_seed(1)
    batches = [
        fddp.shard(
            {"x": torch.randn(8, 8, generator=g), "y": torch.randint(0, 4, (8,), generator=g)}
        )
        for _ in range(3)
    ]
    return fddp.data_parallel(step), params, opt.init(params), buffers, batches


def _compiled_around_the_step():
    pstep, params, opt_state, buffers, batches = _setup()

    def loop(p, s):
        for batch in batches:
            p, s, loss = pstep(p, s, buffers, batch)
        return p, s, loss

    direct = loop(params, opt_state)
    compiled_loop = torch.compile(loop)(params, opt_state)
    compiled_step = torch.compile(pstep)
    p, s = params, opt_state
    for batch in batches:
        p, s, loss = compiled_step(p, s, buffers, batch)
    return direct[0], compiled_loop[0], p, (direct[2], compiled_loop[2], loss)


@pytest.fixture(scope="module")
def runs():
    checks = {
        "around_the_step": _compiled_around_the_step,
        "scatter_gather_sync_bn": _scatter_gather_and_sync_bn_compiled,
    }
    return run_checks(checks, 2, timeout=180)


def test_torch_compile_around_a_data_parallel_step_equals_calling_it(runs):
    for direct, loop, step, losses in runs["around_the_step"]:
        assert_trees_equal(loop, direct, "a compiled loop of steps")
        assert_trees_equal(step, direct, "a compiled step")
        assert_trees_equal(losses[1], losses[0], "the compiled loop's loss")
        assert_trees_equal(losses[2], losses[0], "the compiled step's loss")


def test_fddp_grad_optim_and_pmean_inside_a_users_fullgraph_compile_equal_eager():
    opt = optim.adamw(lr=0.1)

    def f(params, opt_state, x):
        loss, grads = fddp.value_and_grad(lambda p: torch.tanh(x @ p["w"]).pow(2).sum())(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    params, x = {"w": torch.randn(4, 3)}, torch.randn(5, 4)
    eager = f(params, opt.init(params), x)
    compiled = torch.compile(f, fullgraph=True)(params, opt.init(params), x)
    assert_trees_close(compiled[2], eager[2], what="loss")
    assert_trees_close(compiled[0], eager[0], what="params")


def _scatter_gather_and_sync_bn_compiled():
    from fddp.nn import sync_batch_norm

    rank = torch.distributed.get_rank()

    def collectives(x):
        return fddp.all_gather(fddp.psum_scatter(x, tiled=True), tiled=True)

    def bn_loss(w, b, x):
        return sync_batch_norm(x, None, None, w, b, training=True)[0].pow(3).sum()

    x = torch.arange(8.0) * (rank + 1)
    bn_grad = torch.func.grad(bn_loss, argnums=(0, 1))
    w, b, images = (
        torch.ones(3),
        torch.zeros(3),
        torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(rank)),
    )
    return (
        collectives(x),
        torch.compile(collectives, fullgraph=True)(x),
        bn_grad(w, b, images),
        torch.compile(bn_grad, fullgraph=True)(w, b, images),
    )


def test_scatter_gather_and_sync_batch_norm_inside_a_users_fullgraph_compile_on_two_ranks(runs):
    """On gloo these collectives are all-to-alls chosen from the axis, not from a group lookup
    Dynamo cannot trace."""
    for eager, compiled, bn_eager, bn_compiled in runs["scatter_gather_sync_bn"]:
        assert_trees_equal(eager, 3 * torch.arange(8.0), "all_gather(psum_scatter(x))")
        assert_trees_equal(compiled, eager, "compiled")
        assert_trees_close(bn_compiled, bn_eager, rtol=1e-4, atol=1e-4, what="sync BN grads")
