"""Repeated blocks whose Python reads or writes state besides their tensors, trained with
``data_parallel`` as a user writes them: each step computes what the same step computes run
eagerly (``trace=False``), on one rank and on two, with ``remat`` and with ``shard_params``, and
the model's own state after a call is the state an eager call leaves.

Every block here is one of at least three identical siblings, which fddp traces once and
replays; what each block's Python reads or writes differs from block to block only through
state the blocks share or change (a list, dict or set attribute, a function installed on a
torch class, functions kept in a container attribute, an aux loss appended to a list).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, detached
from _dist import run_checks
from _models import next_token_loss, token_batch
from torch import nn

import fddp
import fddp.optim as optim

DIM, LAYERS, ROWS = 8, 4, 4


class Stack(nn.Module):
    """Embedding, ``blocks`` and a head. ``shared`` (a list, dict or set every block holds too)
    is emptied as each forward starts; the aux losses the blocks append to ``aux`` are added."""

    def __init__(self, blocks: list[nn.Module], shared=None, aux: list | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, DIM)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 32)
        self.shared, self.aux = shared, aux

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            self.shared.clear()
        if self.aux is not None:
            self.aux.clear()
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out if not self.aux else out + sum(self.aux)


class Residual(nn.Module):
    """``x + depth() * gelu(fc(x)) / 4``; subclasses say how a block learns its depth."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def depth(self) -> float:
        return 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.depth() * F.gelu(self.fc(x)) / 4


class DepthFromList(Residual):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def depth(self) -> float:
        self.seen.append(len(self.seen))
        return float(len(self.seen))


class DepthFromDict(Residual):
    def __init__(self, memo: dict) -> None:
        super().__init__()
        self._memo = memo

    def depth(self) -> float:
        self._memo["depth"] = self._memo.get("depth", 0) + 1
        return float(self._memo["depth"])


class DepthFromSet(Residual):
    def __init__(self, names: set) -> None:
        super().__init__()
        self._names = names

    def depth(self) -> float:
        self._names.add(len(self._names))
        return float(len(self._names))


class CountsCalls(Residual):
    """Keeps a list of its own calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def depth(self) -> float:
        self.calls.append(1)
        return 1.0


LINEAR_CALLS: list[None] = []


def counted_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A forward for ``nn.Linear`` that scales each call's output by how many came before."""
    LINEAR_CALLS.append(None)
    return F.linear(x, self.weight, self.bias) * (1.0 + len(LINEAR_CALLS) / 8)


class LinearCallsReset(Stack):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        LINEAR_CALLS.clear()
        return super().forward(ids)


ACTIVATIONS: list[None] = []


def deepening_gelu(x: torch.Tensor) -> torch.Tensor:
    """gelu scaled by how many times it ran before in this forward."""
    ACTIVATIONS.append(None)
    return F.gelu(x) * len(ACTIVATIONS)


class KeptFunctions(nn.Module):
    """Calls the functions it keeps in a container attribute (a tuple or a list)."""

    def __init__(self, container: type) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.functions = container([deepening_gelu])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for f in self.functions:
            h = f(h)
        return x + h / 4


class ActivationsReset(Stack):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ACTIVATIONS.clear()
        return super().forward(ids)


class AuxLoss(Residual):
    """Appends its activation's mean square to a list the model sums into its output."""

    def __init__(self, aux: list) -> None:
        super().__init__()
        self.aux = aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.aux.append(h.pow(2).mean())
        return x + F.gelu(h)


def model(case: str) -> Stack:
    torch.manual_seed(0)
    if case == "list attribute":
        seen: list = []
        return Stack([DepthFromList(seen) for _ in range(LAYERS)], shared=seen)
    if case == "dict attribute":
        memo: dict = {}
        return Stack([DepthFromDict(memo) for _ in range(LAYERS)], shared=memo)
    if case == "set attribute":
        names: set = set()
        return Stack([DepthFromSet(names) for _ in range(LAYERS)], shared=names)
    if case == "own list attribute":
        return Stack([CountsCalls() for _ in range(LAYERS)])
    if case == "function installed on nn.Linear":
        return LinearCallsReset([Residual() for _ in range(LAYERS)])
    if case == "functions in a tuple attribute":
        return ActivationsReset([KeptFunctions(tuple) for _ in range(LAYERS)])
    if case == "functions in a list attribute":
        return ActivationsReset([KeptFunctions(list) for _ in range(LAYERS)])
    assert case == "aux loss appended to a list attribute"
    aux: list = []
    return Stack([AuxLoss(aux) for _ in range(LAYERS)], aux=aux)


