"""torch.utils.checkpoint inside a traced step becomes a fddp.remat region with the full policy:
every way of calling it (use_reentrant=False and True, ``checkpoint`` bound before fddp was
imported, ``checkpoint_sequential``, a Hugging Face model's ``gradient_checkpointing_enable()``
captured by Dynamo) gives gradients bitwise equal to the same step without checkpointing,
dropout included, and the plan recomputes the region; a selective ``context_fn`` raises an error
that names fddp.remat."""

from __future__ import annotations

import functools

import optree
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint as bound_checkpoint  # Hugging Face's binding

import fddp
from fddp._base._errors import UsageValueError

MODES = ("none", "non_reentrant", "reentrant", "bound", "sequential")


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.drop(torch.tanh(self.fc(x))))


class _Net(nn.Module):
    """Three blocks with dropout, each run as ``mode`` says."""

    def __init__(self, mode: str, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mode = mode
        self.blocks = nn.Sequential(*(_Block(dim) for _ in range(3)))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "sequential":
            x = torch_checkpoint.checkpoint_sequential(self.blocks, 3, x, use_reentrant=False)
        for block in self.blocks if self.mode != "sequential" else ():
            if self.mode == "non_reentrant":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
            elif self.mode == "reentrant":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=True)
            elif self.mode == "bound":
                x = bound_checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def _pstep(model: nn.Module, **kwargs):
    apply = fddp.functional(model)

    def loss_fn(p, x, y):
        return F.mse_loss(apply(p, {}, x), y)

    def step(p, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(p, x, y)
        return fddp.pmean(grads), fddp.pmean(loss)

    return fddp.data_parallel(step, **kwargs)


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def _run(pstep, params, x, y):
    torch.manual_seed(123)  # the dropout masks come from the global generator
    return pstep(params, x, y)


def _recomputed(pstep, *args) -> int:
    """How many ops the plan recomputes in the backward pass."""
    remat = pstep.schedule(*args).remat
    return 0 if remat is None else sum(len(r.recomputed) for r in remat.regions)


def _assert_bitwise(a, b) -> None:
    paths_a, leaves_a, _ = optree.tree_flatten_with_path(a)
    paths_b, leaves_b, _ = optree.tree_flatten_with_path(b)
    assert paths_a == paths_b
    for path, x, y in zip(paths_a, leaves_a, leaves_b):
        assert torch.equal(x, y), f"{path}: max |diff| {(x - y).abs().max().item()}"


@pytest.fixture(scope="module")
def reference():
    model = _Net("none")
    params, _ = fddp.state(model)
    x, y = _data()
    pstep = _pstep(model)
    return params, x, y, _run(pstep, params, x, y), pstep


@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpoint_becomes_a_remat_region(mode, reference) -> None:
    params, x, y, (grads, loss), plain = reference
    model = _Net(mode)
    assert optree.tree_all(
        optree.tree_map(torch.equal, fddp.state(model)[0], params)
    )  # same initial values
    pstep = _pstep(model)
    got_grads, got_loss = _run(pstep, params, x, y)
    _assert_bitwise((got_grads, got_loss), (grads, loss))
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert _recomputed(pstep, params, x, y) > 0
    assert _recomputed(plain, params, x, y) == 0


def test_checkpoint_and_no_checkpoint_differ_with_other_masks(reference) -> None:
    """The bitwise comparison can fail: another seed, other dropout masks, other gradients."""
    params, x, y, (grads, _), _ = reference
    pstep = _pstep(_Net("non_reentrant"))
    torch.manual_seed(124)
    other, _ = pstep(params, x, y)
    assert not all(torch.equal(other[k], grads[k]) for k in grads)


def test_selective_context_fn_names_fddp_remat() -> None:
    model = _Net("none")
    apply = fddp.functional(model)
    params, _ = fddp.state(model)
    context = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )

    def step(p, x, y):
        def loss_fn(p):
            out = torch_checkpoint.checkpoint(
                lambda z: apply(p, {}, z), x, use_reentrant=False, context_fn=context
            )
            return F.mse_loss(out, y)

        return fddp.pmean(fddp.grad(loss_fn)(p))

    with pytest.raises(UsageValueError, match=r"fddp\.remat\(fn, policy=") as info:
        fddp.data_parallel(step)(params, *_data())
    assert "test_torch_checkpoint.py" in str(info.value)  # where the checkpoint call is


def _gpt2(checkpointing: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()  # dropout 0.1 in every block
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def test_hugging_face_gradient_checkpointing_under_dynamo() -> None:
    """GPT-2's mask code needs Dynamo; its blocks call the ``checkpoint`` transformers bound
    at import, which Dynamo turns into a higher-order op: still one region per block."""
    pytest.importorskip("transformers")
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for checkpointing in (False, True):
        model = _gpt2(checkpointing)
        apply = fddp.functional(model)
        params, buffers = fddp.state(model)

        def step(p, ids, apply=apply, buffers=buffers):
            def loss_fn(p):
                return apply(p, buffers, input_ids=ids, labels=ids, use_cache=False).loss

            loss, grads = fddp.value_and_grad(loss_fn)(p)
            return fddp.pmean(grads), fddp.pmean(loss)

        pstep = fddp.data_parallel(step)
        torch.manual_seed(5)
        results.append(pstep(params, ids))
        assert pstep.schedule(params, ids).captured_with == "dynamo"
        assert (_recomputed(pstep, params, ids) > 0) == checkpointing
    _assert_bitwise(results[1], results[0])
