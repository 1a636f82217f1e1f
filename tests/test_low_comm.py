"""LocalSGD, DiLoCo and streaming DiLoCo (fddp.local_sgd, fddp.diloco) against references.

The references are written out by hand, one process simulating every rank: synchronous data
parallelism, and DiLoCo's outer step (the mean over replicas of ``outer - inner``, Nesterov
momentum ``buf = m * buf + g``, ``outer -= lr * (g + m * buf)``) on each fragment's cadence.
"""

from __future__ import annotations

import functools
import os
import tempfile

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal, max_abs_diff
from _dist import run_checks
from _models import mlp, regression_batch

import fddp
import fddp.optim as optim
from fddp._lowcomm._low_comm import Cadence, Phase, fragment_bounds, fragment_offsets

SIZES = (6, 8, 8, 3)  # 6 leaves: three weights, three biases
ROWS = 4  # per replica


def _model():
    model = mlp(SIZES)
    return fddp.functional(model), fddp.state(model)[0]


def _inner_step(inner_opt, pmean_grads=False, microbatches=0):
    """The user's step ``(params, opt_state, batch) -> (params, opt_state, loss)``; with
    ``pmean_grads`` the synchronous data-parallel step; with ``microbatches``, the gradient
    accumulated over that many slices of the batch."""
    apply, _ = _model()

    def step(params, opt_state, batch):
        def loss_fn(p, batch):
            return F.mse_loss(apply(p, {}, batch["x"]), batch["y"])

        if microbatches:
            loss, grads = fddp.accumulate_gradients(loss_fn, microbatches)(params, batch)
        else:
            loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        if pmean_grads:
            grads = fddp.pmean(grads)
        updates, opt_state = inner_opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step


def _batch(i, replica, world):
    b = regression_batch(i, ROWS * world, SIZES[0], SIZES[-1])
    return {k: v[replica * ROWS : (replica + 1) * ROWS] for k, v in b.items()}


def _run(lstep, inner_opt, steps, replica, world, state=None, params=None, opt_state=None):
    """``steps`` calls of a LowCommStep on this replica's batches; (state, params, opt_state)."""
    if params is None:
        params = _model()[1]
        opt_state = inner_opt.init(params)
        state = lstep.init(params)
    start = int(state.step)
    for i in range(start, start + steps):
        state, params, opt_state, _ = lstep(state, params, opt_state, _batch(i, replica, world))
    return state, params, opt_state


# --- hand-written references (one process, every replica) ---


def _reference(
    inner_opt, world, steps, every, *, lr=0.7, momentum=0.9, fragments=1, delay=0, average=False
):
    """DiLoCo written out: per-replica inner steps; fragment ``k``'s outer Nesterov step after
    inner steps ``c`` with ``c % every == (k + 1) * every // fragments % every`` and ``c >=
    delay``, from the replicas' parameters ``delay`` steps earlier. ``average``: LocalSGD."""
    step = _inner_step(inner_opt)
    params = _model()[1]
    names = [path[0] for path in optree.tree_paths(params)]  # optree's leaf order
    inner = [dict(params) for _ in range(world)]
    states = [inner_opt.init(params) for _ in range(world)]
    outer = {n: params[n].clone() for n in names}
    buf = {n: torch.zeros_like(params[n]) for n in names}
    sizes = [params[n].numel() for n in names]
    groups = [names[a:b] for a, b in fragment_bounds(sizes, fragments)]
    history = []
    for c in range(1, steps + 1):
        history.append([dict(p) for p in inner])  # after c - 1 inner steps
        for r in range(world):
            inner[r], states[r], _ = step(inner[r], states[r], _batch(c - 1, r, world))
        for k, group in enumerate(groups):
            if c % every != (k + 1) * every // fragments % every or c < max(delay, 1):
                continue
            source = inner if delay == 0 else history[c - delay]
            for n in group:
                if average:
                    mean = sum(p[n] for p in source) / world
                    for p in inner:
                        p[n] = mean.clone()
                    continue
                g = sum(outer[n] - p[n] for p in source) / world
                buf[n] = momentum * buf[n] + g if momentum else g
                outer[n] = outer[n] - lr * (g + momentum * buf[n] if momentum else g)
                for p in inner:
                    p[n] = outer[n].clone()
    return outer, inner


