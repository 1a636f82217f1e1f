"""More ranks: data_parallel, uneven batches, sharded optimizer state and the agreement checks on
4 and 8 gloo ranks.

This machine has 2 cores, so 8 ranks are oversubscribed: these tests check answers, not speed.
Each world size is one spawn running every check below in order (a tiny MLP, explicit bucket
caps so that no rank measures the link); every rank computes its single-process reference on
the global batch itself and returns both trees, which the tests compare leaf by leaf:

- the data-parallel AdamW step equals one process on the global batch (to ~1e-6);
- an epoch whose global batches do not divide by the world size (``shard_batches``,
  ``lockstep``, ``pad_rows``, ``weighted_pmean``; the last batch leaves some ranks empty)
  equals one process on the whole dataset;
- ``fddp.optim.shard_state`` (ZeRO) on leaves of 35, 7, 21 and 3 elements (none divides by 4 or
  8) equals the replicated run;
- a rank with another batch shape, or another non-tensor argument, gets the error naming that
  rank and the leaf, on every rank, at once;
- after every run the parameters and optimizer state are bitwise the same on all ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_ranks_equal, assert_trees_close, detached
from _dist import run_checks
from _models import mlp, regression_batch

import fddp
import fddp.optim as optim
from fddp.data import lockstep, pad_rows, shard_batches, weighted_pmean

WORLD_SIZES = (4, 8)
SIZES = (5, 7, 3)  # leaves of 35, 7, 21 and 3 elements: none divides by 4 or 8
STEPS = 3
ROWS = 3  # rows per rank in a full step
TOL = {"rtol": 1e-6, "atol": 1e-6}
CAPS = {"bucket_cap_mb": 100 / 2**20, "first_bucket_cap_mb": 50 / 2**20}  # several buckets
TINY_BUCKETS = 40 / 2**20  # ZeRO's buckets: 10 floats each, uneven over 4 and 8
SPAWN_TIMEOUT_S = 300  # 8 ranks on 2 cores, each tracing its steps: generous


def _adamw():
    return optim.adamw(1e-2, weight_decay=0.1)


def _loss_fn():
    apply = fddp.functional(mlp(SIZES))

    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, {}, x), y)

    return loss_fn


def _params():
    return fddp.state(mlp(SIZES))[0]


def _global_batch(step: int) -> dict:
    return regression_batch(step, ROWS * fddp.world_size(), SIZES[0], SIZES[-1])


def _make_step(opt, reduce):
    """``step(params, opt_state, x, y)``; ``reduce`` is ``fddp.pmean``, or the identity for the
    single-process reference on the global batch."""
    loss_fn = _loss_fn()

    def step(params, opt_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(reduce(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, reduce(loss)

    return step


def _reference(opt, batches) -> dict:
    """One process on the global batches, on this rank."""
    step = _make_step(opt, lambda tree: tree)
    params = _params()
    state = opt.init(params)
    for batch in batches:
        params, state, _ = step(params, state, batch["x"], batch["y"])
    return {"params": detached(params), "opt": detached(state)}


# --- (1) the data-parallel step against one process on the global batch ---------------------


def check_equals_global_batch() -> dict:
    opt = _adamw()
    pstep = fddp.data_parallel(_make_step(opt, fddp.pmean), **CAPS)
    params = _params()
    state = opt.init(params)
    batches = [_global_batch(s) for s in range(STEPS)]
    for batch in batches:
        mine = fddp.shard(batch)
        params, state, _ = pstep(params, state, mine["x"], mine["y"])
    buckets = len(pstep.schedule(params, state, mine["x"], mine["y"]).collectives)
    return {
        "got": {"params": detached(params), "opt": detached(state)},
        "want": _reference(opt, batches),
        "buckets": buckets,
        "retraces": pstep.retraces,
    }


# --- (2) uneven shards: a dataset that does not divide by the world size --------------------


def _dataset_sizes(n: int) -> dict[str, int]:
    """Two full global batches, then a last one of n + 3 rows (every rank has one or two) or of
    n - 3 rows (the last three ranks have none)."""
    return {"n+3": 2 * ROWS * n + n + 3, "n-3": 2 * ROWS * n + n - 3}


def _data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + samples)
    return torch.randn(samples, SIZES[0], generator=g), torch.randn(samples, SIZES[-1], generator=g)


def check_uneven_epochs() -> dict:
    opt = _adamw()
    apply = fddp.functional(mlp(SIZES))

    def masked_loss(params, x, y, mask):
        per_row = ((apply(params, {}, x) - y) ** 2).mean(1)
        return (per_row * mask).sum() / mask.sum().clamp(min=1)

    @functools.partial(fddp.data_parallel, **CAPS)
    def step(params, opt_state, x, y, mask):
        loss, grads = fddp.value_and_grad(masked_loss)(params, x, y, mask)
        rows = mask.sum()
        updates, opt_state = opt.update(weighted_pmean(grads, rows), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, weighted_pmean(loss, rows)

    n = fddp.world_size()
    out = {}
    for name, samples in _dataset_sizes(n).items():
        data_x, data_y = _data(samples)
        params = _params()
        state = opt.init(params)
        rows = []
        for idx in lockstep(shard_batches(samples, ROWS)):
            (x, y), mask = pad_rows((data_x[idx], data_y[idx]), ROWS)
            params, state, _ = step(params, state, x, y, mask)
            rows.append(len(idx))
        global_batch = ROWS * n  # without shuffle, global batch t is rows [t*R*n, (t+1)*R*n)
        batches = [
            {"x": data_x[s : s + global_batch], "y": data_y[s : s + global_batch]}
            for s in range(0, samples, global_batch)
        ]
        out[name] = {
            "rows": rows,
            "got": {"params": detached(params), "opt": detached(state)},
            "want": _reference(opt, batches),
        }
    out["retraces"] = step.retraces
    return out


# --- (3) sharded optimizer state on leaves that do not divide by the world size -------------


def check_sharded_state() -> dict:
    """ZeRO's AdamW against the replicated AdamW, both data-parallel on the same shards."""
    inner = _adamw()
    sharded = optim.shard_state(inner, bucket_cap_mb=TINY_BUCKETS)
    loss_fn = _loss_fn()

    def step(params, opt_state, x, y):  # shard_state reduces the gradients itself
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = sharded.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    replicated = fddp.data_parallel(_make_step(inner, fddp.pmean), **CAPS)
    zero = fddp.data_parallel(step, **CAPS)
    init = fddp.data_parallel(sharded.init, trace=False)  # init binds the axis: a data_parallel
    params = want = _params()
    state, want_state = init(params), inner.init(params)
    for s in range(STEPS):
        mine = fddp.shard(_global_batch(s))
        params, state, _ = zero(params, state, mine["x"], mine["y"])
        want, want_state, _ = replicated(want, want_state, mine["x"], mine["y"])
    full = optim.state_bytes(inner.init(params))
    return {
        "got": detached(params),
        "want": detached(want),
        "state": detached(state),
        "bytes": (optim.state_bytes(state), full),
        "pieces": tuple(state.pieces.shape),
    }


