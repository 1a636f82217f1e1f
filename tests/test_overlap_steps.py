"""Overlap across steps (data_parallel(..., overlap_steps=...)): the last buckets' waits and
updates run in the next call. Every deferred run is checked bitwise against the same step
without it, on 2 gloo ranks (one spawn for all multi-rank checks)."""

from __future__ import annotations

import functools
import io
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from _dist import run_checks
from _models import mlp, next_token_loss, regression_batch, tiny_decoder, token_batch

import fddp
import fddp.optim as optim
from fddp._pending import Deferred, PendingTensor
from fddp._schedule._graph import is_collective, is_wait

STEPS = 30
SIZES = (6, 16, 16, 16, 3)
SMALL_BUCKETS = 300 / 2**20  # a few Linear layers per bucket: several buckets


def _mlp_step(opt: optim.GradientTransformation, sizes: tuple[int, ...] = SIZES):
    model = mlp(sizes)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return F.mse_loss(apply(p, buffers, batch["x"]), batch["y"])

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step, params


def _batch(i: int, sizes: tuple[int, ...] = SIZES) -> dict:
    return regression_batch(100 * i + fddp.rank(), 4, sizes[0], sizes[-1])


def _train(pstep, params, opt_state, steps=STEPS, touch=None, batch=_batch):
    losses = []
    for i in range(steps):
        params, opt_state, loss = pstep(params, opt_state, batch(i))
        losses.append(loss)
        if touch is not None and i % 7 == 3:
            touch(params, loss)
    return fddp.block_until_ready((params, opt_state, losses))


def _same(a, b) -> bool:
    leaves_a, leaves_b = (
        [x for x in torch.utils._pytree.tree_leaves(t) if isinstance(x, torch.Tensor)]
        for t in (a, b)
    )
    return len(leaves_a) == len(leaves_b) and all(
        type(x) is torch.Tensor and torch.equal(x, y) for x, y in zip(leaves_a, leaves_b)
    )


def _runner(pstep):
    (entry,) = pstep._cache.values()
    return entry.program.across_steps


def check_bitwise_with_and_without(donate: bool, touch: bool) -> dict:
    opt = optim.adamw(1e-2, weight_decay=0.1)
    step, params = _mlp_step(opt)
    kw = dict(
        bucket_cap_mb=SMALL_BUCKETS,
        first_bucket_cap_mb=SMALL_BUCKETS,
        donate_argnums=(0, 1) if donate else (),
    )
    plain = fddp.data_parallel(step, **kw)
    deferred = fddp.data_parallel(step, overlap_steps=True, **kw)

    def fresh():
        p = {k: v.clone() for k, v in params.items()}
        return p, opt.init(p)

    seen: list[str] = []

    def look(params, loss):  # touching completes the tail; the next call starts plain
        seen.append(type(params["0.weight"]).__name__)
        seen.append(f"{loss.item():.3f}")
        print(params["0.weight"][0, 0])

    reference = _train(plain, *fresh())
    start = fresh()
    kept = {k: v.clone() for k, v in start[0].items()}
    got = _train(deferred, *start, touch=look if touch else None)
    out = _runner(deferred)
    return {
        "same": _same(reference, got),
        "inputs_kept": donate or _same(kept, start[0]),
        "merged_builds": out.merged_builds,
        "pending_seen": seen[:1],
        "schedule": str(deferred.schedule(got[0], got[1], _batch(0))),
    }


def check_outputs_are_pending_until_touched() -> dict:
    opt = optim.adam(1e-2)
    step, params = _mlp_step(opt)
    pstep = fddp.data_parallel(
        step, bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS, overlap_steps=True
    )
    plain = fddp.data_parallel(step, bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS)
    state = opt.init(params)
    p1, _, loss1 = pstep(params, state, _batch(0))
    pending = [type(x) is PendingTensor for x in p1.values()]
    ref_p, _, ref_loss = plain(params, state, _batch(0))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        fddp.save(path, {"params": p1}, rank0_only=False)  # completes the pending leaves
        loaded = fddp.load(path, like={"params": ref_p})["params"]
    buffer = io.BytesIO()
    torch.save(p1, buffer)  # a plain torch.save pickles the finished tensors
    buffer.seek(0)
    pickled = torch.load(buffer)
    return {
        "pending": pending,
        "loaded_equal": _same(loaded, ref_p),
        "pickled_equal": _same(pickled, ref_p),
        "pickled_types": {type(x).__name__ for x in pickled.values()},
        "values_equal": all(torch.equal(p1[k] + 0, ref_p[k]) for k in ref_p),
        "loss_equal": float(loss1) == float(ref_loss),
    }