def _synchronous(inner_opt, world, steps):
    """Synchronous data parallelism written out: every replica's gradients averaged."""
    apply, params = _model()
    state = inner_opt.init(params)
    for i in range(steps):
        grads = []
        for r in range(world):
            b = _batch(i, r, world)
            grads.append(fddp.grad(lambda p, b=b: F.mse_loss(apply(p, {}, b["x"]), b["y"]))(params))
        mean = {n: sum(g[n] for g in grads) / world for n in params}
        updates, state = inner_opt.update(mean, state, params)
        params = optim.apply_updates(params, updates)
    return params


# --- checks on ranks ---


def check_every_one_is_synchronous(kind):
    inner_opt = optim.sgd(0.1)
    if kind == "local_sgd":
        lstep = fddp.local_sgd(_inner_step(inner_opt), every=1)
    else:
        lstep = fddp.diloco(_inner_step(inner_opt), every=1, outer=optim.sgd(1.0))
    _, params, _ = _run(lstep, inner_opt, 5, fddp.rank(), fddp.world_size())
    return params


def check_outer_step(inner_opt_name, every, steps, fragments=1, delay=0, comm_dtype=None):
    inner_opt = _INNER[inner_opt_name]()
    lstep = fddp.diloco(
        _inner_step(inner_opt), every=every, fragments=fragments, delay=delay, comm_dtype=comm_dtype
    )
    state, params, _ = _run(lstep, inner_opt, steps, fddp.rank(), fddp.world_size())
    return state.params, params


def check_local_sgd(every, steps):
    inner_opt = optim.sgd(0.1, momentum=0.9)
    lstep = fddp.local_sgd(_inner_step(inner_opt), every=every)
    _, params, _ = _run(lstep, inner_opt, steps, fddp.rank(), fddp.world_size())
    return params


def check_replication():
    """Inner parameters per-rank between syncs without an error, equal after one; the plan of
    each program says which outputs are replicated."""
    inner_opt = optim.sgd(0.1)
    lstep = fddp.diloco(_inner_step(inner_opt), every=3)
    rank, world = fddp.rank(), fddp.world_size()
    state, params, opt_state = _run(lstep, inner_opt, 2, rank, world)
    between = params
    inner_plan = lstep.schedule(
        state._replace(step=torch.tensor(0)), params, opt_state, _batch(0, rank, world)
    )
    state, params, opt_state = _run(lstep, inner_opt, 1, rank, world, state, params, opt_state)
    after = params
    sync_plan = lstep.schedule(
        state._replace(step=torch.tensor(2)), params, opt_state, _batch(2, rank, world)
    )
    return {
        "between": between,
        "after": after,
        "inner_collectives": len(inner_plan.collectives),
        "sync_collectives": len(sync_plan.collectives),
        "inner_replication": inner_plan.replication,
        "sync_replication": sync_plan.replication,
        "printed": str(sync_plan),
    }


def check_unsynchronized_outer_state_is_refused():
    inner_opt = optim.sgd(0.1)
    lstep = fddp.diloco(_inner_step(inner_opt), every=4)
    rank, world = fddp.rank(), fddp.world_size()
    messages = []
    for aliased in (True, False):
        state, params, opt_state = _run(lstep, inner_opt, 1, rank, world)
        wrong = state._replace(params=params)  # the per-rank inner parameters as the outer
        if not aliased:  # the same program as the last call: its replication analysis
            params = optree.tree_map(torch.clone, params)
        try:
            lstep(wrong, params, opt_state, _batch(1, rank, world))
            messages.append(None)
        except (fddp.ReplicaMismatchError, fddp.ScheduleMismatchError) as e:
            messages.append(str(e))
    return messages


