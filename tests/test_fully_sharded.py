"""Fully sharded parameters (fddp.shard_params): the step sees full parameters, every rank
keeps 1/N of them, and training equals the replicated step.

Each run is checked against the replicated fddp step with the same optimizer on the same
global batch: with ``shard_state`` (ZeRO-2, whose equality with the unsharded optimizer
test_zero checks) and, for the MLP, with the plain optimizer on ``pmean``-averaged gradients.
One spawn of 3 gloo ranks; ranks 0 and 1 also form a 2-rank group.
"""

from __future__ import annotations

import functools
import os

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks
from _models import (
    image_batch,
    mlp,
    next_token_loss,
    regression_batch,
    small_cnn,
    tiny_decoder,
    tiny_gpt2,
    token_batch,
)

import fddp
import fddp.optim as optim
from fddp._compiler._graph import is_compute, is_view

STEPS = 6  # momentum, Adam moments and accumulation carry over several steps
SAVE_AT = 3  # the checkpoint step: runs resume with STEPS - SAVE_AT steps to go
TOL = 1e-6
TINY = 200 / 2**20  # 200-byte buckets: several per model, uneven over 2 and 3 ranks
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
EMPTY = torch.ops.aten.empty.memory_format


def _mlp():
    model = mlp((6, 9, 9, 5))
    apply = fddp.functional(model)

    def loss_fn(p, buffers, batch):
        return F.mse_loss(apply(p, buffers, batch["x"]), batch["y"]), buffers

    return model, loss_fn, lambda i, rows: regression_batch(i, rows, 6, 5)


def _gpt():
    model = tiny_decoder(layers=2)  # the output layer's weight is the token embedding
    apply = fddp.functional(model)

    def loss_fn(p, buffers, ids):
        return next_token_loss(apply(p, buffers, ids), ids), buffers

    return model, loss_fn, lambda i, rows: token_batch(i, rows)


def _cnn():
    model = small_cnn()
    apply = fddp.functional(model, return_buffers=True)

    def loss_fn(p, buffers, batch):
        logits, new_buffers = apply(p, buffers, batch["x"])
        return F.cross_entropy(logits, batch["y"]), new_buffers

    return model, loss_fn, lambda i, rows: image_batch(i, rows)


def _hf_gpt2():
    model = tiny_gpt2()  # Hugging Face GPT-2, one layer, tied output layer
    apply = fddp.functional(model)

    def loss_fn(p, buffers, ids):
        return next_token_loss(apply(p, buffers, ids).logits, ids), buffers

    return model, loss_fn, lambda i, rows: token_batch(i, rows)


MODELS = {"mlp": _mlp, "gpt": _gpt, "cnn": _cnn, "hf_gpt2": _hf_gpt2}
OPTIMIZERS = {
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optim.sgd(0.05, momentum=0.9),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2)),
}


def _rows(tree, group):
    n, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return optree.tree_map(lambda x: x.chunk(n)[r], tree)


def _train(
    group,
    model_name,
    opt_name,
    mode,
    *,
    accumulate=1,
    wire=None,
    reshard=True,
    trace=True,
    steps=STEPS,
    save_at=None,
    start=None,
):
    """``mode``: "full" (sharded parameters), "zero2" (replicated parameters, shard_state) or
    "plain" (replicated parameters and optimizer, pmean). Returns the full parameters, the
    last buffers and the step with its last arguments."""
    model, loss_fn, data = MODELS[model_name]()
    params, buffers = fddp.state(model)
    inner = OPTIMIZERS[opt_name]()
    opt = (
        inner if mode == "plain" else optim.shard_state(inner, bucket_cap_mb=TINY, comm_dtype=wire)
    )
    grad_fn = (
        fddp.accumulate_gradients(loss_fn, accumulate, argnums=0, has_aux=True, batch_argnums=2)
        if accumulate > 1
        else fddp.value_and_grad(loss_fn, has_aux=True)
    )

    @functools.partial(fddp.data_parallel, group=group, trace=trace)
    def step(p, s, buffers, batch):
        (loss, new_buffers), g = grad_fn(p, buffers, batch)
        if accumulate > 1:
            new_buffers = new_buffers[-1]
        if mode == "plain":
            g = fddp.pmean(g)
        u, s = opt.update(g, s, p)
        floats = {k: v for k, v in new_buffers.items() if v.is_floating_point()}
        new_buffers = {**new_buffers, **fddp.pmean(floats)}
        return optim.apply_updates(p, u), s, new_buffers, fddp.pmean(loss)

    init = fddp.data_parallel(lambda p: opt.init(p), group=group, trace=False)
    state = init(params)
    if mode == "full":
        params = fddp.shard_params(
            params, bucket_cap_mb=TINY, comm_dtype=wire, reshard_after_forward=reshard, group=group
        )
    first = 0
    if start is not None:  # (directory, step) of a checkpoint, read into this run's layout
        loaded = fddp.load_sharded(start[0], {"params": params, "opt": state}, group=group)
        params, state, first = loaded["params"], loaded["opt"], start[1]
    for i in range(first, steps):
        if save_at is not None and i == save_at[1]:
            fddp.save_sharded(save_at[0], {"params": params, "opt": state}, group=group)
        batch = _rows(data(i, 12), group)
        params, state, buffers, _ = step(params, state, buffers, batch)
    full = fddp.full_params(params, group=group) if mode == "full" else params
    return full, buffers, (step, params, state, buffers, batch)


