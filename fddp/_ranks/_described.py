"""A value as labelled lines ranks compare: floats by their bits, functions by what they hold."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from fddp._base._names import qualified_name
from fddp._base._types import GradientTransformation
from fddp._ranks._agree import Line, digest
from fddp._ranks._digests import digests

DESCRIBED_LINES = 256  # lines beyond this many are compared as one digest


def describe(obj: Any, label: str) -> list[Line]:
    """``obj`` (an optimizer, a schedule: functions and what they close over) as lines, one
    per value it holds, labelled by its path from ``label``: a function by its qualified name,
    then each closure cell by its variable name and each default, recursively; containers by
    item, other objects by their attributes; numbers by value (floats with their exact bits),
    tensors by dtype, shape and a digest of their bits.

    >>> import fddp
    >>> describe(fddp.optim.scale(-0.7), "outer")[1]
    ('outer.step_size', '-0.7 (-0x1.6666666666666p-1)')
    """
    lines: list[Line] = []
    _describe(obj, label, lines, set())
    if len(lines) <= DESCRIBED_LINES:
        return lines
    rest = lines[DESCRIBED_LINES - 1 :]
    return [
        *lines[: DESCRIBED_LINES - 1],
        (f"{label} (its last {len(rest)} values)", f"digest {digest(rest)}"),
    ]


def exact(x: Any) -> str:
    """``repr(x)``, with a float's exact bits after it."""
    return f"{x!r} ({x.hex()})" if isinstance(x, float) else repr(x)


def tensor_kind(x: torch.Tensor) -> str:
    """``x``'s dtype and shape, as in ``float32 [8, 8]``."""
    return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"


def digest_hex(digest: torch.Tensor) -> str:
    """A tensor digest (two int64 words, :func:`fddp._ranks._digests.digests`) as hex."""
    return f"{int(digest[0]) & (2**64 - 1):016x}{int(digest[1]) & (2**64 - 1):016x}"


def _describe(obj: Any, label: str, lines: list[Line], seen: set[int]) -> None:
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype)):
        lines.append((label, exact(obj)))
        return
    if isinstance(obj, torch.Tensor):
        lines.append((label, f"tensor {tensor_kind(obj)} digest {digest_hex(digests([obj])[0])}"))
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, GradientTransformation):
        _describe(obj.update, label, lines, seen)
        _describe(obj.init, f"{label}.init", lines, seen)
    elif isinstance(obj, types.FunctionType):
        lines.append((label, qualified_name(obj)))
        cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
        for name, cell in cells:
            with contextlib.suppress(ValueError):  # a cell not yet filled
                _describe(cell.cell_contents, f"{label}.{name}", lines, seen)
        defaults = obj.__defaults__ or ()
        positional = obj.__code__.co_varnames[: obj.__code__.co_argcount]
        for name, default in zip(positional[len(positional) - len(defaults) :], defaults):
            _describe(default, f"{label}.{name}", lines, seen)
        for name, default in (obj.__kwdefaults__ or {}).items():
            _describe(default, f"{label}.{name}", lines, seen)
    elif isinstance(obj, functools.partial):
        _describe(obj.func, label, lines, seen)
        _describe(obj.args, f"{label}.args", lines, seen)
        _describe(obj.keywords, f"{label}.keywords", lines, seen)
    elif isinstance(obj, (list, tuple)):
        lines.append((label, f"{type(obj).__qualname__} of {len(obj)}"))
        for i, item in enumerate(obj):
            _describe(item, f"{label}[{i}]", lines, seen)
    elif isinstance(obj, dict):
        lines.append((label, f"{type(obj).__qualname__} of {len(obj)}"))
        for key in sorted(obj, key=repr):
            _describe(obj[key], f"{label}[{key!r}]", lines, seen)
    elif isinstance(obj, (types.ModuleType, type)) or not hasattr(obj, "__dict__"):
        lines.append((label, f"{qualified_name(type(obj))} {qualified_name(obj, module=False)}"))
    else:
        lines.append((label, qualified_name(type(obj))))
        for name, value in sorted(vars(obj).items()):
            _describe(value, f"{label}.{name}", lines, seen)