def check_resume_mid_way():
    """Save after 4 of 3 + 3 + 1 inner steps, load into a fresh step object, finish: bitwise
    the uninterrupted run (inner parameters and optimizer state are saved per rank)."""
    inner_opt = optim.adamw(1e-2)
    make = functools.partial(fddp.diloco, _inner_step(inner_opt), every=3, fragments=2, delay=1)
    rank, world = fddp.rank(), fddp.world_size()
    straight = _run(make(), inner_opt, 7, rank, world)
    lstep = make()
    state, params, opt_state = _run(lstep, inner_opt, 4, rank, world)
    tree = {"state": state, "params": params, "opt": opt_state}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"ckpt-{rank}.pt")
        fddp.save(path, tree, rank0_only=False)
        fresh = make()
        params0 = _model()[1]
        like = {"state": fresh.init(params0), "params": params0, "opt": inner_opt.init(params0)}
        loaded = fddp.load(path, like=like)
    resumed = _run(
        fresh, inner_opt, 3, rank, world, loaded["state"], loaded["params"], loaded["opt"]
    )
    return straight, resumed


def check_for_vmap(fragments, delay):
    inner_opt = optim.sgd(0.1, momentum=0.9)
    lstep = fddp.diloco(_inner_step(inner_opt), every=4, fragments=fragments, delay=delay)
    state, params, _ = _run(lstep, inner_opt, 9, fddp.rank(), fddp.world_size())
    return state.params, params


def check_accumulation(microbatches):
    inner_opt = optim.adamw(1e-2)
    lstep = fddp.diloco(_inner_step(inner_opt, microbatches=microbatches), every=3)
    state, params, _ = _run(lstep, inner_opt, 7, fddp.rank(), fddp.world_size())
    return state.params, params


def check_bf16_on_the_wire():
    inner_opt = optim.sgd(0.1)
    lstep = fddp.diloco(_inner_step(inner_opt), every=2, fragments=2, comm_dtype=torch.bfloat16)
    rank, world = fddp.rank(), fddp.world_size()
    state, params, opt_state = _run(lstep, inner_opt, 4, rank, world)
    plans = [
        lstep.schedule(
            state._replace(step=torch.tensor(c)), params, opt_state, _batch(0, rank, world)
        )
        for c in (0, 1)
    ]
    return [[(c.dtype, c.nbytes) for c in p.collectives] for p in plans], state.params


_INNER = {"sgd": lambda: optim.sgd(0.1), "adamw": lambda: optim.adamw(1e-2)}

CHECKS_2 = {
    "local_sgd_every_1": functools.partial(check_every_one_is_synchronous, "local_sgd"),
    "diloco_every_1": functools.partial(check_every_one_is_synchronous, "diloco"),
    "outer_adamw_h3": functools.partial(check_outer_step, "adamw", 3, 7),
    "local_sgd_h3": functools.partial(check_local_sgd, 3, 7),
    "whole_batch": functools.partial(check_accumulation, 0),
    "accumulated": functools.partial(check_accumulation, 2),
    "streaming_f2_tau0": functools.partial(check_outer_step, "adamw", 4, 9, 2, 0),
    "streaming_f3_tau2": functools.partial(check_outer_step, "adamw", 6, 13, 3, 2),
    "streaming_f2_tau1": functools.partial(check_outer_step, "adamw", 4, 9, 2, 1),
    "streaming_f2_bf16": check_bf16_on_the_wire,
    "replication": check_replication,
    "fed_back": check_unsynchronized_outer_state_is_refused,
    "resume": check_resume_mid_way,
    "vmap_f1_tau0": functools.partial(check_for_vmap, 1, 0),
    "vmap_f2_tau2": functools.partial(check_for_vmap, 2, 2),
}
CHECKS_3 = {
    "outer_adamw_h3": functools.partial(check_outer_step, "adamw", 3, 7),
    "streaming_f2_tau1": functools.partial(check_outer_step, "adamw", 4, 9, 2, 1),
}