CASES = [
    "list attribute",
    "dict attribute",
    "set attribute",
    "own list attribute",
    "function installed on nn.Linear",
    "functions in a tuple attribute",
    "functions in a list attribute",
    "aux loss appended to a list attribute",
]


def _sgd_step(net: nn.Module, opt, sharded: bool) -> Callable:
    """An SGD step; ``sharded``: ``opt`` is ``shard_state``'s (for ``shard_params``), which
    reduces the gradients itself, else ``pmean`` does."""
    apply = fddp.functional(net)
    _, buffers = fddp.state(net)

    def step(params, opt_state, ids):
        loss, grads = fddp.value_and_grad(lambda p: next_token_loss(apply(p, buffers, ids), ids))(
            params
        )
        updates, opt_state = opt.update(grads if sharded else fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step


def train(case: str, *, trace: bool, remat: bool = False, sharded: bool = False, steps: int = 2):
    """``steps`` SGD steps of ``case``'s model on this rank's rows of the batch: the
    parameters, the losses and each block's state after the first call (later calls of a
    traced step run no Python)."""
    net = model(case)
    params, _ = fddp.state(net)
    opt = optim.shard_state(optim.sgd(0.5)) if sharded else optim.sgd(0.5)
    options = {"remat": fddp.remat_policies.nothing_saveable} if remat else {}
    pstep = fddp.data_parallel(_sgd_step(net, opt, sharded), trace=trace, **options)
    opt_state = fddp.data_parallel(opt.init, trace=False)(params)
    if sharded:
        params = fddp.shard_params(params)
    losses, state = [], []
    for i in range(steps):
        params, opt_state, loss = pstep(params, opt_state, fddp.shard(token_batch(i, ROWS, 6)))
        losses.append(loss)
        state = state or [len(vars(b).get("calls", ())) for b in net.blocks]
    if sharded:
        params = fddp.full_params(params)
    return detached((params, losses)), state


def check_case(case: str, *, remat: bool = False, sharded: bool = False) -> None:
    """Training with the traced step equals training eagerly, and leaves the model's state as
    eager training does."""
    fddp.init()
    got, got_state = train(case, trace=True, remat=remat, sharded=sharded)
    want, want_state = train(case, trace=False, remat=remat, sharded=sharded)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_state == want_state


@pytest.fixture
def linear_forward(monkeypatch):
    """``nn.Linear.forward`` replaced by :func:`counted_linear` for the test."""
    monkeypatch.setattr(nn.Linear, "forward", counted_linear)


def _case_fixtures(case: str, request) -> None:
    if case == "function installed on nn.Linear":
        request.getfixturevalue("linear_forward")


@pytest.mark.parametrize("case", CASES)
def test_a_step_equals_the_eager_step(case, request):
    _case_fixtures(case, request)
    check_case(case)


@pytest.mark.parametrize("case", ["list attribute", "dict attribute", "set attribute"])
def test_a_step_with_remat_equals_the_eager_step(case):
    check_case(case, remat=True)


def _two_rank_check(case: str, **options) -> None:
    forward = nn.Linear.forward
    if case == "function installed on nn.Linear":
        nn.Linear.forward = counted_linear
    try:
        check_case(case, **options)
    finally:
        nn.Linear.forward = forward


TWO_RANKS = {
    f"{case}{label}": functools.partial(_two_rank_check, case, **options)
    for case in ["list attribute", "dict attribute", "set attribute"]
    for label, options in [
        ("", {}),
        (" with remat", {"remat": True}),
        (" sharded", {"sharded": True}),
    ]
} | {
    "aux loss appended to a list attribute sharded": functools.partial(
        _two_rank_check, "aux loss appended to a list attribute", sharded=True
    ),
    "function installed on nn.Linear": functools.partial(
        _two_rank_check, "function installed on nn.Linear"
    ),
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks(TWO_RANKS, world_size=2, timeout=600.0)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_train_as_the_eager_step_does(name, two_ranks):
    assert two_ranks[name] == [None, None]
