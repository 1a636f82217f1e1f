"""What a newcomer sees when data_parallel cannot capture a step: the cause first, then the fix."""

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import mlp
from torch import nn

import fddp
from fddp import CaptureError, PrintWhileTracingWarning


def _sgd_step(loss_fn):
    @fddp.data_parallel
    def step(params, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        new = {
            k: p - 0.1 * g for k, p, g in zip(params, params.values(), fddp.pmean(grads).values())
        }
        return new, fddp.pmean(loss)

    return step


def _first_lines(error: BaseException, n: int) -> list[str]:
    return str(error).split("\n")[:n]


def test_module_passed_as_params_names_fddp_state_first():
    model = mlp((32, 8, 1))
    step = _sgd_step(lambda p, x, y: F.mse_loss(fddp.functional(model)(p, {}, x), y))
    with pytest.raises(CaptureError) as info:
        step(model, torch.randn(4, 32), torch.randn(4, 1))
    first = _first_lines(info.value, 1)[0]
    assert first.startswith("TypeError: argument 0 is a torch.nn.Module (Sequential)"), first
    assert "fddp.state(model)" in first, first
    assert "Observed exception" not in str(info.value)


def test_grad_of_a_module_is_type_error_naming_fddp_state():
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"fddp\.state\(model\)"):
        fddp.grad(lambda m: m(torch.ones(1, 2)).sum())(model)
    with pytest.raises(TypeError, match=r"argument 0 leaf \['net'\] is a torch\.nn\.Module"):
        fddp.grad(lambda t: t["net"](torch.ones(1, 2)).sum())({"net": model})


def test_shape_error_is_one_capture_error_with_the_models_message_and_where(capfd):
    model = mlp((32, 8, 1))
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)

    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, buffers, x), y)  # the line the error names

    step = _sgd_step(loss_fn)
    capfd.readouterr()
    with pytest.raises(CaptureError) as info:
        step(params, torch.randn(4, 31), torch.randn(4, 1))
    first, where = _first_lines(info.value, 2)
    assert (
        first == "RuntimeError: a and b must have same reduction dim, but got [4, 31] X [32, 8]."
    ), first
    assert f"{__file__}:" in where and "apply(params, buffers, x)" in where, where
    assert "trace=False" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    logged = capfd.readouterr()
    assert "fake_tensor.py" not in logged.err + logged.out
    assert "failed while attempting to run meta" not in logged.err + logged.out


PRINTS = {
    "tensor": lambda loss: print("loss", loss),
    "f-string": lambda loss: print(f"losses {loss.reshape(1)}"),
    "dict": lambda loss: print({"loss": loss}),
}


@pytest.mark.parametrize("how", list(PRINTS))
def test_print_in_a_step_warns_once_at_capture_and_never_runs_again(capsys, how):
    model = nn.Linear(4, 1)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)

    def loss_fn(params, x, y):
        loss = F.mse_loss(apply(params, buffers, x), y)
        PRINTS[how](loss)
        return loss

    step = _sgd_step(loss_fn)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.warns(PrintWhileTracingWarning, match="return the values|Return the values"):
        step(params, x, y)
    assert "FakeTensor" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, loss = step(params, x, y)
    assert capsys.readouterr().out == ""
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach())


def test_formatting_a_scalar_in_a_step_is_a_capture_error_saying_how_to_log():
    """``f"{loss:.3f}"`` needs the value (``.item()``): make_fx stops, and Dynamo names print."""

    @fddp.data_parallel
    def step(w):
        loss = (w**2).sum()
        print(f"loss {loss:.3f}")
        return fddp.pmean(w - 0.1 * loss)

    with pytest.raises(CaptureError) as info:
        step(torch.ones(2))
    first, where = _first_lines(info.value, 2)
    assert first.endswith("it prints a tensor"), first
    assert 'print(f"loss {loss:.3f}")' in where, where
    assert "print them outside the step" in str(info.value)