# --- (4) the agreement checks: a rank that differs gets the error on every rank -------------


def _outcome(call) -> dict:
    try:
        call()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


def _odd_rank() -> int:
    """The rank that differs: neither the first nor the last."""
    return fddp.world_size() - 3


def check_shape_differs_on_one_rank() -> dict:
    """A cached step, then one rank's batch has a row more: refused before anything runs."""
    opt = optim.sgd(0.1)
    pstep = fddp.data_parallel(_make_step(opt, fddp.pmean), **CAPS)
    params = _params()
    state = opt.init(params)
    mine = fddp.shard(_global_batch(0))
    params, state, _ = pstep(params, state, mine["x"], mine["y"])
    rows = ROWS + (fddp.rank() == _odd_rank())
    x = torch.ones(rows, SIZES[0])
    y = torch.ones(rows, SIZES[-1])
    out = _outcome(lambda: pstep(params, state, x, y))
    out["after"] = _outcome(lambda: pstep(params, state, mine["x"], mine["y"]))  # still in step
    return out


def check_static_argument_differs_on_one_rank() -> dict:
    """A Python float (compiled in as a constant) that one rank alone passes otherwise."""
    loss_fn = _loss_fn()

    def step(params, x, y, lr):
        grads = fddp.pmean(fddp.grad(loss_fn)(params, x, y))
        return {k: params[k] - lr * grads[k] for k in params}

    pstep = fddp.data_parallel(step, **CAPS)
    mine = fddp.shard(_global_batch(0))
    lr = 0.25 if fddp.rank() == _odd_rank() else 0.1
    return _outcome(lambda: pstep(_params(), mine["x"], mine["y"], lr))


