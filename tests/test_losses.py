"""Losses over tokens and over ranks: a per-example mean, a masked token mean (fddp.Loss.mean)
and a sum (fddp.Loss.sum) give the value and gradient of one process on the global batch, on
1-4 ranks, with and without accumulation, uneven shards, fddp.vmap replicas; bitwise the same
on every world size in the invariant mode (docs/guides/losses.md)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal, max_abs_diff, one_thread
from _dist import run_world_sizes
from torch import nn

import fddp
from fddp._base._errors import UsageValueError

VOCAB, DIM, LENGTH = 13, 6, 5
GLOBAL = 12  # rows per step: 12, 6, 4, 3 per rank on 1-4 ranks
UNEVEN = 10  # rows split 5+5, 4+3+3, 3+3+2+2: padded to the largest shard
MICRO = 3  # microbatches, when accumulating
CHUNK = 1  # the invariant mode's chunk: every world size holds whole chunks


def _model() -> tuple[dict, dict, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))
    params, buffers = fddp.state(net)
    return params, buffers, fddp.functional(net)


def _batch(rows: int = GLOBAL) -> dict[str, torch.Tensor]:
    """Token ids, next tokens and a mask of valid tokens: each row keeps 1 to LENGTH tokens,
    so ranks hold different numbers of tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (rows, LENGTH + 1), generator=g)
    valid = torch.randint(1, LENGTH + 1, (rows, 1), generator=g)
    mask = (torch.arange(LENGTH) < valid).long()
    return {"x": ids[:, :-1], "y": ids[:, 1:], "mask": mask, "row": torch.ones(rows)}


