"""The steps a newcomer writes that a captured program would get silently wrong: a metric read
with ``.item()``, a model switched to ``eval()``, a loss that calls ``model(x)``. Each gives the
eager answer on every call, or an error that names the fix."""

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close
from _dist import run_checks
from _models import mlp
from torch import nn

import fddp
from fddp import CaptureError, ScheduleMismatchError


def _metric_step(read):
    """An SGD step on ``w`` that returns ``read(loss)`` as its metric."""

    def step(w, x):
        loss, g = fddp.value_and_grad(lambda w: ((x @ w) ** 2).mean())(w)
        return w - 0.1 * fddp.pmean(g), read(loss)

    return step


READS = {
    "item": lambda loss: loss.item(),
    "float": lambda loss: {"loss": float(loss)},
    "int": lambda loss: int(loss * 100),
    "tolist": lambda loss: (loss * 100).long().reshape(1).tolist(),
    "numpy": lambda loss: loss.detach().numpy(),
}


@pytest.mark.parametrize("how", sorted(READS))
def test_a_metric_read_into_python_is_a_capture_error_a_read_the_graph_uses_is_not(how):
    step = fddp.data_parallel(_metric_step(READS[how]))
    w = torch.ones(2)
    with pytest.raises(CaptureError) as info:
        step(w, torch.randn(3, 2))
    message = str(info.value)
    assert "returns a Python value read from a tensor" in message, message
    assert "call .item() on the step's result, outside the step" in message, message
    assert f"{__file__}:" in message and "READS" not in message, message
    with pytest.raises(CaptureError, match="returns a Python value"):
        step(w, torch.randn(3, 2))  # the next call too, not a value from the first

    def scaled(w, x):  # the graph itself uses the values read: read again at every call
        g = fddp.grad(lambda w: ((x @ w) ** 2).mean())(w)
        return w - 0.1 / x.abs().sum().item() * fddp.pmean(g), torch.scalar_tensor(x[0, 0].item())

    pstep = fddp.data_parallel(scaled)
    for i in range(3):
        x = torch.randn(3, 2) * (i + 1)
        assert_trees_close(pstep(w, x), scaled(w, x), rtol=1e-6, atol=1e-6)


def test_a_metric_read_into_python_with_compile_true_names_the_line():
    step = fddp.data_parallel(_metric_step(lambda loss: loss.item()), compile=True)
    with pytest.raises(CaptureError) as info:
        step(torch.ones(2), torch.randn(3, 2))
    message = str(info.value)
    assert "reads a tensor's value into Python" in message, message
    assert "loss.item()" in message and f"{__file__}:" in message, message


