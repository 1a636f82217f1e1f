"""What a compiled step depends on: the argument tree, tensor metadata and the static values."""

from __future__ import annotations

import functools
import hashlib
import math
import pickle
import re
import struct
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import nn

from fddp._base._tree import path_str
from fddp._ranks._agree import Line

_PLAIN = (bool, int, float, str, type(None))
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


class TensorSpec(NamedTuple):
    """A tensor leaf as the graph sees it; ``alias`` is the index of its first occurrence."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    alias: int

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)} on {self.device}"

    def portable(self, index: int) -> str:
        """Comparable across ranks: rank r computes on ``cuda:r``, so devices enter by type."""
        where = f"on {self.device.type} (strides {list(self.stride)})"
        text = f"{self.dtype} {list(self.shape)} {where}"
        return text + (f", the same tensor as leaf {self.alias}" if self.alias != index else "")


class StaticSpec(NamedTuple):
    """A non-tensor leaf, compiled into the program as a constant.

    ``key`` is the value made stable under ``==`` (NaN equals NaN, a fresh ``functools.partial``
    of the same function and arguments equals the last one), so equal values hit the cache;
    ``value`` is the value itself, for messages (the signature compares keys only).
    """

    kind: type
    key: Any
    value: Any

    def describe(self) -> str:
        return repr(self.value)

    def portable(self, index: int) -> str:
        return f"{self.kind.__qualname__} {_portable_value(self.value)}"


LeafSpec = TensorSpec | StaticSpec

MODES_LABEL = "the models' train/eval modes"


class Modes:
    """The ``training`` flags of every module of the models a step runs, read at each call
    from a list made once (a 96-layer model has about a thousand modules)."""

    __slots__ = ("_modules", "_names", "models")

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.models = tuple(models)
        seen: set[int] = set()
        self._modules: list[nn.Module] = []
        self._names: list[str] = []
        for model in self.models:
            root = type(model).__name__
            for name, module in model.named_modules():
                if id(module) not in seen:
                    seen.add(id(module))
                    self._modules.append(module)
                    self._names.append(f"{root}.{name}" if name else root)

    def read(self) -> bytes:
        """One byte per module: 1 in training mode, 0 in eval mode."""
        return bytes([m.training for m in self._modules])

    def describe(self, flags: bytes) -> str:
        """``flags`` as text: ``train``, ``eval``, or the modules that are not in the majority's."""
        if not flags:
            return "no model"
        train = flags.count(1) * 2 >= len(flags)
        others = [name for name, flag in zip(self._names, flags) if flag != train]
        mode = "train" if train else "eval"
        return mode + (f" except {', '.join(others)}" if others else "")

    def change(self, old: bytes, new: bytes) -> str:
        """A sentence naming the first module whose mode differs from ``old`` to ``new``."""
        for name, a, b in zip(self._names, old, new):
            if a != b:
                word = ("eval", "train")
                return (
                    f"the mode of {name} changed: {word[a]} -> {word[b]} (model.train()/eval() "
                    "change what fddp.functional computes)"
                )
        return (
            f"the train/eval modes of the models the step runs changed (now {self.describe(new)})"
        )


