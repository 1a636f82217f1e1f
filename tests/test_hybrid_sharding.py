"""Hybrid sharding (HSDP) on a 2 x 2 mesh of gloo ranks: parameters and optimizer state sharded
within each pair of ranks ("shard": {0, 1} and {2, 3}) and replicated across the pairs
("replicate": {0, 2} and {1, 3}); gradients reduce-scattered within a pair, then their shards
all-reduced across pairs. Training equals the replicated step on the global batch of all four.
"""

from __future__ import annotations

import functools

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks
from _models import mlp, next_token_loss, regression_batch, tiny_decoder, token_batch

import fddp
import fddp.optim as optim

STEPS = 12
TINY = 200 / 2**20  # 200-byte buckets: several per model, uneven over 2 ranks


def _mesh():
    """This rank's shard group (its pair) and replicate group (its peer in the other pair)."""
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    peers = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return pairs[rank // 2], peers[rank % 2]


def _model(name):
    if name == "mlp":
        model = mlp((6, 9, 9, 5))
        apply = fddp.functional(model)

        def loss_fn(p, x, y):
            return F.mse_loss(apply(p, {}, x), y)

        def data(i):
            batch = regression_batch(i, 16, 6, 5)
            return batch["x"], batch["y"]

        return model, loss_fn, data
    model = tiny_decoder(layers=2)  # tied weights
    apply = fddp.functional(model)

    def gpt_loss(p, ids, _):
        return next_token_loss(apply(p, {}, ids), ids)

    return model, gpt_loss, lambda i: (token_batch(i, 8), torch.zeros(8))


def _train(name, mode, steps=STEPS, lr=1e-2):
    """``mode``: "hybrid" (HSDP); "nested" (replicated, gradients averaged over the pair,
    then across pairs: the same sums in the same order, so equal to rounding); "plain"
    (replicated, one average over all four: sums in another order)."""
    model, loss_fn, data = _model(name)
    params, _ = fddp.state(model)
    inner = optim.adamw(lr, weight_decay=0.1)
    shard, replicate = _mesh()
    axes = {"shard": shard, "replicate": replicate} if mode != "plain" else None
    if mode == "hybrid":
        opt = optim.shard_state(
            inner, axis_name="shard", replicate_axis="replicate", bucket_cap_mb=TINY
        )
    else:
        opt = inner

    def mean(g):
        if mode == "nested":
            return fddp.pmean(fddp.pmean(g, "shard"), "replicate")
        return g if mode == "hybrid" else fddp.pmean(g)

    @functools.partial(fddp.data_parallel, axes=axes)
    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(mean(g), s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    state = fddp.data_parallel(opt.init, trace=False, axes=axes)(params)
    if mode == "hybrid":
        params = fddp.shard_params(params, "shard", bucket_cap_mb=TINY, group=shard)
    losses = []
    for i in range(steps):
        x, y = (t.chunk(4)[dist.get_rank()] for t in data(i))
        params, state, loss = step(params, state, x, y)
        losses.append(loss)
    inner_state = state.inner if mode == "hybrid" else state  # without the shards' offsets
    out = {"losses": torch.stack(losses), "state bytes": optim.state_bytes(inner_state)}
    if mode == "hybrid":
        out["param bytes"] = sum(x.numel() * x.element_size() for x in params.shards)
        out["buckets"] = len(params.shards)
        params = fddp.full_params(params, "shard", group=shard)
    out["params"] = optree.tree_map(torch.Tensor.clone, params)
    return out


def check(name):
    return {mode: _train(name, mode) for mode in ("hybrid", "nested", "plain")}


@pytest.fixture(scope="module")
def runs():
    return run_checks({n: functools.partial(check, n) for n in ("mlp", "gpt")}, 4, timeout=420)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hybrid_sharding_equals_the_replicated_step(runs, name):
    for out in runs[name]:
        want, got = out["nested"], out["hybrid"]
        assert_trees_close(got["params"], want["params"], rtol=1e-6, atol=1e-6)
        assert_trees_close(got["losses"], want["losses"], rtol=1e-6, atol=1e-6)
        # one mean over all four ranks: the same training up to the order of the sums
        assert_trees_close(got["losses"], out["plain"]["losses"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hybrid_sharding_keeps_half_on_each_rank(runs, name):
    """Parameters and optimizer state: half of the whole on each rank (sharded over 2, padded
    to a multiple of 2 per bucket)."""
    for out in runs[name]:
        hybrid = out["hybrid"]
        full = sum(x.numel() * x.element_size() for x in out["plain"]["params"].values())
        assert full <= 2 * hybrid["param bytes"] <= full + 2 * 4 * hybrid["buckets"]
        state = out["plain"]["state bytes"]  # AdamW: two moments and a count
        assert state <= 2 * hybrid["state bytes"] <= state + 2 * 4 * 2 * hybrid["buckets"] + 8