@pytest.mark.parametrize("capture", ["make_fx", "dynamo"])
def test_train_and_eval_modes_switched_back_and_forth_give_the_eager_numbers(capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    params, buffers = fddp.state(model)
    buffers["1.running_mean"].copy_(torch.randn(4))  # eval differs from train by more than a bit
    apply = fddp.functional(model, return_buffers=True)

    def loss_fn(p, x, y):
        if capture == "dynamo" and not torch.compiler.is_compiling() and x.sum() > 1e9:
            x = x * 2  # make_fx cannot trace the branch: Dynamo captures the step
        out, new_buffers = apply(p, buffers, x)
        return F.mse_loss(out, y), new_buffers

    def step(p, x, y):
        (loss, new_buffers), g = fddp.value_and_grad(loss_fn, has_aux=True)(p, x, y)
        new = {k: v - 0.1 * fddp.pmean(g[k]) for k, v in p.items()}
        return new, new_buffers, fddp.pmean(loss)

    pstep = fddp.data_parallel(step)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    modes = ["train", "eval", "train", "eval", "norm in eval"]
    results = {}
    for mode in modes:
        model.train(mode != "eval")
        model[1].train(mode == "train")
        results[mode] = pstep(params, x, y)
        assert_trees_close(results[mode], step(params, x, y), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(results["train"][2], results["eval"][2])
    assert pstep.retraces == 2  # one program per mode, each captured once


def _bn_model_step():
    """A BatchNorm model (eval differs from train) and an SGD step on its parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    params, buffers = fddp.state(model)
    buffers["1.running_mean"].copy_(torch.randn(4))
    apply = fddp.functional(model)

    def step(p, x, y):
        loss, g = fddp.value_and_grad(lambda p: F.mse_loss(apply(p, buffers, x), y))(p)
        return {k: v - 0.1 * fddp.pmean(g[k]) for k, v in p.items()}, fddp.pmean(loss)

    return model, params, step


def _modes_on_two_ranks():
    """Both ranks in eval: one process's numbers on the global batch; then only rank 1 back in
    train mode: an error on both ranks instead of two different programs."""
    model, params, step = _bn_model_step()
    pstep = fddp.data_parallel(step)
    rank = fddp.rank()
    x, y = torch.randn(12, 3, generator=torch.Generator().manual_seed(1)), torch.randn(12, 1)
    pstep(params, x[rank::2], y[rank::2])  # train mode, the first program
    model.eval()
    got = pstep(params, x[rank::2], y[rank::2])
    expected = step(params, x, y)
    model.train(rank == 1)
    try:
        pstep(params, x[rank::2], y[rank::2])
    except ScheduleMismatchError as e:
        return got, expected, str(e)
    return got, expected, "no error"


@pytest.fixture(scope="module")
def runs():
    return run_checks({"modes": _modes_on_two_ranks}, 2, timeout=180)


def test_eval_mode_on_two_ranks_equals_one_process_and_ranks_must_agree_on_it(runs):
    for got, expected, error in runs["modes"]:
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
        assert "the models' train/eval modes" in error, error


def test_a_program_loaded_from_the_persistent_cache_is_captured_again_for_another_mode(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(fddp._compiler._cache._persistent, "_directory", str(tmp_path / "programs"))
    model, params, step = _bn_model_step()
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    fddp.data_parallel(step)(params, x, y)  # train mode: captured and written
    restarted = fddp.data_parallel(step)  # shares nothing with the first but the directory
    for mode in ("train", "eval", "train"):
        model.train(mode == "train")
        assert_trees_close(restarted(params, x, y), step(params, x, y), rtol=1e-6, atol=1e-6)
    assert restarted.schedule(params, x, y).captured_with == "make_fx, loaded from cache"
    assert restarted.retraces == 1


def _model_and_data():
    model = mlp((3, 4, 1))
    return model, torch.randn(5, 3), torch.randn(5, 1)


def test_a_loss_that_calls_the_model_itself_is_an_error_naming_apply():
    model, x, y = _model_and_data()
    params, buffers = fddp.state(model)

    def own_params_loss(p, x, y):
        return F.mse_loss(model(x), y)  # the model's own parameters: no path from p

    fix = r"apply = fddp\.functional\(model\).*apply\(params, buffers, x\)"
    with pytest.raises(ValueError, match=fix):
        fddp.value_and_grad(own_params_loss)(params, x, y)
    with pytest.raises(ValueError, match=fix):
        fddp.grad(lambda p, x, y: (own_params_loss(p, x, y), {"n": x.shape[0]}), has_aux=True)(
            params, x, y
        )
    with pytest.raises(ValueError, match=fix):
        fddp.accumulate_gradients(own_params_loss, 2, batch_argnums=(1, 2))(params, x, y)
    with pytest.raises(ValueError, match=fix):
        fddp.vmap(lambda p, x, y: fddp.pmean(fddp.grad(own_params_loss)(p, x, y)))(
            {k: v.expand(2, *v.shape) for k, v in params.items()},
            x.expand(2, 5, 3),
            y.expand(2, 5, 1),
        )

    @fddp.data_parallel
    def step(p, x, y):
        g = fddp.pmean(fddp.grad(own_params_loss)(p, x, y))
        return {k: v - 0.1 * g[k] for k, v in p.items()}

    with pytest.raises(ValueError, match=fix):
        step(params, x, y)

    def dynamo_loss(p, x, y):  # make_fx cannot trace the branch: Dynamo captures the step
        if not torch.compiler.is_compiling() and x.sum() > 1e9:
            x = x * 2
        return own_params_loss(p, x, y)

    @fddp.data_parallel
    def dynamo_step(p, x, y):
        g = fddp.pmean(fddp.grad(dynamo_loss)(p, x, y))
        return {k: v - 0.1 * g[k] for k, v in p.items()}

    with pytest.raises(CaptureError, match=fix):
        dynamo_step(params, x, y)

    apply = fddp.functional(model)  # the fix; a parameter the loss leaves out gets zeros
    extra = {"unused": torch.ones(3)}

    def loss_fn(p, extra, x, y):
        return F.mse_loss(apply(p, buffers, x), y)

    got = fddp.grad(loss_fn, argnums=(0, 1))(params, extra, x, y)
    in_step = fddp.data_parallel(
        lambda p, e, x, y: fddp.pmean(fddp.grad(loss_fn, argnums=(0, 1))(p, e, x, y))
    )(params, extra, x, y)
    expected = torch.func.grad(loss_fn, argnums=(0, 1))(params, extra, x, y)
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
    assert_trees_close(in_step, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1]["unused"], torch.zeros(3))