def check_static_argument_differs_on_two_ranks_eagerly() -> dict:
    """trace=False: the same agreement; of two ranks that differ, the first is named."""
    loss_fn = _loss_fn()

    def step(params, x, y, lr):
        grads = fddp.pmean(fddp.grad(loss_fn)(params, x, y))
        return {k: params[k] - lr * grads[k] for k in params}

    pstep = fddp.data_parallel(step, trace=False)
    mine = fddp.shard(_global_batch(0))
    lr = 0.25 if fddp.rank() in (_odd_rank(), fddp.world_size() - 1) else 0.1
    return _outcome(lambda: pstep(_params(), mine["x"], mine["y"], lr))


def check_bucket_cap_differs_on_one_rank() -> dict:
    """test_agreement's option check: another bucket cap on one rank of many."""
    opt = optim.sgd(0.1)
    cap = 5.0 if fddp.rank() == _odd_rank() else CAPS["bucket_cap_mb"]
    pstep = fddp.data_parallel(_make_step(opt, fddp.pmean), bucket_cap_mb=cap)
    params = _params()
    mine = fddp.shard(_global_batch(0))
    return _outcome(lambda: pstep(params, opt.init(params), mine["x"], mine["y"]))


def check_replica_differs_on_one_rank() -> dict:
    """One rank's copy of one parameter is off by one ulp: the digests catch it."""
    opt = optim.sgd(0.1)
    pstep = fddp.data_parallel(_make_step(opt, fddp.pmean), **CAPS)
    params = _params()
    if fddp.rank() == _odd_rank():
        params["2.bias"] = torch.nextafter(params["2.bias"], torch.full_like(params["2.bias"], 9))
    mine = fddp.shard(_global_batch(0))
    return _outcome(lambda: pstep(params, opt.init(params), mine["x"], mine["y"]))


CHECKS = {
    "global_batch": check_equals_global_batch,
    "uneven": check_uneven_epochs,
    "sharded": check_sharded_state,
    "shape": check_shape_differs_on_one_rank,
    "static": check_static_argument_differs_on_one_rank,
    "static_eager": check_static_argument_differs_on_two_ranks_eagerly,
    "bucket_cap": check_bucket_cap_differs_on_one_rank,
    "replica": check_replica_differs_on_one_rank,
}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def runs(request):
    return request.param, run_checks(CHECKS, request.param, timeout=SPAWN_TIMEOUT_S)


def test_data_parallel_equals_one_process_on_the_global_batch(runs):
    n, results = runs
    for rank, out in enumerate(results["global_batch"]):
        assert_trees_close(out["got"], out["want"], **TOL, what=f"{n} ranks, rank {rank}")
        assert out["buckets"] >= 2 and out["retraces"] == 0, out


