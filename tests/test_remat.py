"""Rematerialisation (fddp.remat, data_parallel(remat=...)): gradients bitwise those without it,
the saved-for-backward bytes the policies promise, counted in the graph and measured."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_equal
from _dist import run_checks
from _models import captured_counting_replays, captured_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fddp
from fddp._base._annotations import REMAT_NAME, REMAT_RECOMPUTED
from fddp._compiler._passes import _rematerialize as remat_pass
from fddp._ranks import _machine

P = fddp.remat_policies
LAYERS = 3

POLICIES = {
    "nothing_saveable": P.nothing_saveable,
    "everything_saveable": P.everything_saveable,
    "dots_saveable": P.dots_saveable,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "save_only_these_names": P.save_only_these_names("attn"),
    "save_any_names_but_these": P.save_any_names_but_these("hidden"),
    "memory_budget": P.memory_budget(fraction=0.4),
}


class Block(nn.Module):
    """Pre-norm attention and MLP, dropout in both; two values named for the name policies."""

    def __init__(self, dim: int = 32, heads: int = 2, named: bool = True) -> None:
        super().__init__()
        self.heads, self.named = heads, named
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = self.name(att.transpose(1, 2).reshape(b, t, d), "attn")
        x = x + F.dropout(self.proj(att), 0.2, True)
        hidden = self.name(F.gelu(self.fc(self.ln2(x))), "hidden")
        return x + F.dropout(self.out(hidden), 0.2, True)

    def name(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return fddp.remat_name(x, name) if self.named else x


class Transformer(nn.Module):
    def __init__(self, layers: int = LAYERS, dim: int = 32, named: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, named=named) for _ in range(layers))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = fddp.remat_name(self.conv(x), "attn")  # the name the name policies keep
        return x + torch.relu(fddp.remat_name(self.bn(hidden), "hidden"))


def transformer_case(rows: int = 4, named: bool = True) -> tuple:
    torch.manual_seed(0)
    model = Transformer(named=named)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)

    def step(params, x):
        loss_fn = lambda p: apply(p, buffers, x).square().mean()
        loss, grads = fddp.value_and_grad(loss_fn)(params)
        return loss, fddp.pmean(grads)

    return step, (params, torch.randn(rows, 16, 32))


def cnn_case(rows: int = 4) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(*[ConvBlock() for _ in range(3)], nn.Flatten(), nn.Linear(4 * 36, 2))
    params, buffers = fddp.state(model)
    apply = fddp.functional(model, return_buffers=True)

    def step(params, buffers, x):
        def loss_fn(p):
            out, new_buffers = apply(p, buffers, x)
            return out.square().mean(), new_buffers

        (loss, new_buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, fddp.pmean(grads), new_buffers

    return step, (params, buffers, torch.randn(rows, 4, 6, 6))


CASES = {"transformer": transformer_case, "cnn": cnn_case}


def _run(step, args, remat=None, seed: int = 7):
    pstep = fddp.data_parallel(step, remat=remat)
    torch.manual_seed(seed)
    return pstep, pstep(*args)


def _same(a, b) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb))


def compare_policies(case: str) -> dict[str, tuple[bool, int, int]]:
    """Per policy: outputs bitwise those without remat (dropout's masks, gradients, BatchNorm's
    running statistics), saved bytes with and without."""
    step, args = CASES[case]()
    _, reference = _run(step, args)
    found = {}
    for name, policy in POLICIES.items():
        pstep, out = _run(step, args, policy)
        plan = pstep.schedule(*args).remat
        found[name] = (_same(out, reference), plan.saved_bytes, plan.saved_bytes_without)
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_every_policy_gives_bitwise_the_gradients_without_remat(case):
    found = compare_policies(case)
    assert set(found) == set(POLICIES)
    for name, (same, saved, without) in found.items():
        assert same, name
        if name == "everything_saveable":
            assert saved == without
        else:
            assert saved < without, name


def test_dropout_without_remat_differs_per_seed():
    """The bitwise comparisons above see dropout: another seed gives other gradients."""
    step, args = transformer_case()
    pstep, first = _run(step, args, P.nothing_saveable, seed=7)
    torch.manual_seed(8)
    assert not _same(first, pstep(*args))


def test_random_ops_with_an_explicit_generator_replay_its_state():
    """A region's random ops that draw from an explicit ``torch.Generator`` (closed over, and
    passed as an argument) get the numbers of the forward again when the backward recomputes
    them, and the generator ends where it ends without remat: two calls in a row, bitwise."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)
    closed = torch.Generator().manual_seed(3)

    def step(w, x, passed, region):
        def body(h, w):
            h = torch.tanh(h @ w) * torch.rand(h.shape, generator=closed)
            h = torch.tanh(h + torch.randn(h.shape, generator=passed))
            return h * torch.bernoulli(torch.full_like(h, 0.7), generator=passed)

        def loss_fn(w):
            return ((fddp.remat(body) if region else body)(x, w) @ w).square().mean()

        return fddp.pmean(fddp.grad(loss_fn)(w))

    results = []
    for region in (False, True):
        closed.manual_seed(3)
        passed = torch.Generator().manual_seed(4)
        pstep = fddp.data_parallel(functools.partial(step, region=region))
        grads = [pstep(w, x, passed) for _ in range(2)]
        results.append((grads, closed.get_state(), passed.get_state()))
    plan = pstep.schedule(w, x, passed).remat
    recomputed = set(plan.regions[0].recomputed)
    assert {"aten.rand.generator", "aten.randn.generator", "aten.bernoulli.default"} <= recomputed
    assert_trees_equal(results[1], results[0])


