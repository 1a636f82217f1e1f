"""fddp.state / fddp.functional against plain module calls and torch.autograd."""

import copy

import pytest
import torch
from _compare import assert_trees_close, assert_trees_equal
from _models import mlp
from torch import nn

import fddp

MLP_SIZES = (6, 8, 3)


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection (as in GPT-2)."""

    def __init__(self, vocab: int = 7, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(ids))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.bn(self.lin(x)) * scale


def _clone_tree(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tree.items()}


# --- state -----------------------------------------------------------------------------------


def test_state_names_values_detached_and_shared():
    model = BNNet()
    params, buffers = fddp.state(model)
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert list(buffers) == [n for n, _ in model.named_buffers()]
    assert list(buffers) == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p)
        assert not params[name].requires_grad
        assert params[name].grad_fn is None
        assert params[name].data_ptr() == p.data_ptr()  # a view, not a copy
    for name, b in model.named_buffers():
        assert torch.equal(buffers[name], b)


def test_state_tied_weight_appears_once():
    model = TiedLM()
    params, _ = fddp.state(model)
    assert "emb.weight" in params
    assert "out.weight" not in params
    assert sorted(params) == ["emb.weight", "hidden.bias", "hidden.weight"]


# --- functional: plain modules ---------------------------------------------------------------


def test_functional_matches_module_call():
    model = mlp(MLP_SIZES)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    x = torch.randn(5, 6)
    torch.testing.assert_close(apply(params, buffers, x), model(x), rtol=0, atol=0)


def test_functional_uses_given_params_not_the_modules():
    model = mlp(MLP_SIZES)
    params, buffers = fddp.state(model)
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in params.items()}
    ref_model = copy.deepcopy(model)
    ref_model.load_state_dict(new)
    before = _clone_tree(dict(model.state_dict()))
    x = torch.randn(5, 6)
    out = fddp.functional(model)(new, buffers, x)
    torch.testing.assert_close(out, ref_model(x), rtol=0, atol=0)
    assert_trees_equal(dict(model.state_dict()), before)


def test_functional_passes_kwargs():
    model = BNNet().eval()
    params, buffers = fddp.state(model)
    x = torch.randn(3, 5)
    out = fddp.functional(model)(params, buffers, x, scale=3.0)
    torch.testing.assert_close(out, model(x, scale=3.0), rtol=0, atol=0)


def test_functional_gradient_matches_autograd():
    model = mlp(MLP_SIZES)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    x, y = torch.randn(9, 6), torch.randn(9, 3)

    def loss_fn(p):
        return nn.functional.mse_loss(apply(p, buffers, x), y)

    loss, grads = fddp.value_and_grad(loss_fn)(params)
    ref_loss = nn.functional.mse_loss(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    assert_trees_close(loss, ref_loss.detach(), what="loss")
    assert_trees_close(grads, dict(zip(names, ref, strict=True)), what="gradients")


def test_functional_rejects_non_module():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        fddp.functional(lambda p, x: x)


# --- functional: tied weights ----------------------------------------------------------------


def test_tied_weights_output_and_gradient():
    model = TiedLM()
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    ids = torch.tensor([[0, 3, 6], [2, 2, 5]])
    target = torch.tensor([[1, 2, 3], [4, 5, 6]])

    torch.testing.assert_close(apply(params, buffers, ids), model(ids), rtol=0, atol=0)

    def loss_fn(p):
        return nn.functional.cross_entropy(apply(p, buffers, ids).flatten(0, 1), target.flatten())

    grads = fddp.grad(loss_fn)(params)
    ref_loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    (ref_shared,) = torch.autograd.grad(ref_loss, [model.emb.weight])
    # The shared weight's gradient is the sum over both uses (embedding rows + projection).
    torch.testing.assert_close(grads["emb.weight"], ref_shared)
    assert ref_shared.abs().sum() > 0


def test_tied_weights_new_value_reaches_both_uses():
    model = TiedLM()
    params, buffers = fddp.state(model)
    new = {k: v.clone() for k, v in params.items()}
    new["emb.weight"] = torch.randn_like(new["emb.weight"])
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        ref_model.emb.weight.copy_(new["emb.weight"])  # tied in the copy too
    assert ref_model.out.weight is ref_model.emb.weight
    ids = torch.tensor([1, 4, 6])
    torch.testing.assert_close(
        fddp.functional(model)(new, buffers, ids), ref_model(ids), rtol=0, atol=0
    )


# --- functional: BatchNorm -------------------------------------------------------------------


def test_batchnorm_train_updates_buffers_functionally():
    model = BNNet().train()
    params, buffers = fddp.state(model)
    module_before = _clone_tree(dict(model.named_buffers()))
    passed_before = _clone_tree(buffers)
    ref_model = copy.deepcopy(model)
    apply = fddp.functional(model, return_buffers=True)

    b = buffers
    for step in range(3):
        x = torch.randn(8, 5) * (step + 1) + step
        out, b = apply(params, b, x)
        ref_out = ref_model(x)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        assert_trees_equal(b, dict(ref_model.named_buffers()))
    assert int(b["bn.num_batches_tracked"]) == 3
    assert not torch.equal(b["bn.running_mean"], passed_before["bn.running_mean"])

    # Neither the module nor the buffers passed in were touched.
    assert_trees_equal(dict(model.named_buffers()), module_before)
    assert_trees_equal(buffers, passed_before)


def test_batchnorm_without_return_buffers_returns_output_only():
    model = BNNet().train()
    params, buffers = fddp.state(model)
    before = _clone_tree(buffers)
    x = torch.randn(8, 5)
    out = fddp.functional(model)(params, buffers, x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, copy.deepcopy(model)(x), rtol=0, atol=0)
    assert_trees_equal(buffers, before)
    assert_trees_equal(dict(model.named_buffers()), before)


def test_batchnorm_mode_is_read_at_each_call():
    model = BNNet().train()
    params, buffers = fddp.state(model)
    buffers = {
        "bn.running_mean": torch.randn(4),
        "bn.running_var": torch.rand(4) + 0.5,
        "bn.num_batches_tracked": torch.tensor(7),
    }
    apply = fddp.functional(model, return_buffers=True)  # created in train mode
    model.eval()
    ref_model = copy.deepcopy(model)
    ref_model.load_state_dict({**params, **buffers})
    x = torch.randn(6, 5)
    out, new_buffers = apply(params, buffers, x)
    torch.testing.assert_close(out, ref_model(x), rtol=0, atol=0)
    assert_trees_equal(new_buffers, buffers)  # eval mode: running statistics are used, not updated


def test_batchnorm_gradient_and_buffers_through_value_and_grad():
    model = BNNet().train()
    params, buffers = fddp.state(model)
    apply = fddp.functional(model, return_buffers=True)
    x = torch.randn(8, 5)

    def loss_fn(p, b):
        out, new_b = apply(p, b, x)
        return out.square().mean(), new_b

    (loss, new_buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers)

    ref_model = copy.deepcopy(model)
    ref_loss = ref_model(x).square().mean()
    ref = torch.autograd.grad(ref_loss, list(ref_model.parameters()))
    assert_trees_close(loss, ref_loss.detach(), what="loss")
    names = [name for name, _ in ref_model.named_parameters()]
    assert_trees_close(grads, dict(zip(names, ref, strict=True)), what="gradients")
    assert_trees_equal(new_buffers, dict(ref_model.named_buffers()), "new buffers")