@functools.cache
def _pair():
    return torch.distributed.new_group([0, 1])


def _group(world):
    return torch.distributed.group.WORLD if world == 3 else _pair()


CASES = [
    ("mlp", "adamw", {}),
    ("mlp", "sgd_momentum", {}),
    ("mlp", "clip_adamw", {}),
    ("gpt", "adamw", {}),
    ("gpt", "adamw", {"reshard": False}),
    ("cnn", "sgd_momentum", {}),
    ("gpt", "adamw", {"accumulate": 3}),
    ("mlp", "adamw", {"accumulate": 2, "reshard": False}),
    ("mlp", "adamw", {"trace": False}),
    ("hf_gpt2", "adamw", {"accumulate": 2}),
]


def check_equal(world: int) -> dict | None:
    if world == 2 and torch.distributed.get_rank() >= 2:
        return None
    group, out = _group(world), {}
    for model, opt, options in CASES:
        want = _train(group, model, opt, "zero2", **options)[:2]
        got = _train(group, model, opt, "full", **options)[:2]
        out[f"{model} {opt} {options}"] = (want, got)
    want = _train(group, "mlp", "adamw", "plain")[:2]
    got = _train(group, "mlp", "adamw", "full")[:2]
    out["mlp adamw against the plain optimizer"] = (want, got)
    return out


def check_bf16_gathers(world: int, steps: int = STEPS) -> dict | None:
    """bf16 on the wire both ways: the step's forward sees bf16-rounded parameters."""
    if world == 2 and torch.distributed.get_rank() >= 2:
        return None
    group = _group(world)
    wire = torch.bfloat16
    got = _train(group, "mlp", "adamw", "full", wire=wire, steps=steps)[0]
    exact = _train(group, "mlp", "adamw", "full", steps=steps)[0]
    # the reference: replicated parameters, rounded for the forward pass only
    model, loss_fn, data = _mlp()
    params, buffers = fddp.state(model)
    opt = optim.shard_state(OPTIMIZERS["adamw"](), bucket_cap_mb=TINY, comm_dtype=wire)

    @functools.partial(fddp.data_parallel, group=group)
    def step(p, s, batch):
        rounded = {k: v.to(wire).to(v.dtype) for k, v in p.items()}
        (loss, _), g = fddp.value_and_grad(loss_fn, has_aux=True)(rounded, buffers, batch)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    state = fddp.data_parallel(lambda p: opt.init(p), group=group, trace=False)(params)
    for i in range(steps):
        params, state, _ = step(params, state, _rows(data(i, 12), group))
    return {"got": got, "want": params, "exact": exact}


