"""Sharded optimizer state (fddp.optim.shard_state), psum_scatter and sharded checkpoints.

Every sharded run is checked against the same optimizer unsharded, on pmean-averaged
gradients: in simulated replicas (fddp.vmap) for the optimizer matrix, on 2 and 3 gloo ranks
(one spawn of 3, its ranks 0 and 1 forming the 2-rank group) for data_parallel and for
checkpoints saved on one world size and loaded on the other.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_checks
from _models import mlp, next_token_loss, regression_batch, tiny_decoder, token_batch

import fddp
import fddp.optim as optim

aten = torch.ops.aten
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default

STEPS = 8  # past the NaN at step 5; momentum and Adam moments carry over several steps
SAVE_AT = 4  # the checkpoint step: runs resume with STEPS - SAVE_AT steps to go
TOL = 1e-6
TINY_BUCKETS = 40 / 2**20  # 40 bytes: several buckets, most of them uneven over 2 and 3


def _optimizers() -> dict:
    return {
        "adam": optim.adam(1e-2),
        "adamw": optim.adamw(1e-2, weight_decay=0.1),
        "sgd_momentum": optim.sgd(0.05, momentum=0.9),
        "clip_adamw": optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2)),
        "finite_clip_adam": optim.apply_if_finite(
            optim.chain(optim.clip_by_global_norm(0.05), optim.adam(1e-2)), 3
        ),
    }


class TiedAutoencoder(torch.nn.Module):
    """Encoder and decoder share one weight (its transpose); 7*5 + 7 + 5 parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Linear(5, 7)
        self.dec_bias = torch.nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc(x)) @ self.enc.weight + self.dec_bias


def _regression(model: torch.nn.Module):
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def loss_fn(p, batch):
        return F.mse_loss(apply(p, buffers, batch["x"]), batch["y"])

    return params, loss_fn


def _replicated(tree, n):
    return {k: v.expand(n, *v.shape).clone() for k, v in tree.items()}


def _simulate(opt, sharded, params, loss_fn, batches, *, accumulate=1, wire=None):
    """Train ``len(batches)`` steps on ``n`` simulated replicas; batches are (n, rows, ...)."""
    n = batches[0]["x"].shape[0]
    if sharded:
        opt = optim.shard_state(opt, bucket_cap_mb=TINY_BUCKETS, comm_dtype=wire)
    grad_fn = (
        fddp.accumulate_gradients(loss_fn, accumulate)
        if accumulate > 1
        else fddp.value_and_grad(loss_fn)
    )

    def step(p, s, batch):
        loss, g = grad_fn(p, batch)
        if not sharded:
            if wire is not None:  # what comm_dtype does: divide, cast, sum in the wire dtype
                g = {k: fddp.psum((v / n).to(wire)).to(v.dtype) for k, v in g.items()}
            else:
                g = fddp.pmean(g)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    p = _replicated(params, n)
    s = fddp.vmap(opt.init)(p)
    for batch in batches:
        p, s, _ = fddp.vmap(step)(p, s, batch)
    return p, s


def _batches(n, rows=4, dim_in=5, dim_out=5, nan_at=None):
    out = []
    for i in range(STEPS):
        b = regression_batch(i, n * rows, dim_in, dim_out)
        b = {k: v.reshape(n, rows, -1) for k, v in b.items()}
        if nan_at == i:
            b["x"][n - 1, 0, 0] = float("nan")  # one replica's gradients only
        out.append(b)
    return out


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _without_key_bias(params):
    """The decoder's parameters but the attention key bias, whose gradient is exactly zero
    (softmax ignores a shift of every score): Adam turns its rounding noise (~1e-10) into
    full steps, so any change of summation order moves it, unsharded runs included."""
    dim = params["tok.weight"].shape[1]
    return {
        k: torch.cat([v[:dim], v[2 * dim :]]) if k.endswith("qkv.bias") else v
        for k, v in params.items()
    }


@pytest.mark.parametrize("name", list(_optimizers()))
@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_sharded_equals_unsharded_in_simulated_replicas(name, model):
    net = mlp((5, 7, 5)) if model == "mlp" else TiedAutoencoder()
    params, loss_fn = _regression(net)
    batches = _batches(3, nan_at=5 if name.startswith("finite") else None)
    opt = _optimizers()[name]
    want, _ = _simulate(opt, False, params, loss_fn, batches)
    got, state = _simulate(opt, True, params, loss_fn, batches)
    assert all(torch.isfinite(v).all() for v in want.values())
    assert _max_diff(want, got) < TOL
    assert _max_diff(_replicated(params, 3), got) > 1e-2  # it trained
    assert state.pieces.shape[1] >= 2  # several buckets