def check_donated_output_refuses_to_be_read() -> str:
    opt = optim.sgd(0.1, momentum=0.9)
    step, params = _mlp_step(opt)
    pstep = fddp.data_parallel(
        step,
        bucket_cap_mb=SMALL_BUCKETS,
        first_bucket_cap_mb=SMALL_BUCKETS,
        overlap_steps=True,
        donate_argnums=(0, 1),
    )
    p = {k: v.clone() for k, v in params.items()}
    p1, s1, _ = pstep(p, opt.init(p), _batch(0))
    pending = next(x for x in p1.values() if type(x) is PendingTensor)
    pstep(p1, s1, _batch(1))  # its storage now holds this call's result
    try:
        pending.sum()
    except ValueError as e:
        return str(e)
    return "no error"


def check_merged_program_updates_each_layer_before_its_forward() -> dict:
    opt = optim.sgd(0.1)
    step, params = _mlp_step(opt)
    one_leaf = 1e-6  # every gradient its own bucket
    pstep = fddp.data_parallel(
        step, bucket_cap_mb=one_leaf, first_bucket_cap_mb=one_leaf, overlap_steps=True
    )
    _train(pstep, params, opt.init(params), steps=3)
    runner = _runner(pstep)
    first = runner._first.head_graph.graph
    launches = [n for n in first.nodes if is_collective(n)]
    waited = [any(is_wait(u) for u in n.users) for n in launches]
    (merged,) = runner._merged.values()
    nodes = list(merged.head_graph.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    matmuls = [n for n in nodes if n.target is torch.ops.aten.addmm.default]
    placeholder_waits = [n for n in nodes if is_wait(n) and n.args[0].op == "placeholder"]
    return {
        # the deferred launches come last, in reverse order of their buckets
        "waited": waited,
        "deferred_buckets": [n.meta.get("fddp_bucket") for n, w in zip(launches, waited) if not w],
        # the previous call's waits sit inside the forward, the first before the first layer
        "tail_waits": len(placeholder_waits),
        "first_wait_before_first_layer": order[placeholder_waits[0]] < order[matmuls[0]],
        "a_wait_after_the_first_layer": order[placeholder_waits[-1]] > order[matmuls[0]],
    }


def check_sharded_state_and_a_decoder() -> dict:
    model = tiny_decoder(layers=2)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)
    results = {}
    for name, opt, average in (
        ("decoder_adamw", optim.adamw(1e-2, weight_decay=0.1), True),
        ("decoder_shard_state", optim.shard_state(optim.adam(1e-2), bucket_cap_mb=0.002), False),
    ):

        def step(params, opt_state, ids, opt=opt, average=average):
            loss, grads = fddp.value_and_grad(
                lambda params: next_token_loss(apply(params, buffers, ids), ids)
            )(params)
            grads = fddp.pmean(grads) if average else grads
            updates, opt_state = opt.update(grads, opt_state, params)
            return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

        def batch(i):
            return token_batch(10 * i + fddp.rank(), 4)

        kw = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.01, donate_argnums=(0, 1))
        runs = []
        for overlap in (False, True):
            p = {k: v.clone() for k, v in params.items()}
            pstep = fddp.data_parallel(step, overlap_steps=overlap, **kw)
            runs.append(_train(pstep, p, opt.init(p), steps=12, batch=batch))
        results[name] = _same(*runs)
    return results


def check_pending_outputs_feed_another_step() -> bool:
    opt = optim.sgd(0.1)
    step, params = _mlp_step(opt)
    train = fddp.data_parallel(
        step, bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS, overlap_steps=True
    )
    evaluate = fddp.data_parallel(lambda p, b: fddp.pmean(p["0.weight"].sum() * b["x"].sum()))
    p, _, _ = train(params, opt.init(params), _batch(0))
    pending = type(p["0.weight"]) is PendingTensor
    value = evaluate(p, _batch(1))
    expected = evaluate(fddp.block_until_ready(p), _batch(1))
    return pending and torch.equal(value, expected)