def check_checkpoints(tmp: str) -> dict:
    """3 ranks save fully sharded parameters and state at step SAVE_AT, 2 load them, and back;
    each finishes the STEPS. ``fddp.save`` of sharded parameters is refused."""
    rank, world, pair = torch.distributed.get_rank(), torch.distributed.group.WORLD, _pair()
    from3, from2 = os.path.join(tmp, "from3"), os.path.join(tmp, "from2")
    _train(world, "gpt", "adamw", "full", steps=SAVE_AT + 1, save_at=(from3, SAVE_AT))
    if rank < 2:
        _train(pair, "gpt", "adamw", "full", steps=SAVE_AT + 1, save_at=(from2, SAVE_AT))
    torch.distributed.barrier()
    out = {}
    if rank < 2:
        want = _train(pair, "gpt", "adamw", "full")[0]
        got = _train(pair, "gpt", "adamw", "full", start=(from3, SAVE_AT))[0]
        out["3->2"] = (want, got)
    want = _train(world, "gpt", "adamw", "full")[0]
    got = _train(world, "gpt", "adamw", "full", start=(from2, SAVE_AT))[0]
    out["2->3"] = (want, got)
    try:
        fddp.save(
            os.path.join(tmp, "one.pt"), {"params": fddp.shard_params(fddp.state(mlp((3, 2)))[0])}
        )
    except TypeError as e:
        out["fddp.save"] = str(e)
    torch.distributed.barrier()
    return out


def _gathers(plan):
    return [c for c in plan.collectives if c.gather]


def _is_param_gather(node):
    return "fddp_gather_instance" in node.meta and node.target in (ALL_GATHER, ALL_TO_ALL)


def _is_reduce_scatter(node):
    return node.target is ALL_TO_ALL and "fddp_gather_instance" not in node.meta


def _most_in_flight(graph, is_launch):
    """The most collectives that ``is_launch`` picks in flight at once, in graph order."""
    in_flight, most = set(), 0
    for node in graph.nodes:
        if is_launch(node):
            in_flight.add(node)
            most = max(most, len(in_flight))
        elif node.target is WAIT:
            in_flight.discard(node.args[0])
    return most


def _forward(node):
    return bool(node.meta.get("custom", {}).get("fddp_forward"))


def _first_write(buffer):
    """The first node that reads or writes ``buffer`` other than through a view."""
    views, frontier, users = {buffer}, [buffer], set()
    while frontier:
        for user in frontier.pop().users:
            if is_view(user) and user not in views:
                views.add(user)
                frontier.append(user)
            elif not is_view(user):
                users.add(user)
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    return min(users, key=order.get)


