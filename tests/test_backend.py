"""What the captured graph holds for composite ops, and that it computes what eager does.

The outermost gradient is captured as ``loss.backward()`` runs it (no graph of the backward), so
an LSTM keeps one forward and one backward kernel per layer instead of thousands of cell ops;
gradients of gradients still trace the differentiable backward. Observed through the public
API: a step's results, ``pstep.graph(*args)`` (the scheduled graph it runs) and
``pstep.schedule(*args).captured_with``.
"""

from __future__ import annotations

import collections
import sys

import optree
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from torch import nn

import fddp
from fddp._compiler._capture import _trace


def _lstm_model(
    dim: int = 8, layers: int = 2, steps: int = 6
) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, target = torch.randn(3, steps, dim), torch.randn(3, steps, dim)
    return model, params, x, target


def _loss(model: nn.Module):
    def loss(params, x, target):
        out, _ = torch.func.functional_call(model, params, (x,))
        return F.mse_loss(out, target)

    return loss


def _targets(graph) -> collections.Counter:
    return collections.Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")


def test_lstm_gradient_keeps_one_backward_kernel_per_layer_and_equals_eager_backward():
    model, params, x, target = _lstm_model()
    pstep = fddp.data_parallel(fddp.value_and_grad(_loss(model)))
    targets = _targets(pstep.graph(params, x, target))
    assert targets["aten.mkldnn_rnn_layer_backward.default"] == 2, targets
    assert sum(targets.values()) < 60, targets  # the cell loop over 6 steps would be ~900
    loss, grads = pstep(params, x, target)
    expected_loss = _loss(model)(dict(model.named_parameters()), x, target)
    expected_loss.backward()
    assert_trees_equal(loss, expected_loss.detach(), "loss")
    named = dict(model.named_parameters())
    assert_trees_equal(grads, {k: named[k].grad for k in params}, "gradients")


def test_gradient_of_a_gradient_through_an_lstm_matches_eager():
    model, params, x, target = _lstm_model(dim=4, layers=1, steps=2)
    inner = fddp.grad(_loss(model))

    def outer(params, x, target):
        g = inner(params, x, target)
        return sum((v**2).sum() for v in g.values())

    step = fddp.grad(outer)
    got = fddp.data_parallel(step)(params, x, target)
    assert_trees_close(got, step(params, x, target))
    assert any(v.abs().sum() > 0 for v in got.values())


def test_vjp_function_called_inside_a_gradient_is_still_differentiated():
    """A vjp's level has ended when its function is called; the gradient around it needs that
    backward recorded."""
    torch.manual_seed(0)
    w, x, v = torch.randn(5), torch.randn(5), torch.randn(5)

    def loss(w):
        _, vjp_fn = torch.func.vjp(lambda u: torch.tanh(u * w), x)
        (g,) = vjp_fn(v)
        return g.sum()

    step = torch.func.grad(loss)
    got = fddp.data_parallel(step)(w)
    assert_trees_close(got, step(w))
    assert got.abs().sum() > 0


def _only_dynamo_can_trace(x: torch.Tensor) -> None:
    """Branch on a tensor value unless Dynamo traces (as Hugging Face's mask code does): make_fx
    stops here, so data_parallel captures the step with Dynamo."""
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):
        raise AssertionError("unreachable")


def test_dynamo_path_first_and_second_order_gradients_match_eager():
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(3, 4)

    def loss(w, x):
        _only_dynamo_can_trace(x)
        return torch.tanh(x @ w).pow(2).sum()

    first = torch.func.grad(loss)
    second = torch.func.grad(lambda w, x: first(w, x).sin().sum())
    for fn in (first, second):
        pstep = fddp.data_parallel(fn)
        for _ in range(2):  # the first call runs through Dynamo, the second the graph alone
            assert_trees_close(pstep(w, x), fn(w, x))
        assert pstep.schedule(w, x).captured_with == "dynamo"


def test_a_step_that_needed_dynamo_is_not_traced_with_make_fx_again(monkeypatch):
    """A retrace (a new batch shape) of a step make_fx could not trace goes to Dynamo at once:
    the make_fx attempt would fail again, after tracing up to the failing line."""
    attempts = []
    make_fx_trace = _trace.trace_with_make_fx

    def counted(*args, **kwargs):
        attempts.append(1)
        return make_fx_trace(*args, **kwargs)

    monkeypatch.setattr(_trace, "trace_with_make_fx", counted)
    torch.manual_seed(0)
    w = torch.randn(4, 4)

    def step(w, x):
        def loss(w):
            _only_dynamo_can_trace(x)
            return torch.tanh(x @ w).pow(2).sum()

        return w - 0.1 * fddp.pmean(fddp.grad(loss)(w))

    pstep = fddp.data_parallel(step)
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        assert_trees_close(pstep(w, x), step(w, x))
        assert pstep.schedule(w, x).captured_with == "dynamo"
    assert len(attempts) == 1 and pstep.retraces == 1


def _operator_wrapper_calls(fn, *args):
    """``fn(*args)``'s result, and how many times a graph's ``forward`` called an operator
    through its Python wrapper (``OpOverload.__call__``) meanwhile."""
    wrapper = torch._ops.OpOverload.__call__.__code__
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is wrapper and frame.f_back.f_code.co_name == "forward":
            calls.append(1)

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, len(calls)


def test_the_graph_runs_without_operator_wrappers_and_gives_the_same_tensors():
    model, params, x, target = _lstm_model(dim=4, layers=1, steps=3)
    pstep = fddp.data_parallel(fddp.value_and_grad(_loss(model)))
    pstep(params, x, target)  # compiled; the next call only runs the graph
    gm = pstep.graph(params, x, target)
    inputs = optree.tree_leaves((params, x, target))
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == len(inputs)
    expected, through_wrappers = _operator_wrapper_calls(gm, *inputs)  # FX's own forward
    assert through_wrappers > 10  # what the probe sees when the wrappers are called
    got, wrapped = _operator_wrapper_calls(pstep, params, x, target)
    assert wrapped == 0
    assert_trees_equal(optree.tree_leaves(got), list(expected), "the step vs its graph")


def test_compile_true_gets_the_differentiable_lstm_backward_inductor_can_compile():
    """Inductor (torch 2.13) fails on the graph with the fused mkldnn_rnn_layer backward;
    compile=True captures the differentiable backward instead, and trains like the eager step."""
    model, params, x, target = _lstm_model(dim=4, layers=1, steps=3)
    loss = _loss(model)

    def step(params, x, target):
        value, grads = fddp.value_and_grad(loss)(params, x, target)
        return {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads.values())}, value

    eager = fddp.data_parallel(step, trace=False)(params, x, target)
    pstep = fddp.data_parallel(step, compile=True)
    compiled = pstep(params, x, target)
    assert_trees_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6, what="params")
    targets = {str(n.target) for n in pstep.graph(params, x, target).graph.nodes}
    assert not any("mkldnn_rnn_layer_backward" in t for t in targets)