def test_print_of_a_plain_string_does_not_warn(capsys):
    @fddp.data_parallel
    def step(w):
        print("capturing")
        return fddp.pmean(w * 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(step(torch.ones(2)), torch.full((2,), 2.0))
    assert capsys.readouterr().out == "capturing\n"


def test_print_in_a_step_only_dynamo_can_capture_says_how_to_log():
    @fddp.data_parallel
    def step(w):
        if not torch.compiler.is_compiling() and bool(w.sum() > 1e9):  # make_fx stops here
            raise AssertionError("unreachable")
        print("w is", w)
        return fddp.pmean(w * 2)

    with pytest.raises(CaptureError) as info:
        step(torch.ones(2))
    message = str(info.value)
    assert message.startswith("fddp.data_parallel could not capture the step as one graph"), message
    assert "print them outside the step" in message and "trace=False" in message, message


def test_branch_on_a_tensor_value_names_the_line_and_the_fix():
    @fddp.data_parallel
    def step(w):
        if w.sum().item() > 0:  # the line the error names
            w = w * 2
        return fddp.pmean(w)

    with pytest.raises(CaptureError) as info:
        step(torch.ones(2))
    message = str(info.value)
    assert "item" in message.split("\n")[0], message
    assert f"{__file__}:" in message and "w.sum().item()" in message, message
    assert "torch.where" in message and "trace=False" in message, message


def test_a_wrong_keyword_to_forward_is_named_first():
    model = nn.Linear(3, 2)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)

    @fddp.data_parallel
    def step(params, x):
        loss = apply(params, buffers, x, return_buffers=True).sum()  # a keyword forward lacks
        return fddp.pmean(fddp.grad(lambda p: loss)(params))

    with pytest.raises(CaptureError) as info:
        step(params, torch.ones(4, 3))
    first, where = _first_lines(info.value, 2)
    assert first.startswith("TypeError: ") and "'return_buffers'" in first, first
    assert f"{__file__}:" in where, where


def test_a_slice_bound_read_from_a_tensor_names_the_line():
    @fddp.data_parallel
    def step(w, x):
        n = int((x > 0).sum())  # the line the error names
        g = fddp.grad(lambda w: (x[:n] @ w).pow(2).mean())(w)
        return w - 0.1 * fddp.pmean(g)

    with pytest.raises(CaptureError) as info:
        step(torch.ones(3), torch.randn(5, 3))
    message = str(info.value)
    assert f"{__file__}:" in message and "int((x > 0).sum())" in message, message
    assert "shape" in message.split("\n")[0] and "trace=False" in message, message


RNG = random.Random(0)
DRAWS = {"module": lambda: random.random(), "instance": lambda: RNG.uniform(0, 1)}


@pytest.mark.parametrize("generator", list(DRAWS))
def test_a_draw_from_python_s_random_generator_says_why_it_cannot_be_traced(generator):
    @fddp.data_parallel
    def step(w, x):
        scale = DRAWS[generator]()
        g = fddp.grad(lambda w: (x @ w * scale).pow(2).mean())(w)
        return w - 0.1 * fddp.pmean(g)

    with pytest.raises(CaptureError) as info:
        step(torch.ones(3), torch.randn(5, 3))
    message = str(info.value)
    assert "random" in message.split("\n")[0] and "torch.rand" in message, message
    assert f"{__file__}:" in message and "DRAWS = " in message, message


def test_a_generator_seeded_in_the_step_is_traced():
    @fddp.data_parallel
    def step(w, x):
        random.seed(0)
        scale = random.random() + random.Random(1).random()
        g = fddp.grad(lambda w: (x @ w * scale).pow(2).mean())(w)
        return w - 0.1 * fddp.pmean(g)

    w, x = torch.ones(3), torch.randn(5, 3)
    torch.testing.assert_close(step(w, x), step.__wrapped__(w, x))
