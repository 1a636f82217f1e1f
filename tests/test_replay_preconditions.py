"""Repeated-block replay proves what it assumes or traces the block as it is: each case here
breaks one assumption a template could make (which tensors need gradients, values read outside
the block's attributes, side effects, aliasing outputs, the sign of zero, tensors kept outside
the block), and the captured step must compute what the capture without replay computes,
bitwise, and what eager ``torch.func`` computes."""

from __future__ import annotations

import contextvars
import functools
import math
import random
from collections.abc import Callable
from typing import ClassVar

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from _dist import run_checks
from _models import captured_counting_replays, captured_step, next_token_loss, token_batch
from torch import nn

import fddp
from fddp._compiler._capture import _repeated

DIM = 8


class Decoder(nn.Module):
    """Token embedding, ``blocks`` and a head; ``before(i)`` runs before block ``i``, and a
    block's output may be ``(h, view)``: the view is doubled in place and ``h`` added."""

    def __init__(self, blocks: list[nn.Module], vocab: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, vocab)

    def before(self, i: int) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for i, block in enumerate(self.blocks):
            self.before(i)
            out = block(x)
            if isinstance(out, tuple):
                h, view = out
                view.mul_(2.0)
                out = x + h
            x = out
        return self.head(x)


class Residual(nn.Module):
    """``x + scale() * gelu(fc(x))``; subclasses say where the scale comes from."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def scale(self) -> float:
        return 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale() * F.gelu(self.fc(x))


GLOBAL_SCALE = 1.0


class GlobalScaled(Residual):
    def scale(self) -> float:
        return GLOBAL_SCALE


class GlobalDecoder(Decoder):
    def before(self, i: int) -> None:
        global GLOBAL_SCALE
        GLOBAL_SCALE = 1.0 + i


class PropertyScaled(Residual):
    table: ClassVar[dict[str, float]] = {"scale": 1.0}

    @property
    def current(self) -> float:
        return self.table["scale"]

    def scale(self) -> float:
        return self.current


class PropertyDecoder(Decoder):
    def before(self, i: int) -> None:
        PropertyScaled.table["scale"] = 1.0 + i


class ClassScaled(Residual):
    factor = 1.0

    def scale(self) -> float:
        return self.factor


class ClassDecoder(Decoder):
    def before(self, i: int) -> None:
        ClassScaled.factor = 1.0 + i


SCALE_VAR: contextvars.ContextVar[float] = contextvars.ContextVar("scale", default=1.0)


class InheritedScaled(Residual):
    """Reads a class attribute whose default is nn.Module's (``call_super_init``)."""

    def scale(self) -> float:
        return 2.0 if self.call_super_init else 1.0


class InheritedDecoder(Decoder):
    def before(self, i: int) -> None:
        InheritedScaled.call_super_init = i % 2 == 1


class AttributeScaled(Residual):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def scale(self) -> float:
        return self.factor


class AttributeDecoder(Decoder):
    def before(self, i: int) -> None:
        self.blocks[i].factor = 1.0 + i


class ContextScaled(Residual):
    def scale(self) -> float:
        return SCALE_VAR.get()


class ContextDecoder(Decoder):
    def before(self, i: int) -> None:
        SCALE_VAR.set(2.0 + i)


def _cell_scaled() -> tuple[type[Residual], Callable[[float], None]]:
    """A block class whose scale is a closure cell, and the function that sets it."""
    value = 1.0

    class CellScaled(Residual):
        def scale(self) -> float:
            return value

    def set_value(v: float) -> None:
        nonlocal value
        value = v

    return CellScaled, set_value


CellScaled, set_cell_scale = _cell_scaled()


class CellDecoder(Decoder):
    def before(self, i: int) -> None:
        set_cell_scale(1.0 + i)


ACTIVATION = F.gelu


