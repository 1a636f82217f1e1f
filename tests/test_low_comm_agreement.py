"""fddp.diloco and fddp.local_sgd agree across ranks on what they were built with and on their
replicated state, match trees by path, and refuse a NaN at a sync instead of spreading it.

Each check runs a tiny DiLoCo on 2 gloo ranks with one thing made to differ; the references
are test_low_comm's hand-written DiLoCo (Algorithm 1) and the same run with nothing changed.
"""

from __future__ import annotations

import collections
import functools

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from _dist import run_checks
from test_low_comm import _batch, _inner_step, _model, _reference

import fddp
import fddp.optim as optim
from fddp._base._errors import UsageValueError

# --- checks on ranks ---


def _first_call_error(**per_rank):
    """Build DiLoCo with ``per_rank`` options (each a pair: rank 0's value, rank 1's) and call
    it once; the error message, or None if the call ran."""
    rank = fddp.rank()
    options = {
        name: values[rank] if isinstance(values, tuple) else values
        for name, values in per_rank.items()
    }
    if "outer" in options:  # (lr, momentum)
        options["outer"] = optim.sgd(options["outer"][0], momentum=options["outer"][1])
    inner_opt = optim.sgd(0.1)
    dstep = fddp.diloco(_inner_step(inner_opt), **options)
    params = _model()[1]
    try:
        dstep(dstep.init(params), params, inner_opt.init(params), _batch(0, rank, 2))
    except fddp.ScheduleMismatchError as e:
        return str(e)
    return None


def check_corrupted_state():
    """Every phase compiled, then rank 1's outer parameters changed by 1e-3: the next call
    refuses it on every rank and leaves the caller's state as it was."""
    rank = fddp.rank()
    inner_opt = optim.sgd(0.1)
    dstep = fddp.diloco(_inner_step(inner_opt), every=2)
    params = _model()[1]
    state, opt_state = dstep.init(params), inner_opt.init(params)
    for i in range(3):  # both phases compiled and run; inner step 3 done, no sync in it
        state, params, opt_state, _ = dstep(state, params, opt_state, _batch(i, rank, 2))
    if rank == 1:
        changed = state.params["2.weight"] + 1e-3  # 64 elements: not among the small leaves
        state = state._replace(params={**state.params, "2.weight": changed})
    before = optree.tree_map(torch.clone, state)
    try:
        dstep(state, params, opt_state, _batch(3, rank, 2))
    except fddp.ReplicaMismatchError as e:
        return str(e), state, before
    return None, state, before


def check_nonfinite_worker(delay):
    """Rank 1's batch of inner step 3 is NaN: the sync after inner step 4 raises on every rank,
    naming rank 1, and nothing was applied."""
    rank = fddp.rank()
    inner_opt = optim.sgd(0.1)
    dstep = fddp.diloco(_inner_step(inner_opt), every=2, delay=delay)
    params = _model()[1]
    state, opt_state = dstep.init(params), inner_opt.init(params)
    for i in range(4):
        batch = _batch(i, rank, 2)
        if i == 2 and rank == 1:
            batch = {**batch, "x": torch.full_like(batch["x"], float("nan"))}
        try:
            state, params, opt_state, _ = dstep(state, params, opt_state, batch)
        except FloatingPointError as e:
            return str(e), i, state
    return None, None, state


def check_local_sgd_nonfinite_worker():
    rank = fddp.rank()
    inner_opt = optim.sgd(0.1)
    lstep = fddp.local_sgd(_inner_step(inner_opt), every=2)
    params = _model()[1]
    state, opt_state = lstep.init(params), inner_opt.init(params)
    for i in range(2):
        batch = _batch(i, rank, 2)
        if rank == 0 and i == 1:
            batch = {**batch, "y": torch.full_like(batch["y"], float("inf"))}
        try:
            state, params, opt_state, _ = lstep(state, params, opt_state, batch)
        except FloatingPointError as e:
            return str(e), params
    return None, params


CHECKS = {
    "outer_lr": functools.partial(_first_call_error, every=2, outer=((0.7, 0.9), (0.5, 0.9))),
    "outer_momentum": functools.partial(_first_call_error, every=2, outer=((0.7, 0.9), (0.7, 0.8))),
    "mix": functools.partial(_first_call_error, every=2, delay=(1, 1), mix=(0.5, 0.25)),
    "fragments": functools.partial(_first_call_error, every=2, fragments=(1, 2)),
    "every": functools.partial(_first_call_error, every=(2, 3)),
    "delay": functools.partial(_first_call_error, every=3, delay=(0, 1)),
    "corrupted_state": check_corrupted_state,
    "nan_delay_0": functools.partial(check_nonfinite_worker, 0),
    "nan_delay_1": functools.partial(check_nonfinite_worker, 1),
    "local_sgd_inf": check_local_sgd_nonfinite_worker,
}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, world_size=2, timeout=240)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (
            "outer_lr",
            "option outer.transforms[2].step_size is -0.5 (-0x1.0000000000000p-1) on "
            "rank 1 but -0.7 (-0x1.6666666666666p-1) on rank 0",
        ),
        (
            "outer_momentum",
            "option outer.transforms[1].decay is 0.8 (0x1.999999999999ap-1) on "
            "rank 1 but 0.9 (0x1.ccccccccccccdp-1) on rank 0",
        ),
        (
            "mix",
            "option mix is 0.25 (0x1.0000000000000p-2) on rank 1 but 0.5 "
            "(0x1.0000000000000p-1) on rank 0",
        ),
        ("fragments", "option fragments is 2 on rank 1 but 1 on rank 0"),
        ("every", "option every is 3 on rank 1 but 2 on rank 0"),
        ("delay", "option delay is 1 on rank 1 but 0 on rank 0"),
    ],
)
def test_per_rank_options_are_refused_naming_the_option(runs, name, says):
    for message in runs[name]:
        assert message is not None and says in message, message


