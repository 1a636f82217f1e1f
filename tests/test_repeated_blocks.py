"""Repeated blocks traced once (``_compiler._capture._repeated``): the graph written by replaying a
block's template computes what make_fx's graph of every block computes, bitwise, with the same
nodes; blocks that differ, or that run where a template could differ (hooks, autocast, Python
objects among their arguments, in-place writes to their inputs or buffers), are traced as they
are."""

from __future__ import annotations

import collections

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_equal
from _models import Block, captured_counting_replays, next_token_loss, token_batch
from torch import nn

import fddp
import fddp.optim as optim
from fddp._compiler._capture import _repeated


class Decoder(nn.Module):
    """Token embedding, ``blocks`` and a head; ``blocks`` is any list of modules."""

    def __init__(self, blocks: list[nn.Module], dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Scaled(nn.Module):
    """A residual MLP whose output scale is a plain attribute: blocks with different scales
    compute different things from the same tensors."""

    def __init__(self, dim: int, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * F.gelu(self.fc(x))


class Counter:
    """A Python object the blocks read and change: each call scales by one more."""

    def __init__(self) -> None:
        self.calls = 0


class Counted(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, counter: Counter) -> torch.Tensor:
        counter.calls += 1
        return x + counter.calls * F.gelu(self.fc(x))


class CountingDecoder(Decoder):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, counter = self.tok(ids), Counter()
        for block in self.blocks:
            x = block(x, counter)
        return self.head(x)


class InPlace(nn.Module):
    """Writes its input in place (not replayable) and an intermediate in place (fine)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.shift = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(self.shift)
        return x + self.fc(x).relu_()


class Normed(nn.Module):
    """BatchNorm in training mode: writes its running statistics (buffers) in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.fc(x).reshape(-1, x.shape[-1])).view_as(x)


class Dropped(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(F.gelu(self.fc(x)), p=0.3, training=True)


def _blocks(kind: str, n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    if kind == "transformer":
        return Decoder([Block(16, 2) for _ in range(n)])
    if kind == "different scales":
        return Decoder([Scaled(16, 1.0 + i) for i in range(n)])
    if kind == "stateful argument":
        return CountingDecoder([Counted(16) for _ in range(n)])
    if kind == "in-place input":
        return Decoder([InPlace(16) for _ in range(n)])
    if kind == "batch norm":
        return Decoder([Normed(16) for _ in range(n)])
    if kind == "dropout":
        return Decoder([Dropped(16) for _ in range(n)])
    if kind == "hooked":
        model = Decoder([Scaled(16, 1.0) for _ in range(n)])
        for block in model.blocks:
            block.register_forward_hook(lambda m, i, o: o * 2.0)
        return model
    if kind == "nn.TransformerEncoder":
        layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        encoder = nn.TransformerEncoder(layer, n, enable_nested_tensor=False)
        return Decoder([encoder])
    raise AssertionError(kind)


def _step(model: nn.Module, *, autocast: bool = False):
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)
    opt = optim.adamw(1e-2, weight_decay=0.1)

    def step(params, opt_state, ids):
        def loss_fn(p):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = apply(p, buffers, ids)
            return next_token_loss(logits.float(), ids)

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step, (params, opt.init(params), token_batch(0, 4))


def _capture(step, args, monkeypatch, *, replay: bool):
    """The captured graph of ``step(*args)`` and how many block calls were replayed."""
    captured, replays = captured_counting_replays(step, args, monkeypatch, replay=replay)
    assert captured.graph is not None
    return captured, replays


def _targets(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(
        (str(n.target), str(n.meta.get("custom"))) for n in graph.nodes if n.op != "output"
    )


def _outputs(captured, args, seed: int = 0) -> list[torch.Tensor]:
    tensors = [x.clone() for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    torch.manual_seed(seed)
    return captured.graph(*tensors)


REPLAYED = ["transformer", "dropout", "nn.TransformerEncoder"]
AS_THEY_ARE = ["different scales", "stateful argument", "in-place input", "batch norm", "hooked"]


@pytest.mark.parametrize("kind", REPLAYED + AS_THEY_ARE)
def test_replayed_graph_computes_what_make_fx_records(kind, monkeypatch):
    fddp.init()
    step, args = _step(_blocks(kind))
    replayed, calls = _capture(step, args, monkeypatch, replay=True)
    traced, none = _capture(step, args, monkeypatch, replay=False)
    assert none == 0
    if kind in REPLAYED:
        assert calls == 4, f"{calls} of 4 blocks replayed"
    elif kind != "different scales":  # those are grouped by scale: none has an equal
        assert calls == 0, f"{calls} blocks replayed"
    assert _targets(replayed.graph.graph) == _targets(traced.graph.graph)
    assert_trees_equal(_outputs(replayed, args), _outputs(traced, args))


def test_blocks_that_differ_in_a_plain_attribute_get_templates_of_their_own(monkeypatch):
    """Two scales, two blocks each: two templates, each block replays its own."""
    fddp.init()
    torch.manual_seed(0)
    model = Decoder([Scaled(16, s) for s in (1.0, 2.0, 1.0, 2.0, 1.0, 2.0)])
    step, args = _step(model)
    replayed, calls = _capture(step, args, monkeypatch, replay=True)
    traced, _ = _capture(step, args, monkeypatch, replay=False)
    assert calls == 6
    assert_trees_equal(_outputs(replayed, args), _outputs(traced, args))


class Squashed(nn.Module):
    """Its backward reads its output (tanh's derivative) and its input (the weight's)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Overwriting(Decoder):
    """Writes each block's output, or its input, in place after the call."""

    def __init__(self, blocks: list[nn.Module], what: str) -> None:
        super().__init__(blocks)
        self.what = what

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) * 1.0
        for block in self.blocks:
            y = block(x)
            (y if self.what == "output" else x).mul_(0.5)
            x = y
        return self.head(x)


@pytest.mark.parametrize("what", ["output", "input"])
def test_writing_what_a_replayed_backward_reads_raises_as_autograd_does(what, monkeypatch):
    """make_fx's autograd refuses a backward that would read a tensor written in place since
    the forward; a replayed block's backward refuses it too, instead of reading the new
    values."""
    fddp.init()
    torch.manual_seed(0)
    step, args = _step(Overwriting([Squashed(16) for _ in range(4)], what))
    for replay in (False, True):
        with pytest.raises(Exception, match="modified by an inplace operation"):
            _capture(step, args, monkeypatch, replay=replay)


def test_autocast_blocks_are_traced_as_they_are(monkeypatch):
    """The template's thread would not see the caller's autocast: no replay, same graph."""
    fddp.init()
    step, args = _step(_blocks("transformer"), autocast=True)
    replayed, calls = _capture(step, args, monkeypatch, replay=True)
    traced, _ = _capture(step, args, monkeypatch, replay=False)
    assert calls == 0
    assert _targets(replayed.graph.graph) == _targets(traced.graph.graph)


def test_training_with_replayed_blocks_equals_training_without(monkeypatch):
    """Four data_parallel steps of an 6-block decoder, replayed and traced: bitwise."""
    fddp.init()
    results = []
    for replay in (True, False):
        with monkeypatch.context() as m:
            m.setattr(_repeated, "ENABLED", replay)
            step, (params, state, _) = _step(_blocks("transformer", n=6))
            pstep = fddp.data_parallel(step, donate_argnums=(0, 1))
            for i in range(4):
                params, state, loss = pstep(params, state, token_batch(i, 4))
            results.append((params, state, loss))
    (p1, s1, l1), (p2, s2, l2) = results
    assert_trees_equal((p1, s1, l1), (p2, s2, l2))
