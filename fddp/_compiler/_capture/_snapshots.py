"""Values as a trace reads them: snapshots whose ``==`` means "the same value again"."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import os
import random
import sys
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fddp._compiler._capture import _user_frames

MAX_NODES = 20_000  # values one snapshot may hold; a larger state is not compared
MISSING = object()  # a name a namespace lacks, a cell not yet filled
GONE = ("gone",)  # its snapshot
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_SITE = ("site-packages", "dist-packages")

_SCALARS = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    type(NotImplemented),
    range,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_BY_IDENTITY = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    property,
    staticmethod,
    classmethod,
    enum.Enum,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


class NoEvidence(Exception):
    """The code read or did what cannot be checked again (a C object's state, an import)."""


@functools.cache
def is_library_file(filename: str | None) -> bool:
    """Whether code in ``filename`` is torch's, optree's, fddp's or the standard library's
    (whose own state a trace does not change); third-party packages and the user's code are
    not."""
    if not filename:
        return False
    path = os.path.abspath(filename)
    if path.startswith(_STDLIB):
        return not any(part in path[len(_STDLIB) :] for part in _SITE)
    return path.startswith(_user_frames._LIBRARY_DIRS)


def library_frame(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs library code; generated code (a dataclass's ``__init__``, whose
    file is ``<string>``) counts as its caller's."""
    while frame is not None and frame.f_code.co_filename.startswith("<"):
        frame = frame.f_back
    return frame is None or is_library_file(frame.f_code.co_filename)


def _is_library(obj: Any) -> bool:
    """Whether a class or module is defined by library code (see :func:`is_library_file`)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if name in ("builtins", "__main__") or name is None:
        return name == "builtins"
    module = sys.modules.get(name)
    return is_library_file(getattr(module, "__file__", None)) or name in sys.builtin_module_names


# ---- snapshots: values in a form whose == is "the trace would read the same" ----


class _Same:
    """An object compared by identity inside a snapshot."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@dataclasses.dataclass
class _Snapping:
    """One snapshot's context: module paths for a block-relative snapshot, what was met."""

    paths: Mapping[int, str] | None  # id of each module of the block -> its path in the block
    strict: bool  # unknown objects raise NoEvidence, else compare by identity
    met: Callable[[Any], None] | None = None  # told of each mutable object and function met
    # the ids of a program's constant tensors: a tensor is one of them (by identity) or not
    # (a parameter swapped in, an activation kept); None: every tensor by identity
    constants: frozenset[int] | None = None
    seen: dict[int, int] = dataclasses.field(default_factory=dict)
    nodes: int = 0


def snapshot(
    value: Any,
    paths: Mapping[int, str] | None = None,
    *,
    strict: bool = True,
    met: Callable[[Any], None] | None = None,
    constants: frozenset[int] | None = None,
) -> Any:
    """``value`` as nested tuples: scalars by type and bits, containers and plain objects by
    their contents, modules by identity (or, in ``paths``, by their place in the block and
    type), code, classes and library modules by identity.

    Not ``strict``, an object whose state cannot be read, or more than :data:`MAX_NODES`
    values, counts by identity.

    Raises:
        NoEvidence: (``strict``) an object whose state cannot be read (a generator of C, a
            context variable), or more than :data:`MAX_NODES` values.
    """
    try:
        return _snap(value, _Snapping(paths, strict, met, constants))
    except NoEvidence:
        if strict:
            raise
        return ("too large", type(value), _Same(value))


def _snap(value: Any, s: _Snapping) -> Any:
    if value is MISSING:
        return GONE
    s.nodes += 1
    if s.nodes > MAX_NODES:
        raise NoEvidence(f"reads more than {MAX_NODES} values")
    kind = type(value)
    if isinstance(value, float) and kind is float:
        return (float, value.hex() if value == value else repr(value))  # the sign of zero too
    if isinstance(value, complex) and kind is complex:
        return (kind, value.real.hex(), value.imag.hex())
    if isinstance(value, _SCALARS):
        return (kind, value)
    if isinstance(value, torch.Tensor):
        if s.constants is not None and id(value) not in s.constants:
            return (torch.Tensor,)
        return (torch.Tensor, _Same(value))
    if isinstance(value, weakref.ref):  # a cache's reference (an LSTM's to its weights)
        return (weakref.ref, _snap(MISSING if value() is None else value(), s))
    if isinstance(value, nn.Module):
        path = None if s.paths is None else s.paths.get(id(value))
        return (nn.Module, kind, path) if path is not None else (nn.Module, _Same(value))
    if isinstance(value, (types.FunctionType, *_BY_IDENTITY)):
        if s.met is not None and isinstance(value, types.FunctionType):
            s.met(value)
        return (kind, _Same(value))
    if id(value) in s.seen:
        return ("again", s.seen[id(value)])
    s.seen[id(value)] = len(s.seen)
    if isinstance(value, (tuple, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        return (kind, tuple(_snap(v, s) for v in items), _extra(value, s))
    if s.met is not None:
        s.met(value)
    if isinstance(value, (list, set, collections.deque)):
        return (kind, tuple(_snap(v, s) for v in value), _extra(value, s))
    if isinstance(value, dict):
        factory = getattr(value, "default_factory", None)
        items = tuple((_snap(k, s), _snap(v, s)) for k, v in value.items())
        return (kind, _snap(factory, s), items, _extra(value, s))
    if isinstance(value, types.MethodType):
        return (kind, _snap(value.__func__, s), _snap(value.__self__, s))
    if isinstance(value, functools.partial):
        return (kind, _snap(value.func, s), _snap(value.args, s), _snap(value.keywords, s))
    if isinstance(value, random.Random):
        return (kind, _Same(value), value.getstate())
    if isinstance(value, type):
        if _is_library(value):
            return (type, _Same(value))
        names = [n for n in vars(value) if n not in ("__dict__", "__weakref__", "__doc__")]
        return (type, _Same(value), tuple((n, _snap(vars(value)[n], s)) for n in names))
    if isinstance(value, types.ModuleType):
        if _is_library(value):
            return (types.ModuleType, _Same(value))
        names = [n for n in vars(value) if not (n.startswith("__") and n.endswith("__"))]
        return (types.ModuleType, _Same(value), tuple((n, _shallow(vars(value)[n])) for n in names))
    state = _state(value)
    if state is not None and not _hidden_state(kind):
        return (kind, _Same(value), tuple((n, _snap(v, s)) for n, v in state))
    if s.strict:
        raise NoEvidence(f"reads a {kind.__qualname__}, whose state fddp cannot compare")
    return (kind, _Same(value))


def _extra(value: Any, s: _Snapping) -> Any:
    """The attributes of a container subclass's object, if it has any."""
    state = getattr(value, "__dict__", None)
    return tuple((n, _snap(v, s)) for n, v in state.items()) if state else ()


def _shallow(value: Any) -> Any:
    """A user module's entry: scalars by value, anything else by identity."""
    if type(value) is float:
        return (float, value.hex() if value == value else repr(value))
    return (type(value), value) if isinstance(value, _SCALARS) else _Same(value)


def _state(value: Any) -> list[tuple[str, Any]] | None:
    """An object's attributes (its ``__dict__`` and slots), None when it has neither."""
    found = []
    d = getattr(value, "__dict__", None)
    if isinstance(d, dict):
        found += list(d.items())
    for klass in type(value).__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((name, getattr(value, name)))
    return found if (isinstance(d, dict) or found) else None


_HEAP_TYPE = 1 << 9


def _hidden_state(kind: type) -> bool:
    """Whether objects of ``kind`` may keep state outside their attributes: a class of C
    (other than ``object``) among its bases."""
    return any(not k.__flags__ & _HEAP_TYPE for k in kind.__mro__[:-1])


# ---- reads ----


def immutable_or_code(value: Any) -> bool:
    """Whether the same object is always the same snapshot outside a block (nothing inside it
    can change: a module's own reads are recorded apart)."""
    if isinstance(value, tuple):
        return type(value) in (tuple, torch.Size) and all(map(immutable_or_code, value))
    if isinstance(value, (type, types.ModuleType)):
        return _is_library(value)  # a user's class or module: its attributes too
    kinds = (*_SCALARS, types.FunctionType, *_BY_IDENTITY, torch.Tensor, nn.Module)
    return isinstance(value, kinds) or value is MISSING


def cell_value(cell: types.CellType) -> Any:
    """A closure cell's contents (``MISSING`` while not yet filled)."""
    try:
        return cell.cell_contents
    except ValueError:
        return MISSING