def test_clipping_and_skipping_decide_globally():
    """A NaN in one replica's gradients skips the step everywhere; clipping uses the global norm."""
    params, loss_fn = _regression(mlp((5, 7, 5)))
    batches = _batches(3, nan_at=0)[:1]
    opt = optim.apply_if_finite(optim.sgd(0.1), 3)
    got, state = _simulate(opt, True, params, loss_fn, batches)
    assert _max_diff(_replicated(params, 3), got) == 0
    assert state.inner.notfinite_count.tolist() == [1, 1, 1]
    clipped = optim.chain(optim.clip_by_global_norm(1e-3), optim.sgd(1.0))
    want, _ = _simulate(clipped, False, params, loss_fn, _batches(3)[:1])
    got, _ = _simulate(clipped, True, params, loss_fn, _batches(3)[:1])
    moved = torch.sqrt(sum(((got[k] - _replicated(params, 3)[k])[0] ** 2).sum() for k in got))
    assert abs(moved.item() - 1e-3) < 1e-6 and _max_diff(want, got) < TOL


def test_comm_dtype_and_accumulation():
    params, loss_fn = _regression(mlp((5, 7, 5)))
    batches = _batches(2, rows=6)
    opt = optim.adamw(1e-2)
    want, _ = _simulate(opt, False, params, loss_fn, batches, wire=torch.bfloat16)
    got, _ = _simulate(opt, True, params, loss_fn, batches, wire=torch.bfloat16)
    assert _max_diff(want, got) < TOL
    exact, _ = _simulate(opt, False, params, loss_fn, batches)
    assert _max_diff(exact, got) > 1e-5  # the bfloat16 wire did round the gradients
    want, _ = _simulate(opt, False, params, loss_fn, batches, accumulate=3)
    got, _ = _simulate(opt, True, params, loss_fn, batches, accumulate=3)
    assert _max_diff(want, got) < TOL


def test_state_bytes_shrink_by_the_number_of_replicas():
    params, _ = _regression(mlp((64, 129, 33)))  # 12,677 parameters: uneven over 4
    full = optim.state_bytes(optim.adam(0.1).init(params))
    opt = optim.shard_state(optim.adam(0.1), bucket_cap_mb=8 / 1024)
    state = fddp.vmap(opt.init)(_replicated(params, 4))
    per_replica = optim.state_bytes(state) / 4
    assert full / 4 <= per_replica < full / 4 * 1.01


def test_psum_scatter_matches_psum_and_differentiates():
    x = torch.arange(36.0).reshape(3, 6, 2)
    tiled = fddp.vmap(lambda x: fddp.psum_scatter(x, tiled=True))(x)
    assert torch.equal(tiled.reshape(6, 2), x.sum(0))
    gathered = fddp.vmap(lambda x: fddp.all_gather(fddp.psum_scatter(x, tiled=True), tiled=True))(x)
    assert torch.equal(gathered, fddp.vmap(fddp.psum)(x))
    stacked = fddp.vmap(fddp.psum_scatter)(x[:, :3])
    assert torch.equal(stacked, x[:, :3].sum(0))
    weights = torch.arange(1.0, 4.0)

    def loss(x):
        return (fddp.psum_scatter(x, tiled=True).sum() * (1 + fddp.axis_index())).sum()

    grad = fddp.vmap(torch.func.grad(loss))(x)
    assert torch.equal(grad, weights.repeat_interleave(2).reshape(1, 6, 1).expand(3, 6, 2))
    with pytest.raises(ValueError, match="multiple of 3"):
        fddp.vmap(lambda x: fddp.psum_scatter(x, tiled=True))(torch.ones(3, 4))
    with pytest.raises(TypeError, match=r"^shard_state: .*floating-point"):
        optim.shard_state(optim.sgd(0.1)).init({"n": torch.zeros(3, dtype=torch.int64)})


# ---- gloo ranks: one spawn of 3; ranks 0 and 1 also form a 2-rank group -------------------


def _mlp_setup():
    params, loss_fn = _regression(mlp((6, 9, 5)))  # 113 parameters: uneven over 2 and 3

    def data(step, rows):
        return regression_batch(step, rows, 6, 5)

    return params, loss_fn, data


def _gpt_setup():
    model = tiny_decoder(layers=1)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)  # the output layer's weight is the token embedding

    def loss_fn(p, ids):
        return next_token_loss(apply(p, buffers, ids), ids)

    return params, loss_fn, lambda step, rows: token_batch(step, rows)


