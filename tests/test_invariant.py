"""Invariant mode: bitwise the same training on 1-4 ranks, fddp.vmap replicas and any bucket cap."""

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
import fddp.optim as optim
from fddp._base._errors import UsageValueError

GLOBAL = 24  # examples per step: 24, 12, 8 and 6 per rank on 1-4 ranks
CHUNK = 2
STEPS = 2
CAPS = (None, 1e-4, 25.0)  # chosen by the cost model, one leaf per bucket, one bucket


class _Block(nn.Module):
    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no qkv bias: its key part has a gradient that is zero in exact arithmetic, which
        # AdamW would blow up from float noise, so two correct reductions would drift apart
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.drop(self.proj(self.drop(weights) @ v))
        return x + self.drop(self.fc(self.ln2(x)))


class _Transformer(nn.Module):
    def __init__(self, p: float, vocab: int = 11, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(_Block(dim, p))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 4),
    )


def _data(model: str, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if model == "transformer":
        ids = torch.randint(0, 11, (GLOBAL, 7), generator=g)
        return {"x": ids, "y": ids.roll(-1, dims=1)}
    return {"x": torch.randn(GLOBAL, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (GLOBAL,))}


def _setup(model: str, p: float = 0.1):
    """(step, params, buffers, opt_state); the step returns the new buffers and the loss."""
    torch.manual_seed(0)
    net = _Transformer(p) if model == "transformer" else _cnn()
    params, buffers = fddp.state(net)
    apply = fddp.functional(net, return_buffers=True)
    opt = optim.adamw(lr=3e-3, weight_decay=0.01)

    def loss_fn(params, buffers, batch):
        out, new_buffers = apply(params, buffers, batch["x"])
        return F.cross_entropy(out.flatten(0, -2), batch["y"].flatten()), new_buffers

    def step(params, opt_state, buffers, batch):
        (loss, buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        buffers = fddp.nn.sync_buffers(buffers, "mean")
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, buffers, fddp.pmean(loss)

    return step, params, buffers, opt.init(params)


def _train(model: str, p: float = 0.1, **options) -> dict:
    """STEPS steps on this rank's slice of each global batch; the final state and loss."""
    step, params, buffers, opt_state = _setup(model, p)
    pstep = fddp.data_parallel(step, **options)
    rank, size = fddp.rank(), fddp.world_size()
    torch.manual_seed(7)  # the dropout seed each step draws
    for i in range(STEPS):
        local = {k: v.chunk(size)[rank] for k, v in _data(model, i).items()}
        params, opt_state, buffers, loss = pstep(params, opt_state, buffers, local)
    return {"params": params, "buffers": buffers, "opt_state": opt_state, "loss": loss}


def _simulate(model: str, replicas: int) -> dict:
    """The same training as N simulated replicas of fddp.vmap."""
    step, params, buffers, opt_state = _setup(model)
    sim = fddp.vmap(step, in_dims=(None, None, None, 0), out_dims=None, invariant=CHUNK)
    torch.manual_seed(7)
    for i in range(STEPS):
        batch = {k: v.unflatten(0, (replicas, -1)) for k, v in _data(model, i).items()}
        params, opt_state, buffers, loss = sim(params, opt_state, buffers, batch)
    return {"params": params, "buffers": buffers, "opt_state": opt_state, "loss": loss}


def _sums_before_the_last_matmul() -> tuple[int, int]:
    """Where the step's graph launches its first int64 sum all-reduce, and where its last
    matmul (the last chunk's backward) runs: buckets of one leaf each."""
    step, params, buffers, opt_state = _setup("transformer", 0.0)
    pstep = fddp.data_parallel(step, invariant=CHUNK, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    rank, size = fddp.rank(), fddp.world_size()
    local = {k: v.chunk(size)[rank] for k, v in _data("transformer", 0).items()}
    nodes = list(pstep.graph(params, opt_state, buffers, local).graph.nodes)
    sums = [
        i
        for i, n in enumerate(nodes)
        if "all_reduce" in str(n.target)
        and n.args[1] == "sum"
        and n.meta["val"].dtype == torch.int64
    ]
    return sums[0], max(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default)


def _checks(world: int) -> dict:
    """What each world size runs: the transformer traced with a bucket cap that changes with
    the world size, the CNN traced on 1 and 3 ranks and eager on 2 and 4; the default mode
    (eager, no dropout, which the default mode's generator would draw per rank) beside the
    invariant one on 1 and 3 ranks; every cap and the eager transformer on 2 ranks."""
    checks = {
        "transformer": functools.partial(
            _train, "transformer", invariant=CHUNK, bucket_cap_mb=CAPS[world % 3]
        ),
        "cnn": functools.partial(_train, "cnn", invariant=CHUNK, trace=world in (1, 3)),
    }
    if world in (1, 3):
        checks["default"] = functools.partial(_train, "transformer", 0.0, trace=False)
        checks["invariant p=0"] = functools.partial(
            _train, "transformer", 0.0, invariant=CHUNK, trace=False
        )
    if world == 2:
        for cap in CAPS:
            if cap != CAPS[world % 3]:
                checks[f"transformer cap {cap}"] = functools.partial(
                    _train, "transformer", invariant=CHUNK, bucket_cap_mb=cap
                )
        checks["eager"] = functools.partial(_train, "transformer", invariant=CHUNK, trace=False)
        checks["schedule"] = _sums_before_the_last_matmul
    return checks


@pytest.fixture(scope="module")
def runs() -> dict[int, Mapping[str, list]]:
    return run_world_sizes(_checks, in_process=one_thread(), timeout=240)


@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_bitwise_equal_on_any_world_size_and_vmap(runs, model):
    reference = runs[1][model][0]
    moved = max_abs_diff(reference["params"], _setup(model)[1])
    assert moved > 1e-3, "the parameters must train for the comparison to mean anything"
    for world in (2, 3, 4):
        for rank, result in enumerate(runs[world][model]):
            assert_trees_equal(result, reference, what=f"{model}, {world} ranks, rank {rank}")
    for replicas in (1, 2, 3, 4):
        with one_thread():
            simulated = _simulate(model, replicas)
        assert_trees_equal(simulated, reference, what=f"{model}, vmap x{replicas}")


def test_bitwise_equal_for_any_bucket_cap_and_without_tracing(runs):
    reference = runs[1]["transformer"][0]
    for cap in CAPS:
        name = "transformer" if cap == CAPS[2 % 3] else f"transformer cap {cap}"
        for rank, result in enumerate(runs[2][name]):
            assert_trees_equal(result, reference, what=f"bucket_cap_mb={cap}, rank {rank}")
    for rank, result in enumerate(runs[2]["eager"]):
        assert_trees_equal(result, reference, what=f"trace=False, rank {rank}")


def test_each_leafs_exact_sum_is_launched_during_the_last_chunks_backward(runs):
    """A leaf's exponent and fixed-point sum run where its last chunk's gradient is ready, so
    its int64 all-reduce overlaps the rest of the backward pass, as the default mode's do."""
    for first_sum, last_matmul in runs[2]["schedule"]:
        assert first_sum < last_matmul


def test_default_mode_is_not_invariant_but_agrees_to_tolerance(runs):
    one, three = runs[1]["default"][0], runs[3]["default"][0]
    assert max_abs_diff(one["params"], three["params"]) > 0, "default mode: same bits on 1 and 3"
    assert_trees_equal(runs[3]["invariant p=0"][0], runs[1]["invariant p=0"][0])
    for world, default in ((1, one), (3, three)):
        invariant = runs[world]["invariant p=0"][0]
        assert_trees_close(invariant["params"], default["params"], rtol=0, atol=1e-5)
        assert_trees_close(invariant["loss"], default["loss"], rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "dtype, scale, bits",
    [
        (torch.float64, 1e-300, 40),  # below float32's range
        (torch.float64, 1e300, 40),  # above it
        (torch.float32, 1e-36, 22),  # near float32's least normal
        (torch.float32, 1e30, 22),
    ],
)
def test_precision_holds_over_the_whole_range_of_the_dtype(dtype, scale, bits):
    """The exponent and the scales are computed in the leaf's own range: the mean over the
    chunks keeps the promised bits below the leaf's largest magnitude, also where some chunks'
    gradients are all zero (they leave the scale to the others)."""
    w = torch.tensor([1.0, 0.5, -0.25], dtype=dtype)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[:3] = 0  # three chunks with all-zero gradients

    def loss_fn(w, x):
        return ((x @ w) * scale).mean()

    def step(w, x):
        loss, grads = fddp.value_and_grad(loss_fn)(w, x)
        return fddp.pmean(loss), fddp.pmean(grads)

    reference = fddp.value_and_grad(loss_fn)(w, x)
    found = fddp.data_parallel(step, invariant=1)(w, x)
    for got, want in zip(found, reference):
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert_trees_close(got, want, rtol=0, atol=2.0**-bits * float(want.abs().max()))


def test_errors_name_the_fix():
    step, params, buffers, opt_state = _setup("transformer")
    batch = {k: v[:5] for k, v in _data("transformer", 0).items()}
    pstep = fddp.data_parallel(step, invariant=CHUNK, trace=False)
    with pytest.raises(UsageValueError, match="not a multiple of chunk_size=2"):
        pstep(params, opt_state, buffers, batch)
    with pytest.raises(ValueError, match="comm_dtype"):
        fddp.data_parallel(step, invariant=CHUNK, comm_dtype=torch.bfloat16)

    def attention_dropout(params, batch):
        return F.scaled_dot_product_attention(batch, batch, batch, dropout_p=0.1).mean() * params

    def sdpa_step(params, batch):
        return fddp.pmean(fddp.grad(attention_dropout)(params, batch))

    with pytest.raises(UsageValueError, match="scaled_dot_product_attention draws"):
        fddp.data_parallel(sdpa_step, invariant=1, trace=False)(
            torch.tensor(1.0), torch.randn(2, 3, 4)
        )


def test_pmean_passes_the_reduced_values_through_and_refuses_a_mix():
    def loss_fn(w, batch):
        return (batch @ w).square().mean()

    def step(w, batch):
        loss, g = fddp.value_and_grad(loss_fn)(w, batch)
        assert fddp.pmean(g) is g and fddp.pmean(loss) is loss
        return fddp.pmean({"g": g, "other": g * 2})

    batch = torch.randn(4, 3)
    with pytest.raises(UsageValueError, match="mixes values"):
        fddp.data_parallel(step, invariant=2, trace=False)(torch.ones(3), batch)
    with pytest.raises(UsageValueError, match="chunk_size=0"):
        fddp.data_parallel(step, invariant=0)
    with pytest.raises(TypeError, match=r"fddp\.Invariant"):
        fddp.data_parallel(step, invariant=2.0)
