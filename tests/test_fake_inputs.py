"""The capture's fake inputs (``_trace.fake_inputs``): plain tensors made directly give the
graph ``FakeTensorMode.from_tensor`` gives, node for node with the same shared storages, also
where arguments alias each other or the step closes over a view of one of them."""

from __future__ import annotations

import pytest
import torch
from _models import captured_step
from test_quick_record import _decoder_step, _described

import fddp
import fddp.optim as optim
from fddp._compiler._capture import _trace


def _graph(step, args, monkeypatch, *, direct: bool):
    made = []
    plain = _trace._fake_of_plain

    def counted(mode, x):
        made.append(x)
        return plain(mode, x)

    with monkeypatch.context() as m:
        m.setattr(_trace, "_DIRECT_FAKES", direct)
        m.setattr(_trace, "_fake_of_plain", counted)
        captured = captured_step(step, args)
    return captured.graph.graph, len(made)


def _aliased_step():
    """A weight passed twice, two slices of one buffer, and, closed over, a transpose of an
    argument that the step writes in place and a detached alias of another (as a module's
    own parameter is of the tensors ``fddp.state`` returns)."""
    w = torch.randn(4, 4)
    flat = torch.randn(8)
    params = {"w": w, "again": w, "a": flat[:4], "b": flat[4:], "v": torch.randn(4)}
    params["u"] = torch.randn(4, 4)
    seen_t = params["v"].view(2, 2).t()  # closed over: shares the storage of params["v"]
    alias = params["u"].detach()  # the same storage, not a view

    def step(params, x):
        y = x @ params["w"] + x @ params["again"] + params["a"] * params["b"]
        params = dict(params)
        params["v"] = params["v"].add_(1.0)
        params["u"] = params["u"].mul_(0.5)
        return params, y.sum() + seen_t.sum() + alias.sum()

    return step, (params, torch.randn(3, 4))


CASES = {
    "decoder, AdamW": lambda: _decoder_step(optim.adamw(1e-3)),
    "aliased arguments and a closed-over view": _aliased_step,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_direct_fakes_give_the_graph_from_tensor_gives(case, monkeypatch):
    fddp.init()
    step, args = CASES[case]()
    direct, made = _graph(step, args, monkeypatch, direct=True)
    reference, none = _graph(step, args, monkeypatch, direct=False)
    assert none == 0 and made > 0
    assert _described(direct) == _described(reference)