def _train(
    group, setup, opt, sharded, *, steps, start=None, save_at=None, trace=False, compile=False
):
    """Steps on this group's ranks, each on its rows of one 12-row global batch."""
    params, loss_fn, data = setup()
    n, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    opt = optim.shard_state(opt, bucket_cap_mb=TINY_BUCKETS) if sharded else opt

    @functools.partial(fddp.data_parallel, group=group, trace=trace, compile=compile)
    def step(p, s, batch):
        loss, g = fddp.value_and_grad(loss_fn)(p, batch)
        u, s = opt.update(g if sharded else fddp.pmean(g), s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    def rows(i):
        return optree_map(lambda x: x.chunk(n)[r], data(i, 12))

    first = 0
    if start is not None:  # (path, step) of a checkpoint
        like = {"params": params, "opt": _init(opt, params, group)}
        loaded = fddp.load_sharded(start[0], like, group=group)
        params, state, first = loaded["params"], loaded["opt"], start[1]
    else:
        state = _init(opt, params, group)
    for i in range(first, steps):
        if save_at is not None and i == save_at[1]:
            fddp.save_sharded(save_at[0], {"params": params, "opt": state}, group=group)
        params, state, _ = step(params, state, rows(i))
    if trace and sharded:  # the replication analysis: the state is per rank, params are not
        plan = step.schedule(params, state, rows(0))
        how = dict(plan.replication)
        per_rank = {k for k, v in how.items() if v != "replicated"}
        assert len(per_rank) > 1 and all(k.startswith("[1]") for k in per_rank), how
        # gloo's own all-gather corrupts the heap when two overlap (torch 2.13), and its
        # reduce-scatter is slower than its all-reduce: both go through all_to_all_single
        kinds = {c.kind for c in plan.collectives}
        assert "all_to_all_single" in kinds and not kinds & {
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
        }, kinds
    if trace and sharded and not compile:  # Inductor plans its own concatenations
        # the gradient buckets are not concatenated: a weight's matmul writes into its slice
        graph = step.graph(params, state, rows(0)).graph
        sent = {n.args[0] for n in graph.nodes if n.target is ALL_TO_ALL}
        assert not any(x.target in (aten.cat.default, aten.constant_pad_nd.default) for x in sent)
        outs = [n.kwargs["out"] for n in graph.nodes if n.target is aten.mm.out]
        assert all(out.args[0] in sent for out in outs)  # as_strided(bucket)
        # ZeRO-2's memory bound: at most two reduce-scatters or all-gathers in flight
        in_flight, most = set(), 0
        for node in graph.nodes:
            if node.target is ALL_TO_ALL:
                in_flight.add(node)
            in_flight -= {a for a in node.all_input_nodes if node.target is WAIT}
            most = max(most, len(in_flight))
        assert most == 2, most
    return params, state


def optree_map(fn, tree):
    import optree

    return optree.tree_map(fn, tree)


def _init(opt, params, group):
    # init runs where the axis is bound: an eager data_parallel step binds it to the group
    return fddp.data_parallel(lambda p: opt.init(p), group=group, trace=False)(params)


@functools.cache
def _pair():
    """The group of ranks 0 and 1 (every rank creates it, once)."""
    return torch.distributed.new_group([0, 1])


def check_psum_scatter() -> float:
    rank = torch.distributed.get_rank()
    total = sum(torch.arange(12.0).reshape(6, 2) * (r + 1) for r in range(3))
    mine = fddp.psum_scatter(torch.arange(12.0).reshape(6, 2) * (rank + 1), tiled=True)
    stacked = fddp.psum_scatter(torch.arange(6.0).reshape(3, 2) * (rank + 1))
    x = torch.ones(6, requires_grad=True)
    (fddp.psum_scatter(x, tiled=True) * (rank + 1)).sum().backward()
    return max(
        (mine - total[2 * rank : 2 * rank + 2]).abs().max().item(),
        (stacked - 6 * torch.arange(6.0).reshape(3, 2)[rank]).abs().max().item(),
        (x.grad - torch.tensor([1.0, 1, 2, 2, 3, 3])).abs().max().item(),
    )


def check_sharded_equals_unsharded(world: str) -> dict | None:
    """Every model and optimizer, sharded against unsharded, on the world or the pair."""
    group = torch.distributed.group.WORLD if world == "3" else _pair()
    if world == "2" and torch.distributed.get_rank() >= 2:
        return None
    out = {}
    runs = [(model, name, False) for model in ("mlp", "gpt") for name in OPTIMIZERS]
    for model, name, trace in [*runs, ("gpt", "adamw", True)]:
        setup, opt = SETUPS[model], _optimizers()[name]
        want, _ = _train(group, setup, opt, False, steps=STEPS)
        got, _ = _train(group, setup, opt, True, steps=STEPS, trace=trace)
        if model == "gpt":
            want, got = _without_key_bias(want), _without_key_bias(got)
        out[f"{model} {name}{' traced' * trace}"] = _max_diff(want, got)
    params = _mlp_setup()[0]
    sharded = optim.shard_state(optim.adamw(0.1), bucket_cap_mb=TINY_BUCKETS)
    out["bytes"] = (
        optim.state_bytes(_init(sharded, params, group)),
        optim.state_bytes(optim.adamw(0.1).init(params)),
    )
    return out


def check_checkpoints_across_world_sizes(tmp: str) -> dict:
    """2 ranks save at step SAVE_AT, 3 load; 3 save, 2 load; both finish the STEPS."""
    dist = torch.distributed
    rank = dist.get_rank()
    pair = _pair()
    opt = _optimizers()["clip_adamw"]
    pair_dir, world_dir = os.path.join(tmp, "from2"), os.path.join(tmp, "from3")
    if rank < 2:
        _train(pair, _mlp_setup, opt, True, steps=SAVE_AT + 1, save_at=(pair_dir, SAVE_AT))
    _train(dist.group.WORLD, _mlp_setup, opt, True, steps=SAVE_AT + 1, save_at=(world_dir, SAVE_AT))
    dist.barrier()
    out = {}
    want3, _ = _train(dist.group.WORLD, _mlp_setup, opt, False, steps=STEPS)
    start = (pair_dir, SAVE_AT)
    got3, _ = _train(dist.group.WORLD, _mlp_setup, opt, True, steps=STEPS, start=start, trace=True)
    out["2->3"] = _max_diff(want3, got3)
    if rank < 2:
        want2, _ = _train(pair, _mlp_setup, opt, False, steps=STEPS)
        got2, _ = _train(pair, _mlp_setup, opt, True, steps=STEPS, start=(world_dir, SAVE_AT))
        out["3->2"] = _max_diff(want2, got2)
    return out


OPTIMIZERS = ("adam", "adamw", "sgd_momentum")
SETUPS = {"mlp": _mlp_setup, "gpt": _gpt_setup}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero"))
    checks = {
        "psum_scatter": check_psum_scatter,
        "world of 3": functools.partial(check_sharded_equals_unsharded, "3"),
        "world of 2": functools.partial(check_sharded_equals_unsharded, "2"),
        "checkpoints": functools.partial(check_checkpoints_across_world_sizes, tmp),
    }
    return run_checks(checks, 3, timeout=240)


def test_psum_scatter_on_three_gloo_ranks(three_ranks):
    for rank, diff in enumerate(three_ranks["psum_scatter"]):
        assert diff < TOL, (rank, diff)


@pytest.mark.parametrize("world", ["3", "2"])
def test_sharded_equals_unsharded_on_gloo_ranks(three_ranks, world):
    n = int(world)
    results = three_ranks[f"world of {world}"]
    assert [out is None for out in results] == [False, False, n == 2]
    for rank, out in enumerate(results[:n]):
        for key, value in out.items():
            if key == "bytes":
                sharded, full = value
                assert sharded < full / n * 1.1 + 400, (rank, key, value)
            else:
                assert value < TOL, (rank, key, value)
    print(results[0])


def test_checkpoints_saved_on_two_ranks_load_on_three_and_back(three_ranks):
    results = three_ranks["checkpoints"]
    for rank, out in enumerate(results):
        for key, value in out.items():
            assert value < TOL, (rank, key, value)
    assert "3->2" in results[0] and "2->3" in results[2]


def _compiled_on_two_ranks():
    group, opt = torch.distributed.group.WORLD, _optimizers()["clip_adamw"]
    want, _ = _train(group, _mlp_setup, opt, False, steps=10)
    got, _ = _train(group, _mlp_setup, opt, True, steps=10, trace=True, compile=True)
    return _max_diff(want, got)


def test_compile_true_with_sharded_state_on_two_gloo_ranks():
    """Inductor runs the scheduled sharded step (all-to-alls included) to the unsharded result."""
    for diff in run_checks({"compiled": _compiled_on_two_ranks}, 2, timeout=240)["compiled"]:
        assert diff < TOL, diff