class GlobalActivation(Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + ACTIVATION(self.fc(x))


class ActivationDecoder(Decoder):
    def before(self, i: int) -> None:
        global ACTIVATION
        ACTIVATION = F.gelu if i % 2 == 0 else torch.tanh


class StochasticDepth(Residual):
    """Skips its residual branch at random (Python's generator)."""

    def scale(self) -> float:
        return 0.0 if random.random() < 0.5 else 1.0


class RandomDecoder(Decoder):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        random.seed(0)
        return super().forward(ids)


class Made:
    """An object a block makes; its constructor counts, on the class."""

    made = 0

    def __init__(self, value: float) -> None:
        self.value = value
        Made.made += 1


class Making(Residual):
    def scale(self) -> float:
        return Made(1.0).value * Made.made


class MakingDecoder(Decoder):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        Made.made = 0
        return super().forward(ids)


class Counting(Residual):
    calls = 0

    def scale(self) -> float:
        self.calls += 1
        return float(self.calls)


class Split(nn.Module):
    """Returns its activation and a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x)) * 1.5
        return h, h[..., :2]


class Signed(Residual):
    """The sign of a zero attribute decides the residual's sign."""

    def __init__(self, zero: float) -> None:
        super().__init__()
        self.zero = zero

    def scale(self) -> float:
        return math.copysign(1.0, self.zero)


AUX: list[torch.Tensor] = []


class AuxOnSelf(Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux = h.pow(2).mean()
        return x + F.gelu(h)


class AuxInGlobal(Residual):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        AUX.append(h.pow(2).mean())
        return x + F.gelu(h)


class AuxInArgument(Residual):
    def forward(self, x: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        h = self.fc(x)
        aux.append(h.pow(2).mean())
        return x + F.gelu(h)


class AuxArgumentDecoder(Decoder):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, aux = self.tok(ids), []
        for block in self.blocks:
            x = block(x, aux)
        return self.head(x) + sum(aux)


class AuxDecoder(Decoder):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        AUX.clear()
        logits = super().forward(ids)
        aux = [b.aux for b in self.blocks if "aux" in vars(b)] + AUX
        return logits + sum(aux)


def _model(case: str, n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    if case == "global per layer":
        return GlobalDecoder([GlobalScaled() for _ in range(n)])
    if case == "property over a class dict":
        return PropertyDecoder([PropertyScaled() for _ in range(n)])
    if case == "class attribute per layer":
        return ClassDecoder([ClassScaled() for _ in range(n)])
    if case == "class attribute with torch's default":
        return InheritedDecoder([InheritedScaled() for _ in range(n)])
    if case == "attribute the parent sets per layer":
        return AttributeDecoder([AttributeScaled() for _ in range(n)])
    if case == "context variable":
        return ContextDecoder([ContextScaled() for _ in range(n)])
    if case == "closure cell per layer":
        return CellDecoder([CellScaled() for _ in range(n)])
    if case == "global function per layer":
        return ActivationDecoder([GlobalActivation() for _ in range(n)])
    if case == "Python's random generator":
        return RandomDecoder([StochasticDepth() for _ in range(n)])
    if case == "constructor that counts":
        return MakingDecoder([Making() for _ in range(n)])
    if case == "counter on self":
        return Decoder([Counting() for _ in range(n)])
    if case == "aliasing outputs":
        return Decoder([Split() for _ in range(n)])
    if case == "signed zeros":
        return Decoder([Signed(z) for z in (0.0, -0.0) * 3])
    if case == "aux loss on self":
        return AuxDecoder([AuxOnSelf() for _ in range(n)])
    if case == "aux loss in a list argument":
        return AuxArgumentDecoder([AuxInArgument() for _ in range(n)])
    if case == "aux loss in a global list":
        return AuxDecoder([AuxInGlobal() for _ in range(n)])
    return Decoder([Residual() for _ in range(n)])


def _step(model: nn.Module, frozen: tuple[str, ...] = ()):
    """``step(params, ids) -> (loss, grads)``; the parameters under ``frozen`` prefixes are
    detached inside the step (fine-tuning the rest)."""
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, ids):
        def loss_fn(p):
            p = {k: v.detach() if k.startswith(frozen) else v for k, v in p.items()}
            return next_token_loss(apply(p, buffers, ids), ids)

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        return fddp.pmean(loss), fddp.pmean(grads)

    return step, (params, token_batch(0, 2, length=6))


def _run(step, args, monkeypatch, *, replay: bool) -> tuple[list[torch.Tensor], int]:
    """The captured step's outputs, and how many block calls were replayed."""
    captured, replays = captured_counting_replays(step, args, monkeypatch, replay=replay)
    assert captured.graph is not None and captured.method == "make_fx"
    tensors = [x.clone() for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    return list(captured.graph(*tensors)), replays


def _check(case: str, monkeypatch, frozen: tuple[str, ...] = ()) -> int:
    """Replayed equals traced bitwise and eager closely, each on a fresh model; returns the
    replayed calls."""
    fddp.init()
    got, calls = _run(*_step(_model(case), frozen), monkeypatch, replay=True)
    want, none = _run(*_step(_model(case), frozen), monkeypatch, replay=False)
    assert none == 0
    assert_trees_equal(got, want)
    reference = optree.tree_leaves(_eager(*_step(_model(case), frozen)))
    assert_trees_close(want, reference, rtol=1e-5, atol=1e-6)
    return calls


def _eager(step, args):
    AUX.clear()
    return step(*args)


def test_blocks_whose_parameters_are_detached_get_their_own_template(monkeypatch):
    """Block 0's parameters detached, blocks 1-3 trained: their gradients are not zero."""
    _check("plain", monkeypatch, frozen=("blocks.0.",))
    step, args = _step(_model("plain"), ("blocks.0.",))
    _, grads = step(*args)
    assert all(grads[f"blocks.{i}.fc.weight"].abs().sum() > 0 for i in range(1, 4))


@pytest.mark.parametrize(
    "case",
    [
        "global per layer",
        "property over a class dict",
        "class attribute per layer",
        "class attribute with torch's default",
        "attribute the parent sets per layer",
        "context variable",
        "closure cell per layer",
        "global function per layer",
        "Python's random generator",
        "constructor that counts",
    ],
)
def test_a_value_read_outside_the_block_is_read_for_each_call(case, monkeypatch):
    _check(case, monkeypatch)


def test_a_block_that_counts_its_calls_counts_every_call(monkeypatch):
    fddp.init()
    counts = []
    for replay in (True, False):
        model = _model("counter on self")
        with monkeypatch.context() as m:
            m.setattr(_repeated, "ENABLED", replay)
            captured_step(*_step(model))
        counts.append([vars(b).get("calls") for b in model.blocks])
    assert counts[0] == counts[1] == [1, 1, 1, 1]
    _check("counter on self", monkeypatch)


def test_a_view_among_the_outputs_written_in_place_reaches_the_gradient(monkeypatch):
    _check("aliasing outputs", monkeypatch)


def test_zero_and_negative_zero_attributes_get_two_templates(monkeypatch):
    assert _check("signed zeros", monkeypatch) == 6


@pytest.mark.parametrize(
    "case", ["aux loss on self", "aux loss in a global list", "aux loss in a list argument"]
)
def test_tensors_kept_outside_the_block_are_the_capture_s_own(case, monkeypatch):
    _check(case, monkeypatch)


def test_plain_blocks_are_still_replayed_from_one_template(monkeypatch):
    templates = []
    template = _repeated._template

    def counted(*args):
        templates.append(template(*args))
        return templates[-1]

    monkeypatch.setattr(_repeated, "_template", counted)
    assert _check("plain", monkeypatch) == 4
    assert len(templates) == 1 and templates[0] is not None  # the blocks' forwards are their own


def _train(case: str, frozen: tuple[str, ...], *, replay: bool) -> dict[str, torch.Tensor]:
    """Two data_parallel SGD steps of ``case``'s model on this rank's half of the batch."""
    model = _model(case)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, ids):
        def loss_fn(p):
            p = {k: v.detach() if k.startswith(frozen) else v for k, v in p.items()}
            return next_token_loss(apply(p, buffers, ids), ids)

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        grads = fddp.pmean(grads)
        return {k: v - 0.1 * grads[k] for k, v in params.items()}, fddp.pmean(loss)

    saved = _repeated.ENABLED
    _repeated.ENABLED = replay
    try:
        pstep = fddp.data_parallel(step)
        for i in range(2):
            params, _ = pstep(params, fddp.shard(token_batch(i, 4, length=6)))
    finally:
        _repeated.ENABLED = saved
    return params


def check_training(case: str, frozen: tuple[str, ...] = ()) -> list[str]:
    """The parameters that differ between training with and without replay."""
    fddp.init()
    got = _train(case, frozen, replay=True)
    want = _train(case, frozen, replay=False)
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


CHECKS = {
    "first block frozen": functools.partial(check_training, "plain", ("blocks.0.",)),
    "global per layer": functools.partial(check_training, "global per layer"),
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks(CHECKS, world_size=2)


@pytest.mark.parametrize("name", list(CHECKS))
def test_training_on_two_ranks_equals_training_without_replay(name, two_ranks):
    assert two_ranks[name] == [[], []]