def _memory_structure(graph):
    """What bounds a fully sharded step's memory, read off its scheduled graph."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    gathered = {n for n in nodes if "fddp_gather_instance" in n.meta}
    uses = {}  # reads of gathered parameters, by gather
    for node in gathered:
        for user in node.users:
            if user not in gathered:
                uses.setdefault(node.meta["fddp_gather_instance"], set()).add(user)
    forward_uses = sorted((u for us in uses.values() for u in us if _forward(u)), key=position.get)
    launches = [n for n in nodes if _is_param_gather(n)]
    across_the_loss = 0  # gathers launched in a forward pass for its backward pass
    for launch in launches:
        first = min(uses[launch.meta["fddp_gather_instance"]], key=position.get)
        earlier = [u for u in forward_uses if position[u] < position[first]]
        late = not earlier or _forward(first) or position[launch] > position[earlier[-1]]
        across_the_loss += not late
    computing = [n for n in nodes if is_compute(n)]
    empties = [n for n in nodes if n.target is EMPTY]
    return {
        "gather kinds": sorted({str(n.target) for n in launches}),
        "gathers in flight": _most_in_flight(graph, _is_param_gather),
        "reduce-scatters in flight": _most_in_flight(graph, _is_reduce_scatter),
        "gathers across the loss": across_the_loss,
        "buffers made before their first use": sum(
            any(position[e] < position[n] < position[_first_write(e)] for n in computing)
            for e in empties
        ),
        "buffers": len(empties),
        "prefetched": sum(
            any(position[launch] < position[n] < position[wait] for n in computing)
            for launch in launches
            for wait in launch.users
            if wait.target is WAIT
        ),
    }


def check_schedule_and_memory() -> dict:
    """On 3 ranks: where the gathers go, how many there are, and the bytes at rest."""
    group = torch.distributed.group.WORLD
    out = {}
    for name, options in {
        "reshard": {},
        "kept": {"reshard": False},
        "accumulate 3, kept": {"accumulate": 3, "reshard": False},
        "accumulate 3, reshard": {"accumulate": 3},
    }.items():
        _, _, (step, params, state, buffers, batch) = _train(
            group, "gpt", "adamw", "full", steps=1, **options
        )
        plan = step.schedule(params, state, buffers, batch)
        graph = step.graph(params, state, buffers, batch).graph
        gathers = _gathers(plan)
        out[name] = {
            "buckets": len(params.shards),
            "gathers": len(gathers),
            "which": [c.gather for c in gathers],
            "before use": all(c.launch <= c.wait <= c.freed for c in gathers),
            "table": str(plan),
            "memory": _memory_structure(graph),
            "update gathers": sum(
                1
                for n in graph.nodes
                if n.target is ALL_TO_ALL and "fddp_gather_instance" not in n.meta
            )
            - len(params.shards),  # reduce-scatters are all-to-alls too, one per bucket
        }
    _, _, (step, params, state, buffers, batch) = _train(group, "gpt", "adamw", "full", steps=1)
    full_params = fddp.state(tiny_decoder(layers=2))[0]
    out["bytes"] = {
        "shards": sum(s.numel() * s.element_size() for s in params.shards),
        "full": sum(v.numel() * v.element_size() for v in full_params.values()),
        "state": optim.state_bytes(state),
        "full state": optim.state_bytes(OPTIMIZERS["adamw"]().init(full_params)),
    }
    return out


def check_errors() -> dict:
    group = torch.distributed.group.WORLD
    params = fddp.state(mlp((3, 2)))[0]
    sharded = fddp.shard_params(params)
    out = {}

    @fddp.data_parallel
    def wrong_output(p, x):
        return x.sum(), p

    try:
        wrong_output(sharded, torch.ones(2))
    except ValueError as e:
        out["wrong output"] = str(e)
    pair = _pair()
    if torch.distributed.get_rank() < 2:

        @functools.partial(fddp.data_parallel, group=pair)
        def step(p, x):
            return p, x

        try:
            step(sharded, torch.ones(2))
        except ValueError as e:
            out["other world"] = str(e)
    model = mlp((3, 2), seed=1)
    model.load_state_dict(fddp.full_params(sharded))  # the export path: a plain state dict
    out["state dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["params"] = params
    try:
        fddp.shard_params({"n": torch.zeros(3, dtype=torch.int64)})
    except TypeError as e:
        out["integers"] = str(e)
    torch.distributed.barrier(group=group)
    return out


def check_state_dict_and_names() -> dict | None:
    """On 2 ranks: a BatchNorm CNN trained fully sharded, exported with full_state_dict into a
    fresh torch module; each leaf's piece on this rank, by name."""
    if torch.distributed.get_rank() >= 2:
        return None
    pair, steps = _pair(), 3
    _, _, (_, sharded, _, buffers, batch) = _train(pair, "cnn", "sgd_momentum", "full", steps=steps)
    want_params, want_buffers, _ = _train(pair, "cnn", "sgd_momentum", "zero2", steps=steps)
    out = {}
    state_dict = fddp.full_state_dict(sharded, buffers)
    fresh = small_cnn(seed=7).eval()
    fresh.load_state_dict(state_dict, strict=True)
    reference = small_cnn().eval()  # the trained function: replicated training's values
    with torch.no_grad():
        out["outputs"] = (
            fresh(batch["x"]),
            fddp.functional(reference)(want_params, want_buffers, batch["x"]),
        )
    out["keys"] = (sorted(state_dict), sorted(reference.state_dict()))
    out["rank0 only"] = fddp.full_state_dict(sharded, buffers, rank0_only=True)
    out["state dict"] = {k: v.clone() for k, v in state_dict.items()}
    out["names"] = list(sharded)
    out["len"] = len(sharded)
    out["in"] = ("conv1.weight" in sharded, "conv1.weight.x" in sharded, 3 in sharded)
    out["pieces"] = {name: (sharded.local_slice(name), sharded[name].clone()) for name in sharded}
    out["items"] = {k: v.clone() for k, v in sharded.items()}
    try:
        sharded["conv1"]
    except KeyError as e:
        out["unknown"] = str(e)
    try:
        fddp.full_state_dict(sharded, {**buffers, "conv1.weight": buffers["bn1.running_mean"]})
    except ValueError as e:
        out["both"] = str(e)
    torch.distributed.barrier(group=pair)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fully_sharded"))
    checks = {
        "checkpoints": functools.partial(check_checkpoints, tmp),
        "equal 3": functools.partial(check_equal, 3),
        "equal 2": functools.partial(check_equal, 2),
        "bf16 3": functools.partial(check_bf16_gathers, 3),
        "schedule": check_schedule_and_memory,
        "errors": check_errors,
        "state dict": check_state_dict_and_names,
    }
    return run_checks(checks, 3, timeout=420)