@pytest.fixture(scope="module")
def runs2():
    return run_checks(CHECKS_2, world_size=2, timeout=240)


@pytest.fixture(scope="module")
def runs3():
    return run_checks(CHECKS_3, world_size=3, timeout=240)


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_every_one_equals_synchronous_data_parallelism(runs2, kind):
    expected = _synchronous(optim.sgd(0.1), 2, 5)
    for params in runs2[f"{kind}_every_1"]:
        assert_trees_close(params, expected, atol=1e-6, rtol=0)
    # the deliberately wrong reference (one replica's own data, no mean) is far off
    wrong = _reference(optim.sgd(0.1), 1, 5, 1, lr=1.0, momentum=0.0)[1][0]
    assert max_abs_diff(runs2[f"{kind}_every_1"][0], wrong) > 1e-3


@pytest.mark.parametrize("world", [2, 3])
def test_outer_step_matches_the_hand_written_reference(runs2, runs3, world):
    runs = runs2 if world == 2 else runs3
    outer, inner = _reference(optim.adamw(1e-2), world, 7, 3)
    for rank, (got_outer, got_inner) in enumerate(runs["outer_adamw_h3"]):
        assert_trees_close(got_outer, outer, atol=1e-6, rtol=0)
        assert_trees_close(got_inner, inner[rank], atol=1e-6, rtol=0)
    # the deliberately wrong reference: half the outer momentum
    plain = _reference(optim.adamw(1e-2), world, 7, 3, lr=0.7, momentum=0.9 * 0.5)[0]
    assert max_abs_diff(runs["outer_adamw_h3"][0][0], plain) > 1e-4


def test_local_sgd_averages_every_h_steps(runs2):
    _, inner = _reference(optim.sgd(0.1, momentum=0.9), 2, 7, 3, average=True)
    for rank, params in enumerate(runs2["local_sgd_h3"]):
        assert_trees_close(params, inner[rank], atol=1e-6, rtol=0)
    assert max_abs_diff(runs2["local_sgd_h3"][0], runs2["local_sgd_h3"][1]) > 1e-4  # step 7


def test_an_inner_step_that_accumulates_microbatches_equals_the_whole_batch(runs2):
    """Accumulation inside the inner step is local (nothing to communicate): DiLoCo over two
    microbatches of each batch equals DiLoCo over the whole batch, outer and inner params."""
    assert_trees_close(runs2["accumulated"], runs2["whole_batch"], atol=1e-6, rtol=0)
    assert max_abs_diff(runs2["accumulated"][0][1], runs2["accumulated"][1][1]) > 1e-4


@pytest.mark.parametrize(
    ("name", "every", "steps", "fragments", "delay"),
    [
        ("streaming_f2_tau0", 4, 9, 2, 0),
        ("streaming_f3_tau2", 6, 13, 3, 2),
        ("streaming_f2_tau1", 4, 9, 2, 1),
    ],
)
def test_streaming_matches_the_fragments_cadence(runs2, name, every, steps, fragments, delay):
    outer, inner = _reference(optim.adamw(1e-2), 2, steps, every, fragments=fragments, delay=delay)
    for rank, (got_outer, got_inner) in enumerate(runs2[name]):
        assert_trees_close(got_outer, outer, atol=1e-6, rtol=0)
        assert_trees_close(got_inner, inner[rank], atol=1e-6, rtol=0)
    # wrong reference: every fragment on the non-streaming cadence (or no delay)
    wrong = _reference(optim.adamw(1e-2), 2, steps, every, fragments=1, delay=0)[0]
    assert max_abs_diff(runs2[name][0][0], wrong) > 1e-4
    if delay:
        undelayed = _reference(optim.adamw(1e-2), 2, steps, every, fragments=fragments)[0]
        assert max_abs_diff(runs2[name][0][0], undelayed) > 1e-4