class Signature:
    """The cache key of a compiled step: the tree structure, then the tensor leaves' shapes,
    strides, dtypes and devices (each a column, one tuple over all tensor leaves), which tensor
    leaves are the same tensor, and the non-tensor leaves' stable keys.

    Built on every call, so it is built and compared column by column, without an object per
    leaf; the hash is computed once. :attr:`leaves` (one spec per leaf, for messages) is made
    from the columns when asked for.
    """

    __slots__ = ("_columns", "_hash", "_key", "_leaves", "flags", "modes", "tree")

    def __init__(
        self,
        tree: optree.PyTreeSpec,
        columns: tuple[tuple, tuple, tuple, tuple, tuple[int, ...] | None],
        statics: tuple[tuple[int, StaticSpec], ...],
        modes: Modes | None = None,
        flags: bytes = b"",
    ) -> None:
        self.tree, self._columns = tree, (columns, statics)
        self.modes, self.flags = modes, flags
        self._key = (tree, columns, tuple((i, x[:2]) for i, x in statics), flags)
        self._hash = hash(self._key)
        self._leaves: tuple[LeafSpec, ...] | None = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and self._key == other._key

    @property
    def leaves(self) -> tuple[LeafSpec, ...]:
        """One spec per leaf, in the tree's order; ``alias`` counts all leaves."""
        if self._leaves is None:
            (shapes, strides, dtypes, devices, aliases), statics = self._columns
            specs: list[LeafSpec | None] = [None] * (len(shapes) + len(statics))
            for i, static in statics:
                specs[i] = static
            where = [i for i, spec in enumerate(specs) if spec is None]
            for k, i in enumerate(where):
                alias = where[aliases[k]] if aliases is not None else i
                specs[i] = TensorSpec(shapes[k], strides[k], dtypes[k], devices[k], alias)
            self._leaves = tuple(spec for spec in specs if spec is not None)
        return self._leaves

    def lines(self, paths: list[str]) -> list[Line]:
        """Labelled lines for :func:`fddp._ranks._agree.find_difference`."""
        lines = [
            (f"argument leaf {path}", leaf.portable(i))
            for i, (path, leaf) in enumerate(zip(paths, self.leaves))
        ] + [("the argument tree", str(self.tree))]
        if self.modes is not None:
            lines.append((MODES_LABEL, self.modes.describe(self.flags)))
        return lines

    def difference(self, newer: Signature, paths: list[str]) -> tuple[str | None, str]:
        """The first leaf path (None for the tree) that changed from ``self`` to ``newer``, and
        a sentence saying how."""
        if self.tree != newer.tree:
            return None, f"tree structure changed: {self.tree} -> {newer.tree}"
        for path, a, b in zip(paths, self.leaves, newer.leaves):
            if a[:2] != b[:2] or (type(a) is TensorSpec and a != b):
                field = _changed_attribute(a[1], b[1]) if type(a) is StaticSpec else None
                if field is not None:
                    return path, f"argument leaf {path} changed: {field}"
                return path, f"argument leaf {path} changed: {a.describe()} -> {b.describe()}"
        if self.flags != newer.flags and newer.modes is not None:
            return None, newer.modes.change(self.flags, newer.flags)
        return None, "signature changed"


_OBJECT_KEY_LIMIT = 1_000  # values an object's key may hold; a larger one is keyed by identity


def _stable(value: Any, budget: list[int] | None = None) -> Any:
    """``value`` in a form whose ``==`` and ``hash`` follow its meaning: a plain object (one
    compared by identity, with attributes) by its class and attributes, as a trace reads it."""
    if isinstance(value, float) and math.isnan(value):
        return ("nan", struct.pack("<d", value))
    if isinstance(value, functools.partial):
        keywords = tuple(sorted((k, _stable(v)) for k, v in value.keywords.items()))
        return ("partial", value.func, tuple(_stable(a) for a in value.args), keywords)
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_stable(v, budget) for v in value)
    if _plain_object(value):
        budget = [_OBJECT_KEY_LIMIT] if budget is None else budget
        budget[0] -= len(vars(value))
        if budget[0] < 0:
            return value
        return (_PlainObject, type(value), _attributes(value, budget))
    if budget is not None and type(value) in (list, dict, set):  # inside a plain object
        budget[0] -= len(value)
        if budget[0] < 0:
            return value
        items = value.items() if isinstance(value, dict) else enumerate(value)
        key = tuple((k, _stable(v, budget)) for k, v in items)
        return (type(value), frozenset(key) if isinstance(value, set) else key)
    return value


class _PlainObject:
    """Marks the key of a plain object: its class and its attributes."""


