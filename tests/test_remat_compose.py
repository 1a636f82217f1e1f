"""Rematerialisation composed with the rest of fddp: gradient accumulation inside the step,
compile=True, repeated-block replay, fddp.vmap, fully sharded parameters and 2 gloo ranks against
DDP + torch.utils.checkpoint. Each run equals the same step without remat: bitwise (dropout
included) where fddp runs both, to tolerance against DDP."""

from __future__ import annotations

import functools

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from _compare import assert_trees_close, assert_trees_equal
from _dist import run_checks
from torch import nn

import fddp
import fddp.optim as optim
from fddp._compiler._capture import _repeated

FULL = fddp.remat_policies.nothing_saveable
TINY = 200 / 2**20  # 200-byte buckets: one gather per few leaves


class _Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc, self.out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.drop(torch.tanh(self.fc(self.ln(x)))))


class _Stack(nn.Module):
    """Identical residual blocks (a ModuleList: the repeated blocks remat's regions default to)
    and a head; ``checkpoint`` runs each block under torch.utils.checkpoint (eager)."""

    def __init__(self, dim: int = 32, layers: int = 3, dropout: float = 0.25) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(dim, dropout) for _ in range(layers))
        self.head = nn.Linear(dim, 1)
        self.checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def _batch(i: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(rows, 32, generator=g), torch.randn(rows, 1, generator=g)


def _grad_step(model: nn.Module, microbatches: int = 1):
    """``step(params, x, y) -> (pmean(grads), pmean(loss))``, the gradients summed over
    ``microbatches`` slices of the batch inside the step."""
    apply = fddp.functional(model)

    def loss_fn(p, x, y):
        return F.mse_loss(apply(p, {}, x), y)

    def step(p, x, y):
        total, loss = None, 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            value, grads = fddp.value_and_grad(loss_fn)(p, xs, ys)
            total = grads if total is None else optree.tree_map(torch.add, total, grads)
            loss = loss + value
        return fddp.pmean(total), fddp.pmean(loss)

    return step


def _seeded(pstep, *args):
    torch.manual_seed(11)  # the dropout masks come from the global generator
    return pstep(*args)


def _recomputed(plan) -> int:
    return 0 if plan.remat is None else sum(len(r.recomputed) for r in plan.remat.regions)


def test_accumulation_inside_the_step_is_bitwise_the_step_without_remat() -> None:
    model = _Stack()
    params, _ = fddp.state(model)
    x, y = _batch(0, rows=48)
    step = _grad_step(model, microbatches=3)
    plain, remat = fddp.data_parallel(step), fddp.data_parallel(step, remat=FULL)
    want, got = _seeded(plain, params, x, y), _seeded(remat, params, x, y)
    assert_trees_equal(got, want)
    plan = remat.schedule(params, x, y)
    assert len(plan.remat.regions) == 3 * 3  # every block of every microbatch
    # each region keeps its input and the CPU generator state its dropout replays (5 KiB)
    assert plan.remat.saved_bytes < plan.remat.saved_bytes_without / 2


def test_repeated_block_replay_still_happens_under_remat(monkeypatch) -> None:
    """The blocks are replayed from their templates as without remat; the remat regions are
    the replayed calls, and the gradients are bitwise those of the step without remat."""
    model = _Stack(layers=4)
    params, _ = fddp.state(model)
    x, y = _batch(1)
    templates: list[object] = []
    call = _repeated._Call

    def counted(template):
        templates.append(template)
        return call(template)

    monkeypatch.setattr(_repeated, "_Call", counted)
    remat = fddp.data_parallel(_grad_step(model), remat=FULL)
    got = _seeded(remat, params, x, y)
    with_remat, templates[:] = list(templates), []
    _seeded(fddp.data_parallel(_grad_step(model)), params, x, y)
    # as many block calls replayed, from as few templates, as without remat
    assert len(with_remat) == len(templates) >= 3
    assert len({id(t) for t in with_remat}) == len({id(t) for t in templates}) < len(templates)
    assert len(remat.schedule(params, x, y).remat.regions) == 4
    monkeypatch.setattr(_repeated, "ENABLED", False)
    want = _seeded(fddp.data_parallel(_grad_step(model)), params, x, y)
    assert_trees_equal(got, want)


def test_compile_true_with_remat_is_bitwise_compile_true_without() -> None:
    model = _Stack(layers=2, dropout=0.0)
    params, _ = fddp.state(model)
    x, y = _batch(2)
    step = _grad_step(model)
    want = fddp.data_parallel(step, compile=True)(params, x, y)
    remat = fddp.data_parallel(step, compile=True, remat=FULL)
    got = remat(params, x, y)
    assert_trees_equal(got, want)
    assert _recomputed(remat.schedule(params, x, y)) > 0


def test_vmap_with_remat_regions_gives_the_same_numbers() -> None:
    """fddp.vmap runs the step eagerly: a region is a plain call, the numbers unchanged."""
    model = _Stack(dropout=0.0)
    apply = fddp.functional(model)
    params, _ = fddp.state(model)

    def step(p, x, y, remat):
        def loss_fn(p):
            run = fddp.remat(lambda q: apply(q, {}, x), policy=FULL) if remat else None
            out = run(p) if run is not None else apply(p, {}, x)
            return F.mse_loss(out, y)

        return fddp.pmean(fddp.grad(loss_fn)(p))

    x, y = _batch(3, rows=6)
    replicas = optree.tree_map(lambda t: t.expand(2, *t.shape).clone(), params)
    xs, ys = x.view(2, 3, 32), y.view(2, 3, 1)
    want = fddp.vmap(functools.partial(step, remat=False))(replicas, xs, ys)
    got = fddp.vmap(functools.partial(step, remat=True))(replicas, xs, ys)
    assert_trees_equal(got, want)


# ---- 2 gloo ranks: fully sharded parameters, and DDP + torch.utils.checkpoint -----------------


def _rows() -> slice:
    rank = dist.get_rank()
    return slice(4 * rank, 4 * rank + 4)


def _sharded_training(policy, steps: int = 2):
    """Fully sharded AdamW training (shard_params + shard_state) with ``remat=policy``."""
    model = _Stack()
    params, _ = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.shard_state(optim.adamw(1e-2), bucket_cap_mb=TINY)

    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(lambda p: F.mse_loss(apply(p, {}, x), y))(p)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, remat=policy)
    state = fddp.data_parallel(opt.init, trace=False)(params)
    sharded = fddp.shard_params(params, bucket_cap_mb=TINY)
    torch.manual_seed(21 + dist.get_rank())
    for i in range(steps):
        x, y = _batch(i)
        sharded, state, loss = pstep(sharded, state, x[_rows()], y[_rows()])
    plan = pstep.schedule(sharded, state, x[_rows()], y[_rows()])
    gathers = [(c.gather, c.freed) for c in plan.collectives if c.gather]
    return fddp.full_params(sharded), loss, gathers, _recomputed(plan)