def test_streaming_on_three_ranks(runs3):
    outer, inner = _reference(optim.adamw(1e-2), 3, 9, 4, fragments=2, delay=1)
    for rank, (got_outer, got_inner) in enumerate(runs3["streaming_f2_tau1"]):
        assert_trees_close(got_outer, outer, atol=1e-6, rtol=0)
        assert_trees_close(got_inner, inner[rank], atol=1e-6, rtol=0)


def test_outer_gradients_go_in_bf16_one_fragment_per_sync(runs2):
    (plans, outer), _ = runs2["streaming_f2_bf16"]
    params = _model()[1]
    sizes = [x.numel() for x in optree.tree_leaves(params)]
    # each sync also sends one bf16 per rank: which ranks' outer gradients were not finite
    fragment_bytes = [sum(sizes[a:b]) * 2 + 2 * 2 for a, b in fragment_bounds(sizes, 2)]
    # count 0 -> inner step 1 syncs fragment 0; count 1 -> inner step 2 syncs fragment 1
    assert [sum(n for _, n in p) for p in plans] == fragment_bytes
    assert {d for p in plans for d, _ in p} == {"bfloat16"}
    exact, _ = _reference(optim.sgd(0.1), 2, 4, 2, fragments=2)
    assert_trees_close(outer, exact, atol=2e-2, rtol=0)
    assert max_abs_diff(outer, exact) > 0  # it did round


def test_inner_params_are_per_rank_between_syncs_and_the_plan_says_so(runs2):
    r0, r1 = runs2["replication"]
    assert max_abs_diff(r0["between"], r1["between"]) > 1e-4  # no error although they differ
    assert_trees_equal(r0["after"], r1["after"])  # bitwise equal after the sync
    assert r0["inner_collectives"] == 0 and r0["sync_collectives"] >= 1
    inner = dict(r0["inner_replication"])
    sync = dict(r0["sync_replication"])
    assert all(how == "replicated" for path, how in inner.items() if path.startswith("[0]"))
    assert all(how.startswith("per-rank") for path, how in inner.items() if path.startswith("[1]"))
    assert all(how == "replicated" for path, how in sync.items() if path.startswith("[0]"))
    assert all(how == "replicated" for path, how in sync.items() if path.startswith("[1]"))
    assert "per-rank" in r0["printed"]  # the inner optimizer state and the loss


def test_an_unsynchronized_outer_state_fed_back_is_an_error(runs2):
    for first, later in runs2["fed_back"]:
        # passed as both arguments, it is a new signature (aliasing), whose first call
        # compares digests; otherwise the replication analysis of the previous call refuses it
        # (or the call check, which compares the values of the small replicated leaves)
        assert first is not None and "between ranks" in first and "['0.bias']" in first
        assert later is not None and "is output leaf [1]['0.bias'] of the previous call" in later


def test_resume_mid_way_through_the_inner_steps_is_bitwise(runs2):
    for straight, resumed in runs2["resume"]:
        assert_trees_equal(resumed, straight)


def _simulated(fragments, delay, replicas=2):
    inner_opt = optim.sgd(0.1, momentum=0.9)
    lstep = fddp.diloco(_inner_step(inner_opt), every=4, fragments=fragments, delay=delay)
    params = _model()[1]
    state = lstep.init(params)
    stacked = optree.tree_map(lambda x: torch.stack([x] * replicas), params)
    opt_state = optree.tree_map(lambda x: torch.stack([x] * replicas), inner_opt.init(params))
    sim = fddp.vmap(lstep, in_dims=(None, 0, 0, 0), out_dims=(None, 0, 0, 0))
    for i in range(9):
        batch = {
            k: torch.stack([_batch(i, r, replicas)[k] for r in range(replicas)]) for k in ("x", "y")
        }
        state, stacked, opt_state, _ = sim(state, stacked, opt_state, batch)
    return state, stacked