def _plain_object(value: Any) -> bool:
    """An object of a user class that compares by identity and keeps its state in attributes
    (a settings object): equal attributes, equal trace."""
    kind = type(value)
    return (
        getattr(kind, "__eq__", None) is object.__eq__
        and getattr(kind, "__hash__", None) is object.__hash__
        and isinstance(getattr(value, "__dict__", None), dict)
        and not isinstance(value, (type, types.ModuleType, types.FunctionType, nn.Module))
        and kind.__module__ != "builtins"
    )


def _attributes(value: Any, budget: list[int]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, _stable(v, budget)) for k, v in sorted(vars(value).items()))


def _changed_attribute(a: Any, b: Any) -> str | None:
    """The first attribute whose key differs between two plain objects' keys, as text."""
    if not (isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == (_PlainObject,)):
        return None
    before, after = dict(a[2]), dict(b[2])
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name, _GONE), after.get(name, _GONE)
        if old != new:
            return f".{name} {_key_text(old)} -> {_key_text(new)}"
    return None


_GONE = "(none)"


def _key_text(key: Any) -> str:
    return "(an object)" if isinstance(key, tuple) and key[:1] == (_PlainObject,) else repr(key)


def _portable_value(value: Any) -> str:
    """The value as text that is equal on two ranks exactly when the values are.

    ``repr`` when it holds no memory address (plain values, enums, dataclasses); otherwise a
    digest of its pickle (a function or class pickles by name); otherwise only its type.
    """
    if isinstance(value, functools.partial):
        args = ", ".join(_portable_value(a) for a in value.args)
        keywords = ", ".join(f"{k}={_portable_value(v)}" for k, v in sorted(value.keywords.items()))
        return f"partial({_portable_value(value.func)}, {args}; {keywords})"
    text = repr(value)
    if isinstance(value, _PLAIN) or not _ADDRESS.search(text):
        return text
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:
        return f"<{type(value).__qualname__} object>"
    return (
        f"<{type(value).__qualname__} pickled {hashlib.blake2b(data, digest_size=8).hexdigest()}>"
    )


def _static_spec(leaf: Any, path: str) -> StaticSpec:
    key = _stable(leaf)
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f"data_parallel: argument leaf {path} is a {type(leaf).__name__}, neither a tensor "
            "nor hashable; non-tensor arguments are compiled in as constants, so they must be "
            "hashable (ints, floats, strings, tuples, frozen dataclasses). Pass it as a tensor, "
            "or register its type as a pytree node with optree."
        ) from None
    return StaticSpec(type(leaf), key, leaf)


def signature_of(args: tuple, modes: Modes | None = None) -> tuple[Signature, list[Any]]:
    """The signature of ``args`` (and of the train/eval ``modes`` of the step's models) and
    their flat leaves."""
    leaves, tree = optree.tree_flatten(args)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    statics: tuple[tuple[int, StaticSpec], ...] = ()
    if len(tensors) < len(leaves):
        paths = leaf_paths(args)
        statics = tuple(
            (i, _static_spec(x, paths[i]))
            for i, x in enumerate(leaves)
            if not isinstance(x, torch.Tensor)
        )
    ids = [id(x) for x in tensors]
    aliases = None  # each tensor leaf its own tensor, else the index of its first occurrence
    if len(set(ids)) < len(ids):
        first: dict[int, int] = {}
        aliases = tuple(first.setdefault(n, k) for k, n in enumerate(ids))
    columns = (
        tuple([x.shape for x in tensors]),
        tuple([x.stride() for x in tensors]),
        tuple([x.dtype for x in tensors]),
        tuple([x.device for x in tensors]),
        aliases,
    )
    flags = b"" if modes is None else modes.read()
    return Signature(tree, columns, statics, modes, flags), leaves


def leaf_paths(args: tuple) -> list[str]:
    """Readable paths of the flat leaves of ``args``, e.g. ``[3]['x']``."""
    return [path_str(p) for p in optree.tree_paths(args)]