def test_a_value_written_in_place_after_the_region_is_kept_not_recomputed():
    """The region reads ``h`` and ``g``; the forward then doubles ``h`` in place. Recomputing
    ``h.sum()`` in the backward would read the doubled ``h``: that sum is kept, ``g.sum()`` is
    still recomputed, and the gradients are bitwise those without remat."""
    fddp.init()
    torch.manual_seed(0)
    params = {"a": torch.randn(8, 8), "b": torch.randn(8, 8)}
    batch = (torch.randn(4, 8), torch.randn(4, 8))

    def region(p, h, g):
        return torch.tanh(h.sum() * p["a"]) * torch.tanh(g.sum() * p["a"])

    def make_step(marked):
        def step(params, batch):
            def loss(p):
                h, g = batch[0].clone(), batch[1]
                out = (fddp.remat(region) if marked else region)(p, h, g)
                h.mul_(3.0)
                return (out * p["b"]).sum() + h.sum()

            value, grads = fddp.value_and_grad(loss)(params)
            return value, fddp.pmean(grads)

        return step

    _, reference = _run(make_step(False), (params, batch))
    pstep, out = _run(make_step(True), (params, batch), P.nothing_saveable)
    assert_trees_equal(out, reference)
    recomputed = pstep.schedule(params, batch).remat.regions[0].recomputed
    assert recomputed.count("aten.sum.default") == 1, recomputed