@pytest.mark.parametrize(("fragments", "delay"), [(1, 0), (2, 2)])
def test_a_simulated_run_under_vmap_equals_the_run_on_ranks(runs2, fragments, delay):
    state, stacked = _simulated(fragments, delay)
    assert int(state.step) == 9
    for rank, (outer, inner) in enumerate(runs2[f"vmap_f{fragments}_tau{delay}"]):
        assert_trees_close(state.params, outer, atol=1e-6, rtol=0)
        assert_trees_close(
            optree.tree_map(lambda x, r=rank: x[r], stacked), inner, atol=1e-6, rtol=0
        )
    wrong, _ = _simulated(fragments, delay + 1)  # the wrong reference: another delay
    assert max_abs_diff(wrong.params, runs2[f"vmap_f{fragments}_tau{delay}"][0][0]) > 1e-4


# --- single process ---


def test_cadence_of_fragments_and_delays():
    assert fragment_offsets(6, 3) == (2, 4, 0)
    s = Cadence(6, (2, 4, 0), 2)
    # fragment 0 applied after inner step 2 (c >= delay), launched from the input of count 0
    assert s.phase(0) == Phase(launch_before=(0,))
    assert s.phase(1) == Phase(apply=(0,))
    assert s.phase(2) == Phase(launch_before=(1,))
    assert s.phase(3) == Phase(apply=(1,))
    assert s.phase(4) == Phase(launch_before=(2,))
    assert s.phase(5) == Phase(apply=(2,))
    assert s.phase(6) == Phase(launch_before=(0,))
    assert Cadence(4, (0,), 0).phase(3) == Phase(launch_after=(0,))
    assert Cadence(4, (0,), 0).phase(2) == Phase()
    assert fragment_bounds([10, 1, 1, 10], 2) == ((0, 2), (2, 4))
    assert fragment_bounds([100, 1, 1], 3) == ((0, 1), (1, 2), (2, 3))
    assert fragment_bounds([1, 1, 100], 3) == ((0, 1), (1, 2), (2, 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"every": 0}, ValueError, "every=0"),
        ({"every": 4, "fragments": 5}, ValueError, "fragments=5"),
        ({"every": 4, "delay": 4}, ValueError, "0 <= delay < every=4"),
        ({"every": 4, "delay": -1}, ValueError, "delay=-1"),
        ({"every": 4, "mix": 1.0}, ValueError, "mix=1.0"),
        ({"every": 4, "outer": torch.optim.SGD}, TypeError, "is not an optimizer"),
        ({"every": 4, "comm_dtype": torch.int8}, TypeError, "floating dtype"),
        ({"every": 4, "donate_argnums": 0}, ValueError, "donate the parameters"),
    ],
)
def test_bad_options_say_what_to_do(kwargs, error, says):
    with pytest.raises(error, match=says.replace("(", r"\(").replace("[", r"\[")):
        fddp.diloco(_inner_step(optim.sgd(0.1)), **kwargs)


def test_more_fragments_than_leaves_is_an_error():
    dstep = fddp.diloco(_inner_step(optim.sgd(0.1)), every=8, fragments=7)
    with pytest.raises(ValueError, match=r"params has 6 leaves.*fragments <= 6"):
        dstep.init(_model()[1])


def test_local_sgd_rejects_every_below_one():
    with pytest.raises(ValueError, match="every=0"):
        fddp.local_sgd(_inner_step(optim.sgd(0.1)), every=0)


def test_a_step_that_does_not_return_params_first_is_an_error():
    dstep = fddp.diloco(lambda p, o, b: (o, p, 0.0), every=2)
    params = _model()[1]
    with pytest.raises(fddp.CaptureError, match="first output must be the new parameters"):
        dstep(dstep.init(params), params, (torch.zeros(1),), _batch(0, 0, 1))
