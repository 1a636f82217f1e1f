"""Overlap across steps (data_parallel(..., overlap_steps=...)): the last buckets' waits and
updates run in the next call. Every deferred run is checked bitwise against the same step
without it, on 2 gloo ranks (one spawn for all the named multi-rank checks).

Public API only, but for three things nothing public shows, which ``_across_steps`` and the two
last tests reach into fddp for: how many merged programs (the previous call's tail fused into
this call's head) the step built, where the waits sit in them, and a deferred tail that fails
(no public way to make a launched collective's wait fail on one rank only).
"""

from __future__ import annotations

import functools
import io
import os
import tempfile

import optree
import pytest
import torch
from _compare import assert_trees_equal
from _dist import run_checks
from _models import mlp_step, next_token_loss, regression_batch, tiny_decoder, token_batch

import fddp
import fddp.optim as optim

WAIT = torch.ops._c10d_functional.wait_tensor.default

STEPS = 30
SIZES = (6, 16, 16, 16, 3)
SMALL_BUCKETS = 300 / 2**20  # a few Linear layers per bucket: several buckets


def _mlp_step(opt: optim.GradientTransformation, sizes: tuple[int, ...] = SIZES):
    return mlp_step(opt, sizes)


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


def _pending(x) -> bool:
    """A pending output: a tensor whose deferred updates have not run (not a plain Tensor)."""
    return isinstance(x, torch.Tensor) and type(x) is not torch.Tensor


def _finished(tree) -> bool:
    return not any(map(_pending, optree.tree_leaves(tree)))


