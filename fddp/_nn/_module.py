"""A torch.nn.Module as a pure function of its parameter and buffer dicts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fddp._base import _model_calls


def state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split ``model`` into ``(params, buffers)``: dicts from qualified name to tensor.

    The module's state as ``model.state_dict()`` holds it (non-persistent buffers included),
    split in two: a step differentiates the parameters and carries the buffers. An optimizer's
    state is another thing: ``opt.init(params)``.

    The tensors are detached (no autograd history, ``requires_grad=False``) and share storage
    with the module; nothing in fddp writes to them unless you donate them. A weight tied to
    several submodules appears once, under its first name.

    >>> import fddp, torch
    >>> params, buffers = fddp.state(torch.nn.BatchNorm1d(3))
    >>> sorted(params), sorted(buffers)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    return params, buffers


def functional(model: nn.Module, *, return_buffers: bool = False) -> Callable[..., Any]:
    """Return ``apply(params, buffers, *args, **kwargs)`` that runs ``model`` statelessly.

    ``apply`` calls ``model.forward`` with the given tensors in place of its own (via
    ``torch.func.functional_call``; tied weights stay tied). The module is never mutated: layers
    that update buffers in training mode (BatchNorm's running statistics) update copies, which
    ``apply`` returns as ``(output, new_buffers)`` when ``return_buffers=True`` and drops
    otherwise (buffers missing from ``buffers`` start from copies of the module's own). The
    module's ``train()``/``eval()`` mode (and each submodule's) is read at each call; a step
    captured by ``fddp.data_parallel`` is captured again when a mode it ran with has changed.

    >>> import fddp, torch
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> params, buffers = fddp.state(bn)
    >>> apply = fddp.functional(bn, return_buffers=True)
    >>> out, new_buffers = apply(params, buffers, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    >>> new_buffers["running_mean"], buffers["running_mean"]
    (tensor([0.1000, 0.2000]), tensor([0., 0.]))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fddp.functional expects a torch.nn.Module, got {type(model).__name__}; a plain "
            "function of (params, *args) is already functional and can be used as it is."
        )

    @functools.wraps(model.forward)
    def apply(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        _model_calls.note(model)  # a capture keys its program on the model's modes
        own = {name: b for name, b in model.named_buffers() if name not in buffers}
        fresh = {name: b.clone() for name, b in {**own, **buffers}.items()}
        if torch.compiler.is_compiling():  # Dynamo traces the model itself
            out = torch.func.functional_call(model, (params, fresh), args, kwargs)
        else:
            with _model_calls.calling(model):  # a capture traces repeated blocks once
                out = torch.func.functional_call(model, (params, fresh), args, kwargs)
        return (out, fresh) if return_buffers else out

    return apply