@pytest.fixture(scope="module")
def runs():
    checks = {
        "plain": functools.partial(check_bitwise_with_and_without, False, False),
        "donated": functools.partial(check_bitwise_with_and_without, True, False),
        "touched": functools.partial(check_bitwise_with_and_without, True, True),
        "pending": check_outputs_are_pending_until_touched,
        "donated_read": check_donated_output_refuses_to_be_read,
        "merged": check_merged_program_updates_each_layer_before_its_forward,
        "models": check_sharded_state_and_a_decoder,
        "feed": check_pending_outputs_feed_another_step,
    }
    results = run_checks(list(checks.values()), 2, timeout=240)
    return dict(zip(checks, results))


@pytest.mark.parametrize("case", ["plain", "donated", "touched"])
def test_params_and_losses_are_bitwise_those_of_the_plain_step(runs, case):
    for result in runs[case]:
        assert result["same"] and result["inputs_kept"]  # without donation, never written
        assert result["merged_builds"] == 1  # one merged program serves every later call
        assert "launched last-first" in result["schedule"]
    if case == "touched":
        assert runs[case][0]["pending_seen"] == ["PendingTensor"]


def test_outputs_are_pending_and_complete_when_touched_saved_or_pickled(runs):
    for result in runs["pending"]:
        assert any(result["pending"]) and not all(result["pending"])  # the last buckets only
        assert result["loaded_equal"] and result["pickled_equal"] and result["values_equal"]
        assert result["pickled_types"] == {"Tensor"}
        assert result["loss_equal"]


def test_a_donated_pending_output_raises_instead_of_reading_reused_storage(runs):
    for message in runs["donated_read"]:
        assert "donated" in message and "next call" in message


def test_merged_program_launches_last_first_and_waits_inside_the_forward(runs):
    for result in runs["merged"]:
        waited = result["waited"]
        assert not all(waited) and waited[: waited.index(False)] == [True] * waited.index(False)
        deferred = result["deferred_buckets"]
        assert deferred == sorted(deferred, reverse=True)  # the first layers' bucket first
        assert result["tail_waits"] == len(deferred)
        assert result["first_wait_before_first_layer"] and result["a_wait_after_the_first_layer"]


def test_sharded_state_and_a_decoder_are_bitwise_too(runs):
    for result in runs["models"]:
        assert result == {"decoder_adamw": True, "decoder_shard_state": True}


def test_pending_outputs_passed_to_another_step_are_completed_first(runs):
    assert all(runs["feed"])


def test_overlap_steps_needs_the_fx_runner():
    with pytest.raises(ValueError, match="compile=False"):
        fddp.data_parallel(lambda x: x, compile=True, overlap_steps=True)


def test_pending_tensor_behaves_as_its_value_once_completed():
    calls = []

    def tail(carried):
        calls.append(1)
        return [carried[0] * 2, carried[0] + 1]

    deferred = Deferred(tail, [torch.arange(4.0)], key=None, where="step")
    a = PendingTensor(torch.empty(4), deferred, 0)
    b = PendingTensor(torch.empty(4), deferred, 1)
    assert a.shape == (4,) and a.dtype == torch.float32 and not calls
    assert torch.equal(a + 1, torch.tensor([1.0, 3.0, 5.0, 7.0])) and calls == [1]
    assert b.tolist() == [1.0, 2.0, 3.0, 4.0] and b.numpy().sum() == 10 and calls == [1]
    assert "tensor([0., 2., 4., 6.])" in repr(a)
    target = torch.zeros(4)
    target.copy_(b)
    assert torch.equal(target, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    a.add_(1)  # in place on the finished value
    assert torch.equal(a, torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert fddp.block_until_ready({"a": a})["a"].__class__ is torch.Tensor


def test_a_tail_that_fails_leaves_outputs_that_raise_instead_of_half_updated_values():
    def tail(carried):
        carried[0].add_(1)  # part of the update lands, then the wait fails
        raise RuntimeError("the collective failed")

    deferred = Deferred(tail, [torch.zeros(2)], key=None, where="step")
    a = PendingTensor(torch.empty(2), deferred, 0)
    with pytest.raises(RuntimeError, match="the collective failed"):
        a.sum()
    for _ in range(2):  # and every later touch: the tail does not run twice
        with pytest.raises(RuntimeError, match="deferred updates failed"):
            a + 1
