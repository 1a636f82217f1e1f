"""The qualified name of a function or object, as fddp names the user's code in its messages."""

from __future__ import annotations

import functools
from typing import Any


def qualified_name(obj: Any, *, module: bool = True) -> str:
    """``obj``'s ``module.qualname``: the function a ``functools.partial`` binds (unless
    ``functools.update_wrapper`` named the partial), an object without a name by its class
    (``module=False``: the qualname alone).

    >>> import functools, math
    >>> qualified_name(functools.partial(math.gcd, 4))
    'math.gcd'
    >>> qualified_name(qualified_name, module=False)
    'qualified_name'
    """
    while isinstance(obj, functools.partial) and not hasattr(obj, "__qualname__"):
        obj = obj.func
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    name = name or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or ''}.{name}" if module else name