def _check_sharded():
    return _sharded_training(None), _sharded_training(FULL)


def _ddp_against_fddp(steps: int = 3):
    """The same data, the same AdamW: DDP with every block checkpointed, fddp with remat."""
    model = _Stack(dropout=0.0)
    params, _ = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.adamw(1e-2, weight_decay=0.0)

    def step(p, s, x, y):
        loss, g = fddp.value_and_grad(lambda p: F.mse_loss(apply(p, {}, x), y))(p)
        u, s = opt.update(fddp.pmean(g), s, p)
        return optim.apply_updates(p, u), s, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, remat=FULL)
    state = opt.init(params)
    reference = _Stack(dropout=0.0)
    reference.checkpoint = True
    ddp = nn.parallel.DistributedDataParallel(reference)
    torch_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
    for i in range(steps):
        x, y = _batch(i)
        params, state, _ = pstep(params, state, x[_rows()], y[_rows()])
        F.mse_loss(ddp(x[_rows()]), y[_rows()]).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    plan = pstep.schedule(params, state, x[_rows()], y[_rows()])
    return params, {k: v.detach().clone() for k, v in reference.named_parameters()}, plan


@pytest.fixture(scope="module")
def ranks():
    return run_checks({"sharded": _check_sharded, "ddp": _ddp_against_fddp}, 2, timeout=240)


def test_fully_sharded_remat_regathers_and_is_bitwise_the_step_without(ranks) -> None:
    for without, withr in ranks["sharded"]:
        params, loss, gathers, recomputed = withr
        want_params, want_loss, want_gathers, none_recomputed = without
        assert_trees_equal((params, loss), (want_params, want_loss))
        assert recomputed > 0 and none_recomputed == 0
        # the forward's gathers are freed where they are without remat (none kept alive for
        # the recomputation), and the backward gathers again what the recomputation reads:
        # also the buckets that only the forward read before (block 0's input needs no grad)
        first = {g.split(",")[0]: f for g, f in gathers if ", 1 of " in g}
        assert first == {g.split(",")[0]: f for g, f in want_gathers if ", 1 of " in g}
        again = [f for g, f in gathers if ", 2 of 2" in g]
        assert min(again) > max(first.values())
        forward_only = {g.split(",")[0] for g, _ in want_gathers if ", 1 of 1" in g}
        regathered = {g.split(",")[0] for g, _ in gathers if ", 2 of 2" in g}
        assert len(forward_only - regathered) == 1  # the head's bucket: in no region


def test_two_ranks_match_ddp_with_torch_checkpoint(ranks) -> None:
    for params, reference, plan in ranks["ddp"]:
        assert_trees_close(params, reference, rtol=1e-5, atol=1e-6)
        assert _recomputed(plan) > 0