def _per_token(apply, params, buffers, batch) -> torch.Tensor:
    logits = apply(params, buffers, batch["x"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    return losses.view(batch["y"].shape) * batch["mask"]


def _per_example(apply, params, buffers, batch) -> torch.Tensor:
    """Each row's mean over its valid tokens (0 for a padding row)."""
    return _per_token(apply, params, buffers, batch).sum(1) / batch["mask"].sum(1).clamp(min=1)


# The losses as a step writes them (fddp) and as one process computes them on the global batch.
def example_mean(apply, params, buffers, batch):
    return _per_example(apply, params, buffers, batch).mean()


def token_mean(apply, params, buffers, batch):
    return fddp.Loss.mean(_per_token(apply, params, buffers, batch).sum(), batch["mask"].sum())


def token_sum(apply, params, buffers, batch):
    return fddp.Loss.sum(_per_token(apply, params, buffers, batch).sum())


def row_mean(apply, params, buffers, batch):
    """The per-example mean over padded rows (fddp.data.pad_rows's mask): as an fddp.Loss."""
    per_row = _per_example(apply, params, buffers, batch) * batch["row"]
    return fddp.Loss.mean(per_row.sum(), batch["row"].sum())


def scalar_token_mean(apply, params, buffers, batch):
    """The masked token mean as a scalar: each rank's own mean, averaged (what DDP gives)."""
    return token_mean(apply, params, buffers, batch).value()


LOSSES = {"example mean": example_mean, "token mean": token_mean, "sum": token_sum}
REFERENCE = {
    "example mean": lambda *a: _per_example(*a).mean(),
    "token mean": lambda apply, p, b, batch: (
        _per_token(apply, p, b, batch).sum() / batch["mask"].sum()
    ),
    "sum": lambda *a: _per_token(*a).sum(),
}


def _one_process(name: str, rows: int = GLOBAL) -> tuple[torch.Tensor, dict]:
    """The loss and its gradient on the global batch, plain torch.func on one process."""
    params, buffers, apply = _model()
    batch = _batch(rows)
    loss_fn = functools.partial(REFERENCE[name], apply)
    loss, grads = torch.func.grad_and_value(loss_fn)(params, buffers, batch)[::-1]
    return loss, grads


def _step(loss_fn, micro: int):
    params, buffers, apply = _model()
    bound = functools.partial(loss_fn, apply)
    grad = fddp.value_and_grad(bound) if micro == 1 else fddp.accumulate_gradients(bound, micro)

    def step(params, buffers, batch):
        loss, grads = grad(params, buffers, batch)
        return fddp.pmean(loss), fddp.pmean(grads)

    return step, params, buffers


def _run(loss_fn, micro: int = 1, invariant: int | None = None) -> tuple[torch.Tensor, dict]:
    """One step on this rank's shard of the global batch: the loss and gradient it returns."""
    step, params, buffers = _step(loss_fn, micro)
    local = fddp.shard(_batch())
    return fddp.data_parallel(step, invariant=invariant)(params, buffers, local)


def _run_uneven(loss_fn) -> tuple[torch.Tensor, dict]:
    """The last, smaller global batch: shards of different sizes, padded to one shape."""
    step, params, buffers = _step(loss_fn, 1)
    shard = fddp.shard(_batch(UNEVEN), uneven=True)
    padded, mask = fddp.data.pad_rows(shard, -(-UNEVEN // fddp.world_size()))
    padded["row"] = mask
    return fddp.data_parallel(step)(params, buffers, padded)


def _checks(world: int) -> dict:
    checks = {}
    for name, loss_fn in LOSSES.items():
        for micro in (1, MICRO):
            for invariant in (None, CHUNK):
                mode = "invariant" if invariant else "default"
                run = functools.partial(_run, loss_fn, micro, invariant)
                checks[f"{name}, {mode}, {micro} microbatches"] = run
    for name, loss_fn in {"token mean": token_mean, "sum": token_sum}.items():
        checks[f"{name}, uneven"] = functools.partial(_run_uneven, loss_fn)
    checks["example mean, uneven"] = functools.partial(_run_uneven, row_mean)
    checks["token mean as a scalar"] = functools.partial(_run, scalar_token_mean)
    return checks


@pytest.fixture(scope="module")
def runs() -> dict[int, Mapping[str, list]]:
    return run_world_sizes(_checks, in_process=one_thread(), timeout=300)


def _close(found, reference, what: str) -> None:
    """To float rounding: each leaf within a few float32 ulps of its largest entry."""
    loss, grads = found
    assert_trees_close(loss, reference[0], rtol=2e-6, atol=0, what=what)
    for key, ref in reference[1].items():
        scale = float(ref.abs().max())
        assert_trees_close(grads[key], ref, rtol=0, atol=2e-6 * scale, what=f"{what} {key}")


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_is_one_process_on_the_global_batch(runs, name):
    reference = _one_process(name)
    for world in (1, 2, 3, 4):
        for mode in ("default", "invariant"):
            for micro in (1, MICRO):
                for rank, found in enumerate(runs[world][f"{name}, {mode}, {micro} microbatches"]):
                    _close(found, reference, f"{name}, {world} ranks ({rank}), {mode}, {micro}")


@pytest.mark.parametrize("name", list(LOSSES))
def test_invariant_mode_is_bitwise_the_same_on_every_world_size(runs, name):
    one = runs[1][f"{name}, invariant, 1 microbatches"][0]
    for world in (1, 2, 3, 4):
        for micro in (1, MICRO):
            for rank, found in enumerate(runs[world][f"{name}, invariant, {micro} microbatches"]):
                assert_trees_equal(found, one, what=f"{name}, {world} ranks ({rank}), {micro}")


@pytest.mark.parametrize("name", list(LOSSES))
def test_uneven_shards_padded_are_one_process_on_the_global_batch(runs, name):
    reference = _one_process(name, UNEVEN)
    for world in (3, 4):
        for rank, found in enumerate(runs[world][f"{name}, uneven"]):
            _close(found, reference, f"{name}, uneven on {world} ranks ({rank})")


def test_a_scalar_token_mean_is_a_mean_of_rank_means(runs):
    """What the rows above guard against: the token mean written as a scalar is each rank's
    own mean, averaged, which is not the global token mean when ranks hold other counts."""
    reference = _one_process("token mean")
    _close(runs[1]["token mean as a scalar"][0], reference, "one rank")
    found = runs[3]["token mean as a scalar"][0]
    assert max_abs_diff(found[1], reference[1]) > 1e-3 * float(reference[1]["2.weight"].abs().max())


@pytest.mark.parametrize("name", list(LOSSES))
def test_vmap_replicas_are_the_ranks(runs, name):
    """fddp.vmap's replicas give what as many ranks give: bitwise in the invariant mode."""
    reference = _one_process(name)
    for replicas in (1, 2, 3, 4):
        for invariant in (None, CHUNK):
            step, params, buffers = _step(LOSSES[name], MICRO)
            batch = {k: v.unflatten(0, (replicas, -1)) for k, v in _batch().items()}
            sim = fddp.vmap(step, in_dims=(None, None, 0), out_dims=None, invariant=invariant)
            with one_thread():
                found = sim(params, buffers, batch)
            _close(found, reference, f"{name}, vmap x{replicas}, invariant={invariant}")
            if invariant:
                one = runs[1][f"{name}, invariant, 1 microbatches"][0]
                assert_trees_equal(found, one, what=f"{name}, vmap x{replicas}")


def test_comm_dtype_casts_the_sums_not_the_token_count():
    """bfloat16 holds 1001 as 1000: the count's all-reduce keeps its integer dtype (the total,
    1024, is exact in bfloat16)."""
    total = torch.tensor(1024.0)

    def step(w, count):
        loss, grad = fddp.value_and_grad(lambda w: fddp.Loss.mean(total * w, count))(w)
        return fddp.pmean(loss), fddp.pmean(grad)

    pstep = fddp.data_parallel(step, comm_dtype=torch.bfloat16)
    assert_trees_equal(pstep(torch.tensor(1.0), torch.tensor(1001)), (total / 1001,) * 2)


def test_loss_outside_a_step_is_of_its_own_batch_and_bad_input_names_the_fix():
    params, buffers, apply = _model()
    batch = _batch()
    loss, grads = fddp.value_and_grad(functools.partial(token_mean, apply))(params, buffers, batch)
    _close((loss, grads), _one_process("token mean"), "outside a step")
    with pytest.raises(TypeError, match="0-d tensor"):
        fddp.Loss.mean(torch.ones(3), 2)
    with pytest.raises(ValueError, match=r"Loss\.sum"):
        fddp.Loss.mean(torch.tensor(1.0), None)
    with pytest.raises(TypeError, match="floating point"):
        fddp.Loss.sum(torch.tensor(1))

    def mixed(params, buffers, batch):
        loss = token_mean(apply, params, buffers, batch)
        return loss if batch["x"].shape[0] > 4 else loss.value()

    with pytest.raises(UsageValueError, match="same kind"):
        fddp.accumulate_gradients(mixed, 2)(params, buffers, {k: v[:9] for k, v in batch.items()})
