"""What a compiled step depends on: the argument tree, tensor metadata and the static values."""

from __future__ import annotations

import functools
import hashlib
import math
import pickle
import re
import struct
from typing import Any, NamedTuple

import optree
import torch

from fddp._agree import Line
from fddp._tree import path_str

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
_tensor_spec = TensorSpec._make  # without the keyword parsing of TensorSpec(...): every call


class Signature:
    """The cache key of a compiled step: tree structure, then one spec per leaf.

    Equal and hashed by the tree and the specs, static values by their stable keys; the hash is
    computed once (the signature is built on every call).
    """

    __slots__ = ("_hash", "_key", "leaves", "tree")

    def __init__(self, tree: optree.PyTreeSpec, leaves: tuple[LeafSpec, ...]) -> None:
        self.tree, self.leaves = tree, leaves
        self._key = (tree, tuple(x if type(x) is TensorSpec else x[:2] for x in leaves))
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Signature) and self._key == other._key

    def lines(self, paths: list[str]) -> list[Line]:
        """Labelled lines for :func:`fddp._agree.find_difference`."""
        return [
            (f"argument leaf {path}", leaf.portable(i))
            for i, (path, leaf) in enumerate(zip(paths, self.leaves))
        ] + [("the argument tree", str(self.tree))]

    def difference(self, newer: Signature, paths: list[str]) -> tuple[str | None, str]:
        """The first leaf path (None for the tree) that changed from ``self`` to ``newer``, and
        a sentence saying how."""
        if self.tree != newer.tree:
            return None, f"tree structure changed: {self.tree} -> {newer.tree}"
        for path, a, b in zip(paths, self.leaves, newer.leaves):
            if a[:2] != b[:2] or (type(a) is TensorSpec and a != b):
                return path, f"argument leaf {path} changed: {a.describe()} -> {b.describe()}"
        return None, "signature changed"


def _stable(value: Any) -> Any:
    """``value`` in a form whose ``==`` and ``hash`` follow its meaning."""
    if isinstance(value, float) and math.isnan(value):
        return ("nan", struct.pack("<d", value))
    if isinstance(value, functools.partial):
        keywords = tuple(sorted((k, _stable(v)) for k, v in value.keywords.items()))
        return ("partial", value.func, tuple(_stable(a) for a in value.args), keywords)
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_stable(v) for v in value)
    return value


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


def signature_of(args: tuple) -> tuple[Signature, list[Any]]:
    """The signature of ``args`` and their flat leaves."""
    leaves, tree = optree.tree_flatten(args)
    first_seen: dict[int, int] = {}
    paths: list[str] = []
    specs: list[LeafSpec] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            alias = first_seen.setdefault(id(leaf), i)
            specs.append(_tensor_spec((leaf.shape, leaf.stride(), leaf.dtype, leaf.device, alias)))
            continue
        paths = paths or leaf_paths(args)
        specs.append(_static_spec(leaf, paths[i]))
    return Signature(tree, tuple(specs)), leaves


def leaf_paths(args: tuple) -> list[str]:
    """Readable paths of the flat leaves of ``args``, e.g. ``[3]['x']``."""
    return [path_str(p) for p in optree.tree_paths(args)]
