"""The hook through which a capture watches the models ``fddp.functional``'s ``apply`` runs."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

Hook = Callable[[nn.Module], AbstractContextManager[Any]]
_HOOK: contextvars.ContextVar[Hook | None] = contextvars.ContextVar("fddp_model_hook", default=None)
# A plain list, not a context variable: Dynamo traces ``note`` inside a user's torch.compile.
_NOTING: list[list[nn.Module]] = []


def calling(model: nn.Module) -> AbstractContextManager[Any]:
    """The context ``model`` runs in: the installed hook's, else none."""
    hook = _HOOK.get()
    return hook(model) if hook is not None else contextlib.nullcontext()


@contextlib.contextmanager
def watching(hook: Hook) -> Iterator[None]:
    """Within the block, models that ``apply`` runs enter ``hook(model)``."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def note(model: nn.Module) -> None:
    """Record that ``model`` runs, for the innermost :func:`noting` block, if any.

    A capture through Dynamo marks this function with ``torch.compiler.assume_constant_result``
    first, so that Dynamo runs it while tracing instead of tracing it.
    """
    if _NOTING and not any(m is model for m in _NOTING[-1]):
        _NOTING[-1].append(model)


@contextlib.contextmanager
def noting() -> Iterator[list[nn.Module]]:
    """Within the block, the models ``apply`` runs are appended to the list it yields."""
    seen: list[nn.Module] = []
    _NOTING.append(seen)
    try:
        yield seen
    finally:
        _NOTING.pop()