def test_a_state_changed_on_one_rank_after_compiling_is_refused_at_the_next_call(runs):
    for rank, (message, state, before) in enumerate(runs["corrupted_state"]):
        assert message is not None, f"rank {rank} ran on"
        assert "params['2.weight'] is float32 [8, 8] with digest" in message, message
        assert "on rank 1 but" in message and "call 4" in message, message
        assert_trees_equal(state, before)  # the caller's state is untouched


def test_a_nan_in_one_worker_raises_on_every_rank_naming_it(runs):
    for delay in (0, 1):
        outer, _ = _reference(optim.sgd(0.1), 2, 2, 2, delay=delay)  # the last sync that ran
        for message, call, state in runs[f"nan_delay_{delay}"]:
            assert message is not None and "rank 1 held NaN or Inf at outer step 2" in message
            assert "synchronization after inner step 4" in message
            # delay 0 takes the outer gradient after the inner step of call 4; delay 1 from
            # the parameters call 4 starts from, after the NaN inner step 3
            assert call == 3
            assert int(state.step) == 3
            assert_trees_close(state.params, outer, atol=1e-6, rtol=0)  # finite, as before


def test_local_sgd_refuses_an_inf_in_one_worker(runs):
    for message, params in runs["local_sgd_inf"]:
        assert message is not None and "parameters of rank 0 held NaN or Inf" in message
        assert all(torch.isfinite(x).all() for x in optree.tree_leaves(params))


# --- single process: trees matched by path ---


def _run(params, steps=4, every=2, fragments=2):
    inner_opt = optim.sgd(0.1)
    dstep = fddp.diloco(_inner_step(inner_opt), every=every, fragments=fragments)
    state, opt_state = dstep.init(_model()[1]), inner_opt.init(params)
    for i in range(steps):
        state, params, opt_state, _ = dstep(state, params, opt_state, _batch(i, 0, 1))
    return state, params


def test_params_in_another_key_order_are_matched_by_key():
    params = _model()[1]
    reordered = collections.OrderedDict(reversed(list(params.items())))
    assert list(optree.tree_paths(reordered)) != list(optree.tree_paths(params))
    state, inner = _run(reordered)
    assert list(inner) == list(reordered)  # the caller's order comes back
    outer, expected = _reference(optim.sgd(0.1), 1, 4, 2, fragments=2)
    assert_trees_close(state.params, outer, atol=1e-6, rtol=0)
    assert_trees_close(dict(inner), expected[0], atol=1e-6, rtol=0)
    assert_trees_equal(_run(params), (state, dict(inner)))


def _generic_step(params, x):
    loss = sum(((x * p.sum()) ** 2).mean() for p in optree.tree_leaves(params))
    grads = fddp.grad(lambda p: sum(((x * q.sum()) ** 2).mean() for q in optree.tree_leaves(p)))(
        params
    )
    return optim.apply_updates(params, optree.tree_map(lambda g: -0.1 * g, grads)), loss


@pytest.mark.parametrize(
    ("passed", "says"),
    [
        (
            {"a": torch.ones(4), "c": torch.ones(2)},
            r"the parameters lack \['b'\] and have \['c'\]",
        ),
        ({"a": torch.ones(1), "b": torch.ones(2)}, r"leaf \['a'\] is float32 \[1\].*float32 \[4\]"),
        (
            {"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(2)},
            r"leaf \['a'\] is float64 \[4\].*float32 \[4\]",
        ),
    ],
)
def test_params_that_do_not_match_the_state_by_path_are_refused(passed, says):
    dstep = fddp.diloco(_generic_step, every=1, outer=optim.sgd(1.0))
    state = dstep.init({"a": torch.ones(4), "b": torch.ones(2)})
    with pytest.raises(UsageValueError, match=says):
        dstep(state, passed, torch.ones(3))


# --- the slow-network guide's simulation under fddp.vmap ---


def test_the_readme_vmap_call_simulates_the_ranks():
    apply, params = _model()
    opt = optim.sgd(0.1)

    def inner_step(params, opt_state, x, y):  # docs/guides/slow-network.md
        loss, grads = fddp.value_and_grad(lambda p: F.mse_loss(apply(p, {}, x), y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    step = fddp.diloco(inner_step, every=2)
    state = step.init(params)
    stacked = optree.tree_map(lambda p: torch.stack([p, p]), params)
    opt_state = opt.init(stacked)
    sim = fddp.vmap(step, in_dims=(None, 0, 0, 0, 0), out_dims=(None, 0, 0, 0))
    for i in range(4):
        batches = [_batch(i, r, 2) for r in range(2)]
        x, y = (torch.stack([b[k] for b in batches]) for k in ("x", "y"))
        state, stacked, opt_state, _ = sim(state, stacked, opt_state, x, y)
    outer, inner = _reference(optim.sgd(0.1), 2, 4, 2)
    assert_trees_close(state.params, outer, atol=1e-6, rtol=0)
    for r in range(2):
        assert_trees_close(
            optree.tree_map(lambda p, r=r: p[r], stacked), inner[r], atol=1e-6, rtol=0
        )
