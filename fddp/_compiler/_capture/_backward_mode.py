"""Capture the outermost gradient's backward the way ``loss.backward()`` runs it: untracked."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._C import _functorch
from torch._functorch import eager_transforms
from torch._functorch.pyfunctorch import TransformType, retrieve_all_functorch_interpreters


def _tracked_below(tensor: torch.Tensor) -> bool:
    """Whether plain autograd (below every functorch level) records ops on ``tensor``."""
    while _functorch.is_functorch_wrapped_tensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor.requires_grad


def _nobody_differentiates(
    outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]
) -> bool:
    """True for the backward of a gradient that is the only transform, taken at its own level
    (a ``vjp_fn`` called after its level ended, inside another gradient, is not)."""
    stack = retrieve_all_functorch_interpreters()
    if len(stack) != 1 or stack[0].key() != TransformType.Grad:
        return False
    level = stack[0].level()
    if any(_functorch.maybe_get_level(t) != level for t in outputs):
        return False
    return not any(_tracked_below(t) for t in (*outputs, *inputs))


def _untracked_when_outermost(autograd_grad: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(autograd_grad)
    def wrapper(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("create_graph", True) and _nobody_differentiates(
            tuple(outputs), tuple(inputs)
        ):
            kwargs["create_graph"] = False
        return autograd_grad(outputs, inputs, *args, **kwargs)

    return wrapper


class Interpreter(fx.Interpreter):
    """Runs a Dynamo graph, whose ``_autograd_grad`` nodes hold the function itself, with the
    rule of :func:`eager_backward` for those nodes."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is _AUTOGRAD_GRAD:
            target = _untracked_when_outermost(target)
        return super().call_function(target, args, kwargs)


_AUTOGRAD_GRAD = eager_transforms._autograd_grad


def is_active() -> bool:
    """Whether :func:`eager_backward` is on."""
    return eager_transforms._autograd_grad is not _AUTOGRAD_GRAD


@contextlib.contextmanager
def eager_backward() -> Iterator[None]:
    """Within the block, ``torch.func.grad`` and ``vjp`` at the outermost level record no
    graph of their backward; nested transforms are unchanged."""
    eager_transforms._autograd_grad = _untracked_when_outermost(_AUTOGRAD_GRAD)
    try:
        yield
    finally:
        eager_transforms._autograd_grad = _AUTOGRAD_GRAD