def test_uneven_epochs_equal_one_process_on_the_whole_dataset(runs):
    n, results = runs
    ranks = results["uneven"]
    last = {"n+3": [2] * 3 + [1] * (n - 3), "n-3": [1] * (n - 3) + [0] * 3}
    for name, samples in _dataset_sizes(n).items():
        assert [r[name]["rows"][-1] for r in ranks] == last[name], name
        assert all(r[name]["rows"][:-1] == [ROWS, ROWS] for r in ranks), name
        assert sum(sum(r[name]["rows"]) for r in ranks) == samples  # every sample, once
        for rank, r in enumerate(ranks):
            what = f"{n} ranks, dataset {name}, rank {rank}"
            assert_trees_close(r[name]["got"], r[name]["want"], **TOL, what=what)
    assert [r["retraces"] for r in ranks] == [0] * n  # padded: one program


def test_sharded_state_on_uneven_leaves_equals_the_replicated_run(runs):
    n, results = runs
    for rank, out in enumerate(results["sharded"]):
        assert_trees_close(out["got"], out["want"], **TOL, what=f"{n} ranks, rank {rank}")
        sharded, full = out["bytes"]
        assert sharded < full / n * 1.1 + 400, (rank, out["bytes"])
        assert out["pieces"][0] >= 2, out["pieces"]  # several buckets


@pytest.mark.parametrize("check", ["global_batch", "uneven", "sharded"])
def test_replicas_stay_bitwise_identical_on_every_rank(runs, check):
    n, results = runs
    if check == "uneven":
        trees = [{k: out[k]["got"] for k in ("n+3", "n-3")} for out in results[check]]
    else:  # params and AdamW state; sharded: the params (each rank holds its own state shard)
        trees = [out["got"] for out in results[check]]
    assert len(trees) == n
    assert_ranks_equal(trees, f"{check} on {n} ranks")


def test_a_rank_with_another_shape_gets_the_error_naming_it_on_every_rank(runs):
    n, results = runs
    outs = results["shape"]
    assert len(outs) == n
    odd = n - 3
    for rank, out in enumerate(outs):
        assert out["error"] == "ScheduleMismatchError", (rank, out)
        message = out["message"]
        assert "ranks were called with different arguments" in message, message
        assert f"argument leaf [2] is torch.float32 [{ROWS + 1}, {SIZES[0]}]" in message, message
        assert f"on rank {odd} but torch.float32 [{ROWS}, {SIZES[0]}]" in message, message
        assert out["after"]["error"] is None, (rank, out["after"])  # the next call runs
    assert results.seconds()["shape"] < 60  # no rank waited for a timeout


def test_a_rank_with_another_non_tensor_argument_gets_the_error_naming_it_on_every_rank(runs):
    n, results = runs
    outs = results["static"]
    assert len(outs) == n
    for rank, out in enumerate(outs):
        assert out["error"] == "ScheduleMismatchError", (rank, out)
        message = out["message"]
        assert f"argument leaf [3] is float 0.25 on rank {n - 3} but float 0.1" in message, message
    assert results.seconds()["static"] < 60


def test_of_two_ranks_that_differ_the_first_is_named_on_every_rank_eagerly(runs):
    n, results = runs
    outs = results["static_eager"]
    assert len(outs) == n
    for rank, out in enumerate(outs):
        assert out["error"] == "ScheduleMismatchError", (rank, out)
        message = out["message"]
        assert f"argument leaf [3] is float 0.25 on rank {n - 3} but float 0.1" in message, message


def test_a_rank_that_built_the_step_with_another_bucket_cap_is_named_on_every_rank(runs):
    n, results = runs
    for rank, out in enumerate(results["bucket_cap"]):
        assert out["error"] == "ScheduleMismatchError", (rank, out)
        expected = f"ranks built the step differently: option bucket_cap_mb is 5.0 on rank {n - 3}"
        assert expected in out["message"], out["message"]


def test_a_rank_whose_replica_differs_by_one_ulp_is_named_with_the_leaf_on_every_rank(runs):
    n, results = runs
    for rank, out in enumerate(results["replica"]):
        assert out["error"] == "ReplicaMismatchError", (rank, out)
        assert "['2.bias']" in out["message"], out["message"]
        assert f"on rank {n - 3} but" in out["message"], out["message"]