def _is_wait(node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def _is_collective(node) -> bool:
    """A functional collective's launch (its wait excluded)."""
    namespace = getattr(node.target, "namespace", None)
    return node.op == "call_function" and namespace == "_c10d_functional" and not _is_wait(node)


def _across_steps(pstep):
    """No public surface: the runner of an overlap_steps step, for what only it shows (how many
    merged programs it built, and their graphs)."""
    (compiled,) = pstep._programs.programs()
    return compiled.program.across_steps


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
    return {
        "reference": reference,
        "got": got,
        "finished": _finished(got),
        "kept": kept,
        "start": None if donate else start[0],
        "merged_builds": _across_steps(deferred).merged_builds,
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
    pending = [_pending(x) for x in p1.values()]
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
        "loaded": loaded,
        "pickled": pickled,
        "reference": ref_p,
        "pickled_types": {type(x).__name__ for x in pickled.values()},
        "values": {k: p1[k] + 0 for k in ref_p},
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
    pending = next(x for x in p1.values() if _pending(x))
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
    runner = _across_steps(pstep)
    first = runner._first.head_graph.graph
    launches = [n for n in first.nodes if _is_collective(n)]
    waited = [any(_is_wait(u) for u in n.users) for n in launches]
    (merged,) = runner._merged.values()
    nodes = list(merged.head_graph.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    matmuls = [n for n in nodes if n.target is torch.ops.aten.addmm.default]
    placeholder_waits = [n for n in nodes if _is_wait(n) and n.args[0].op == "placeholder"]
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
        results[name] = {"plain": runs[0], "overlap": runs[1], "finished": _finished(runs[1])}
    return results


def check_pending_outputs_feed_another_step() -> dict:
    opt = optim.sgd(0.1)
    step, params = _mlp_step(opt)
    train = fddp.data_parallel(
        step, bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS, overlap_steps=True
    )
    evaluate = fddp.data_parallel(lambda p, b: fddp.pmean(p["0.weight"].sum() * b["x"].sum()))
    p, _, _ = train(params, opt.init(params), _batch(0))
    pending = _pending(p["0.weight"])
    value = evaluate(p, _batch(1))
    expected = evaluate(fddp.block_until_ready(p), _batch(1))
    return {"pending": pending, "value": value, "expected": expected}


def check_a_pending_output_behaves_as_its_value() -> dict:
    """A real pending output: its metadata without completing it, then the finished value."""
    opt = optim.sgd(0.1)
    step, params = _mlp_step(opt)
    kw = dict(bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS)
    plain = fddp.data_parallel(step, **kw)
    deferred = fddp.data_parallel(step, overlap_steps=True, **kw)
    state = opt.init(params)
    expected = plain(params, state, _batch(0))[0]
    got = deferred(params, state, _batch(0))[0]
    name = next(k for k, x in got.items() if _pending(x))
    a = got[name]
    meta = (tuple(a.shape), a.dtype, _pending(a))  # shape and dtype leave it pending
    target = torch.zeros_like(expected[name])
    target.copy_(a)
    out = {
        "meta": meta,
        "want_meta": (tuple(expected[name].shape), expected[name].dtype, True),
        "plus_one": a + 1,
        "want_plus_one": expected[name] + 1,
        "tolist": a.tolist() == expected[name].tolist(),
        "numpy": bool((a.numpy() == expected[name].numpy()).all()),
        "repr": repr(expected[name]).removeprefix("tensor(") in repr(a),
        "copied": target,
        "want": expected[name],
    }
    a.add_(1)  # in place on the finished value
    out["added"], out["want_added"] = a + 0, expected[name] + 1
    out["finished_type"] = fddp.block_until_ready({"a": a})["a"].__class__.__name__
    return out


CHECKS = {
    "plain": functools.partial(check_bitwise_with_and_without, False, False),
    "donated": functools.partial(check_bitwise_with_and_without, True, False),
    "touched": functools.partial(check_bitwise_with_and_without, True, True),
    "pending": check_outputs_are_pending_until_touched,
    "donated_read": check_donated_output_refuses_to_be_read,
    "merged": check_merged_program_updates_each_layer_before_its_forward,
    "models": check_sharded_state_and_a_decoder,
    "feed": check_pending_outputs_feed_another_step,
    "value": check_a_pending_output_behaves_as_its_value,
}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, 2, timeout=240)


@pytest.mark.parametrize("case", ["plain", "donated", "touched"])
def test_params_and_losses_are_bitwise_those_of_the_plain_step(runs, case):
    for rank, result in enumerate(runs[case]):
        assert result["finished"]  # block_until_ready returned plain tensors
        assert_trees_equal(result["got"], result["reference"], f"{case}, rank {rank}")
        if result["start"] is not None:  # without donation, never written
            assert_trees_equal(result["start"], result["kept"], f"{case} inputs, rank {rank}")
        assert result["merged_builds"] == 1  # one merged program serves every later call
        assert "launched last-first" in result["schedule"]
    if case == "touched":
        assert runs[case][0]["pending_seen"] == ["PendingTensor"]


def test_outputs_are_pending_and_complete_when_touched_saved_or_pickled(runs):
    for result in runs["pending"]:
        assert any(result["pending"]) and not all(result["pending"])  # the last buckets only
        assert_trees_equal(result["loaded"], result["reference"], "fddp.save, fddp.load")
        assert_trees_equal(result["pickled"], result["reference"], "torch.save, torch.load")
        assert_trees_equal(result["values"], result["reference"], "touched")
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


@pytest.mark.parametrize("name", ["decoder_adamw", "decoder_shard_state"])
def test_sharded_state_and_a_decoder_are_bitwise_too(runs, name):
    for rank, result in enumerate(runs["models"]):
        assert result[name]["finished"]
        assert_trees_equal(result[name]["overlap"], result[name]["plain"], f"{name}, rank {rank}")


def test_pending_outputs_passed_to_another_step_are_completed_first(runs):
    for result in runs["feed"]:
        assert result["pending"]
        assert_trees_equal(result["value"], result["expected"])


def test_a_pending_output_behaves_as_its_value(runs):
    for result in runs["value"]:
        assert result["meta"] == result["want_meta"]
        assert_trees_equal(result["plus_one"], result["want_plus_one"], "a + 1")
        assert result["tolist"] and result["numpy"] and result["repr"]
        assert_trees_equal(result["copied"], result["want"], "copy_ into a tensor")
        assert_trees_equal(result["added"], result["want_added"], "add_ in place")
        assert result["finished_type"] == "Tensor"


def test_overlap_steps_needs_the_fx_runner():
    with pytest.raises(ValueError, match="compile=False"):
        fddp.data_parallel(lambda x: x, compile=True, overlap_steps=True)


def test_pending_tensor_behaves_as_its_value_once_completed():
    """No public surface for a deferred tail made by hand, nor for how often it runs."""
    from fddp._ranks._pending import Deferred, PendingTensor

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
    """No public surface: nothing public makes one rank's wait of a launched collective fail."""
    from fddp._ranks._pending import Deferred, PendingTensor

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