@pytest.mark.parametrize("world", [3, 2])
def test_fully_sharded_training_equals_the_replicated_step(runs, world):
    results = runs[f"equal {world}"]
    assert [r is None for r in results] == [False, False, world == 2]
    for rank, out in enumerate(results[:world]):
        assert len(out) == len(CASES) + 1
        for case, (want, got) in out.items():
            assert_trees_close(got, want, rtol=0, atol=TOL, what=f"rank {rank}, {case}")


def test_bf16_gathers_round_the_forward_pass_only(runs):
    for out in runs["bf16 3"]:
        assert_trees_close(out["got"], out["want"], rtol=0, atol=TOL)
        diff = max((out["got"][k] - out["exact"][k]).abs().max().item() for k in out["got"])
        assert diff > 10 * TOL  # the wire did round


def test_gathers_are_placed_per_span_and_updates_are_not_gathered(runs):
    out = runs["schedule"][0]
    print(out["reshard"]["table"])
    for name, found in out.items():
        if name == "bytes":
            continue
        assert found["before use"], (name, found["table"])
        assert found["update gathers"] == 0, (name, found["table"])
    buckets = out["reshard"]["buckets"]
    assert buckets >= 4
    # kept: one gather per bucket per step, accumulation included (not one per microbatch)
    assert out["kept"]["gathers"] == buckets
    assert out["accumulate 3, kept"]["gathers"] == buckets
    # resharded: gathered again for the backward pass, but the last layers (used back to back)
    assert buckets < out["reshard"]["gathers"] < 2 * buckets
    assert out["accumulate 3, reshard"]["gathers"] > 2 * out["reshard"]["gathers"]
    assert any(w.endswith("2 of 2") for w in out["reshard"]["which"])


def test_a_step_holds_one_gather_one_reduce_scatter_and_buckets_from_their_first_write(runs):
    """Gloo's own all-gather for the parameters, never two at once (two corrupt gloo's heap),
    prefetched but not across the loss; gradient buckets made where they are first written."""
    out = runs["schedule"][0]
    for name, found in out.items():
        if name == "bytes":
            continue
        memory = found["memory"]
        assert memory["buffers"] >= out[name]["buckets"], (name, found["table"])
        assert memory["prefetched"] >= out[name]["buckets"] // 2, (name, found["table"])
        assert {**memory, "buffers": 0, "prefetched": 0} == {
            "gather kinds": [str(ALL_GATHER)],
            "gathers in flight": 1,
            "reduce-scatters in flight": 1,
            "gathers across the loss": 0,
            "buffers made before their first use": 0,
            "buffers": 0,
            "prefetched": 0,
        }, (name, found["table"])


def test_bytes_at_rest_are_a_third_on_three_ranks(runs):
    for out in runs["schedule"]:
        b = out["bytes"]
        assert b["full"] / 3 <= b["shards"] < b["full"] / 3 * 1.05 + 64, b
        assert b["state"] < b["full state"] / 3 * 1.05 + 512, b


def test_bad_input_raises_clear_errors(runs):
    for rank, out in enumerate(runs["errors"]):
        assert "must be the new parameters" in out["wrong output"]
        assert "integer" in out["integers"] or "floating-point" in out["integers"]
        assert "shard_params" in out["integers"] and "shard_state" not in out["integers"]
        if rank < 2:
            assert "sharded over 3 replicas" in out["other world"]
        assert_trees_close(out["state dict"], out["params"], rtol=0, atol=0)


