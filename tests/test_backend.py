"""What the captured graph holds for composite ops, and that it computes what eager does.

The outermost gradient is captured as ``loss.backward()`` runs it (no graph of the backward), so
an LSTM keeps one forward and one backward kernel per layer instead of thousands of cell ops;
gradients of gradients still trace the differentiable backward.
"""

from __future__ import annotations

import collections
import inspect

import optree
import torch
import torch.nn.functional as F
from torch import nn

import fddp
from fddp._schedule._backend import direct_calls
from fddp._schedule._capture import lower_to_aten, trace_with_make_fx


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


def _targets(captured) -> collections.Counter:
    nodes = captured.graph.graph.nodes
    return collections.Counter(str(n.target) for n in nodes if n.op == "call_function")


def test_lstm_gradient_keeps_one_backward_kernel_per_layer_and_equals_eager_backward():
    model, params, x, target = _lstm_model()
    captured = trace_with_make_fx(fddp.value_and_grad(_loss(model)), (params, x, target))
    targets = _targets(captured)
    assert targets["aten.mkldnn_rnn_layer_backward.default"] == 2, targets
    assert sum(targets.values()) < 60, targets  # the cell loop over 6 steps would be ~900
    loss, *grads = captured.graph(*optree.tree_leaves((params, x, target)))
    expected_loss = _loss(model)(dict(model.named_parameters()), x, target)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=0)
    named = dict(model.named_parameters())
    expected = optree.tree_leaves({k: named[k].grad for k in params})
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)


def test_gradient_of_a_gradient_through_an_lstm_matches_eager():
    model, params, x, target = _lstm_model(dim=4, layers=1, steps=2)
    inner = fddp.grad(_loss(model))

    def outer(params, x, target):
        g = inner(params, x, target)
        return sum((v**2).sum() for v in g.values())

    step = fddp.grad(outer)
    captured = trace_with_make_fx(step, (params, x, target))
    got = captured.graph(*optree.tree_leaves((params, x, target)))
    expected = optree.tree_leaves(step(params, x, target))
    torch.testing.assert_close(got, expected)
    assert any(v.abs().sum() > 0 for v in got)


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
    captured = trace_with_make_fx(step, (w,))
    (got,) = captured.graph(w)
    torch.testing.assert_close(got, step(w))
    assert got.abs().sum() > 0


def _dynamo_then_aten(fn, *args):
    """Capture ``fn`` with Dynamo and lower its graph to aten as the Dynamo capture path does."""
    lowered = []

    def backend(gm, example_inputs):
        lowered.append(lower_to_aten(gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return lowered[0]


def test_dynamo_path_first_and_second_order_gradients_match_eager():
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(3, 4)

    def loss(w, x):
        return torch.tanh(x @ w).pow(2).sum()

    first = torch.func.grad(loss)
    second = torch.func.grad(lambda w, x: first(w, x).sin().sum())
    for fn in (first, second):
        (got,) = _dynamo_then_aten(fn, w, x)(w, x)
        torch.testing.assert_close(got, fn(w, x))


def test_direct_calls_run_the_graph_without_operator_wrappers_and_give_the_same_tensors():
    model, params, x, target = _lstm_model(dim=4, layers=1, steps=3)
    captured = trace_with_make_fx(fddp.value_and_grad(_loss(model)), (params, x, target))
    gm = captured.graph
    forward = direct_calls(gm)
    inputs = optree.tree_leaves((params, x, target))
    assert "torch.ops." not in inspect.getsource(forward.func)
    for got, expected in zip(forward(*inputs), gm(*inputs), strict=True):
        assert torch.equal(got, expected)


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
    for name in params:
        torch.testing.assert_close(compiled[0][name], eager[0][name], rtol=1e-5, atol=1e-6)
    targets = {str(n.target) for n in pstep.graph(params, x, target).graph.nodes}
    assert not any("mkldnn_rnn_layer_backward" in t for t in targets)