def test_full_policy_keeps_one_layer_of_the_bytes_and_recomputes_in_the_backward():
    step, args = transformer_case()
    pstep = fddp.data_parallel(step, remat=P.nothing_saveable)
    plan = pstep.schedule(*args).remat
    assert [r.source for r in plan.regions] == ["block"] * LAYERS
    per_layer = plan.saved_bytes_without / LAYERS
    assert plan.saved_bytes <= (plan.saved_bytes_without / LAYERS + per_layer) * 1.1
    graph = pstep.graph(*args).graph
    recomputed = [n for n in graph.nodes if REMAT_RECOMPUTED in (n.meta.get("custom") or {})]
    assert {n.meta["custom"][REMAT_RECOMPUTED] for n in recomputed} == set(range(LAYERS))
    assert not any(REMAT_NAME in (n.meta.get("custom") or {}) for n in graph.nodes)
    assert str(plan).startswith("remat (nothing_saveable)")
    assert f"region {LAYERS - 1} (block, nothing_saveable)" in str(pstep.schedule(*args))


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops create that are alive, and their peak."""

    supports_higher_order_operators = True

    def __init__(self, outside: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[int] = set()
        self.outside = {t.untyped_storage()._cdata for t in outside}

    def _free(self, key: int, size: int) -> None:
        self.tracked.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.tracked or key in self.outside:
                continue
            self.tracked.add(key)
            size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out


def _peak(step, args, policy) -> tuple[int, remat_pass.RematPlan | None]:
    pstep, _ = _run(step, args, policy)
    meter = _LiveBytes(optree.tree_leaves(args))
    with meter:
        pstep(*args)
    return meter.peak, pstep.schedule(*args).remat


def test_measured_peak_falls_by_the_bytes_the_plan_counts():
    step, args = transformer_case(rows=16)
    without, _ = _peak(step, args, None)
    full, plan = _peak(step, args, P.nothing_saveable)
    freed = plan.saved_bytes_without - plan.saved_bytes
    # the backward recomputes one layer at a time, which the plan's saved bytes leave out
    one_layer = plan.saved_bytes_without / LAYERS
    assert without - full >= freed - 1.1 * one_layer
    assert full < without / 2


def test_memory_budget_meets_its_budget_within_ten_percent():
    step, args = transformer_case()
    found = fddp.data_parallel(step, remat=P.memory_budget(fraction=0.3)).schedule(*args).remat
    budget = 0.3 * found.saved_bytes_without
    assert 0.9 * budget <= found.saved_bytes <= budget
    budget = int(0.6 * found.saved_bytes_without)
    absolute = fddp.data_parallel(step, remat=P.memory_budget(bytes=budget))
    assert 0.9 * budget <= absolute.schedule(*args).remat.saved_bytes <= budget


def test_memory_budget_weighs_recomputes_with_the_cost_models_machine():
    """The budget ranks what to recompute by ``_cost``'s seconds on the machine it is given:
    where a dispatch is dear it recomputes fewer ops than where dispatch is nearly free, and
    both choices meet the budget."""
    step, args = transformer_case()
    recomputed = {}
    for name, per_node in (("dear dispatch", 1e-3), ("free dispatch", 1e-10)):
        machine = dataclasses.replace(_machine.DEFAULT, seconds_per_node=per_node)
        graph = captured_step(step, args).graph.graph
        plan = remat_pass.rematerialise(
            graph, P.memory_budget(fraction=0.6), replay_rng=True, machine=machine
        )
        assert plan.saved_bytes <= 0.6 * plan.saved_bytes_without
        recomputed[name] = sum(len(r.recomputed) for r in plan.regions)
    assert recomputed["dear dispatch"] < recomputed["free dispatch"], recomputed


def test_marked_regions_take_their_own_policy_or_the_steps():
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)

    def layer(w, x):
        return torch.tanh(x @ w)

    first = fddp.remat(layer, policy=P.everything_saveable)
    second = fddp.remat(layer)

    def step(ws, x):
        def loss_fn(ws):
            return second(ws[1], first(ws[0], x)).sum()

        return fddp.grad(loss_fn)(ws)

    args = ((w1, w2), torch.randn(4, 8))
    reference = fddp.data_parallel(step)(*args)
    for step_policy, second_policy in ((None, P.nothing_saveable), (P.dots_saveable,) * 2):
        pstep = fddp.data_parallel(step, remat=step_policy)
        assert _same(pstep(*args), reference)
        regions = pstep.schedule(*args).remat.regions
        assert [(r.source, r.policy) for r in regions] == [
            ("fddp.remat", "everything_saveable"),
            ("fddp.remat", repr(second_policy)),
        ]
        assert not regions[0].recomputed
    eager = fddp.data_parallel(step, trace=False)(*args)
    assert _same(eager, reference)
    assert torch.equal(second(w1, args[1]), layer(w1, args[1]))

    def dynamo_step(ws, x):
        if not torch.compiler.is_compiling():  # make_fx cannot read this: Dynamo captures
            x = x * (x.sum() > 0).item()
        return step(ws, x)

    pstep = fddp.data_parallel(dynamo_step, remat=P.nothing_saveable)
    assert _same(pstep(*args), reference)
    plan = pstep.schedule(*args)
    assert plan.captured_with == "dynamo"
    assert [r.policy for r in plan.remat.regions] == ["everything_saveable", "nothing_saveable"]


def test_no_policy_and_no_region_leaves_the_graph_as_it_was(monkeypatch):
    """Without a policy or a region the pass only removes remat_name's markers: the graph is
    the one of the same step without them (both traced block by block: a block that names
    values is not replayed)."""
    step, args = transformer_case()
    captured, replays = captured_counting_replays(step, args, monkeypatch, replay=True)
    assert replays == 0
    markers = [n for n in captured.graph.graph.nodes if REMAT_NAME in (n.meta.get("custom") or {})]
    assert len(markers) == 2 * LAYERS
    assert remat_pass.rematerialise(captured.graph.graph, None, replay_rng=True) is None
    captured.graph.recompile()
    unnamed_step, unnamed_args = transformer_case(named=False)
    plain, _ = captured_counting_replays(unnamed_step, unnamed_args, monkeypatch, replay=False)
    assert remat_pass.rematerialise(plain.graph.graph, None, replay_rng=True) is None
    plain.graph.recompile()
    assert captured.graph.code == plain.graph.code


def test_bad_policies_name_the_fix():
    step, args = transformer_case()
    with pytest.raises(TypeError, match=r"fddp\.remat_policies"):
        fddp.data_parallel(step, remat="full")
    with pytest.raises(TypeError, match="call it"):
        fddp.data_parallel(step, remat=P.save_only_these_names)
    with pytest.raises(TypeError, match="call it"):
        fddp.remat(lambda x: x, policy=P.memory_budget)
    with pytest.raises(ValueError, match="exactly one"):
        P.memory_budget()
    with pytest.raises(ValueError, match="not a remat policy"):
        P.Policy("full")
    with pytest.raises(ValueError, match=r"no value is named 'atn'.*'attn', 'hidden'"):
        fddp.data_parallel(step, remat=P.save_only_these_names("atn")).schedule(*args)
    with pytest.raises(ValueError, match="no region can keep it"):
        torch.manual_seed(0)
        w = torch.randn(4, 4)

        def outside(w, x):
            def loss_fn(w):
                named = fddp.remat_name(x @ w, "h")
                return fddp.remat(torch.tanh, policy=P.save_only_these_names("h"))(named).sum()

            return fddp.grad(loss_fn)(w)

        fddp.data_parallel(outside).schedule(w, torch.randn(2, 4))


def test_budget_below_the_inputs_or_two_budgets_are_errors():
    step, args = transformer_case()
    with pytest.raises(ValueError, match="Raise the budget"):
        fddp.data_parallel(step, remat=P.memory_budget(bytes=10)).schedule(*args)
    halves = [fddp.remat(torch.tanh, policy=P.memory_budget(fraction=f)) for f in (0.5, 0.6)]

    def two_budgets(w, x):
        return fddp.grad(lambda w: halves[1](halves[0](x @ w)).sum())(w)

    with pytest.raises(ValueError, match="a budget is the step's"):
        fddp.data_parallel(two_budgets).schedule(torch.ones(3, 3), torch.ones(2, 3))


# ---- two gloo ranks: one spawn for every check ----


def _two_rank_policies(case: str) -> dict:
    found = compare_policies(case)
    step, args = CASES[case]()
    plan = fddp.data_parallel(step, remat=P.nothing_saveable).schedule(*args)
    return {"found": found, "plan": str(plan.remat) + plan.remat.table()}


def _ranks_with_other_policies() -> str:
    """Rank 0 builds the step with remat, rank 1 without: both refuse to run it."""
    step, args = transformer_case()
    policy = P.nothing_saveable if torch.distributed.get_rank() == 0 else None
    with pytest.raises(fddp.ScheduleMismatchError) as raised:
        fddp.data_parallel(step, remat=policy)(*args)
    return str(raised.value)


CHECKS = {
    **{case: functools.partial(_two_rank_policies, case) for case in CASES},
    "other policies": _ranks_with_other_policies,
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks(CHECKS, world_size=2)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_bitwise_and_one_plan(two_ranks, case):
    per_rank = two_ranks[case]
    assert len(per_rank) == 2
    for result in per_rank:
        assert set(result["found"]) == set(POLICIES)
        for name, (same, saved, without) in result["found"].items():
            assert same, name
            assert saved <= without, name
    assert per_rank[0]["plan"] == per_rank[1]["plan"]
    assert per_rank[0]["found"] == per_rank[1]["found"]


def test_ranks_with_other_policies_refuse_to_run(two_ranks):
    for message in two_ranks["other policies"]:
        assert "remat" in message