def _without_key_bias(params):
    """All but the attention key bias, whose gradient is exactly zero (softmax ignores a shift
    of every score): Adam turns its rounding noise into full steps, so a run resumed on another
    number of ranks (another summation order) moves it, as test_zero explains."""
    dim = params["tok.weight"].shape[1]
    return {
        k: torch.cat([v[:dim], v[2 * dim :]]) if k.endswith("qkv.bias") else v
        for k, v in params.items()
    }


def test_checkpoints_reshard_between_two_and_three_ranks(runs):
    for rank, out in enumerate(runs["checkpoints"]):
        assert set(out) == ({"3->2", "2->3", "fddp.save"} if rank < 2 else {"2->3", "fddp.save"})
        for key in ("3->2", "2->3"):
            if key in out:
                want, got = map(_without_key_bias, out[key])
                assert_trees_close(got, want, rtol=0, atol=TOL, what=f"rank {rank}, {key}")
        assert "fully sharded parameters" in out["fddp.save"] and "save_sharded" in out["fddp.save"]


def test_full_state_dict_loads_strictly_into_a_fresh_batchnorm_model(runs):
    """Parameters gathered and buffers in one dict: torch's strict load takes it, and the fresh
    module computes what replicated training computes (running statistics included)."""
    results = runs["state dict"]
    assert [r is None for r in results] == [False, False, True]
    for rank, out in enumerate(results[:2]):
        got, want = out["outputs"]
        assert_trees_close(got, want, rtol=0, atol=1e-5, what=f"rank {rank}")
        keys, module_keys = out["keys"]
        assert keys == module_keys and "bn1.num_batches_tracked" in keys
        assert "conv1.weight" in out["both"] and "both parameters and buffers" in out["both"]
    assert_trees_close(results[0]["rank0 only"], results[0]["state dict"], rtol=0, atol=0)
    assert results[1]["rank0 only"] is None


def test_sharded_params_are_a_mapping_of_each_leafs_piece_on_this_rank(runs):
    """``sharded[name]`` is this rank's piece of the leaf, at ``local_slice(name)`` of it
    flattened: the two ranks' pieces tile every full leaf exactly."""
    first, second = runs["state dict"][:2]
    full = {k: v for k, v in first["state dict"].items() if k in first["names"]}
    params = dict(fddp.state(small_cnn())[0])
    assert first["names"] == second["names"] == sorted(params)  # flattening order
    assert first["len"] == len(params)
    for out in (first, second):
        assert out["in"] == (True, False, False)
        assert out["items"].keys() == full.keys()
        assert "no leaf 'conv1'" in out["unknown"] and "'conv1.weight'" in out["unknown"]
    split = 0
    for name, leaf in full.items():
        flat = leaf.reshape(-1)
        covered = torch.zeros(flat.numel(), dtype=torch.int64)
        for out in (first, second):
            where, piece = out["pieces"][name]
            assert torch.equal(piece, flat[where]), name
            assert torch.equal(out["items"][name], piece), name
            covered[where] += 1
        assert torch.equal(covered, torch.ones_like(covered)), name  # each element once
        split += all(out["pieces"][name][1].numel() > 0 for out in (first, second))
    assert split >= 1  # some leaf straddles the two ranks' shards


def test_errors_name_the_function_the_user_called():
    """One layout serves shard_state and shard_params: its errors say which was called."""
    integers = {"n": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"^shard_params: .*floating-point"):
        fddp.shard_params(integers)
    with pytest.raises(TypeError, match=r"^shard_state: .*floating-point"):
        optim.shard_state(optim.sgd(0.1)).init(integers)
    for cap in (0, -1.0):
        with pytest.raises(ValueError, match=r"^shard_params: bucket_cap_mb must be positive"):
            fddp.shard_params({"w": torch.ones(2)}, bucket_cap_mb=cap)
        with pytest.raises(ValueError, match=r"^shard_state: bucket_cap_mb must be positive"):
            optim.shard_state(optim.sgd(0.1), bucket_cap_mb=cap)
    with pytest.raises(TypeError, match="flat dict name -> tensor"):
        fddp.full_state_dict({"a": {"b": torch.ones(1)}}, {})
    with pytest.raises(TypeError, match="full_params takes the ShardedParams"):
        fddp.full_params({"w": torch.ones(2)})
