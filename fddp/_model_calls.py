"""How ``fddp.functional``'s ``apply`` runs a model while a capture watches: the compiler
installs a hook for the capture (``_schedule._repeated`` traces repeated blocks once), the
blocks layer's ``apply`` enters it, and neither imports the other."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

Hook = Callable[[nn.Module], AbstractContextManager[Any]]
_HOOK: contextvars.ContextVar[Hook | None] = contextvars.ContextVar("fddp_model_hook", default=None)


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
