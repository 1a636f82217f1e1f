"""What a checkpoint leaf may be, and the checks of saved leaves against ``like``, by path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fddp._base._errors import UsageValueError
from fddp._base._tree import path_str
from fddp._sharding import ShardedParams, ShardedState

__all__ = [
    "NotATensor",
    "check_layouts",
    "check_leaves",
    "check_savable",
    "check_structure",
    "flatten",
    "found",
    "is_sharded",
    "layouts",
    "leaf_problems",
    "shorten",
]

SCALARS = (bool, int, float, str)
_MAX_LISTED = 10


def is_sharded(x: Any) -> bool:
    """Whether ``x`` holds one rank's shards (of ``shard_state`` or ``shard_params``)."""
    return isinstance(x, (ShardedState, ShardedParams))


def flatten(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into (readable leaf paths such as ``['opt'].mu['w']``, leaves, spec)."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") or "<root>" for accessor in accessors], leaves, treespec


def found(tree: Any, kind: Callable[[Any], bool]) -> str:
    """The path and type of the first node of ``tree`` that is of ``kind`` (``""``: none)."""
    accessors, nodes, _ = optree.tree_flatten_with_accessor(tree, is_leaf=kind)
    for accessor, node in zip(accessors, nodes):
        if kind(node):
            return f"{accessor.codify('') or '<root>'} ({type(node).__name__})"
    return ""


def check_savable(leaf_path: str, leaf: Any, where: str) -> None:
    """Refuse a leaf that is neither a tensor nor a plain bool, int, float or str.

    Exact types: subclasses (IntEnum, numpy.float64) would not pass ``weights_only`` loading.
    """
    if not (isinstance(leaf, torch.Tensor) or type(leaf) in SCALARS):
        raise TypeError(
            f"{where}: cannot save leaf {leaf_path} of type {type(leaf).__name__}: checkpoint "
            "leaves must be tensors or plain bool/int/float/str values. Convert it "
            "(torch.as_tensor, int(), float(), str()) or keep it out of the saved tree."
        )


def listing(items: list[str], sep: str = ", ") -> str:
    if not items:
        return "none"
    more = len(items) - _MAX_LISTED
    return sep.join(items[:_MAX_LISTED]) + (f"{sep}... and {more} more" if more > 0 else "")


def shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 5] + " ..."


def check_structure(
    path: str, like_paths: list[str], saved_paths: list[str], source: str, advice: str
) -> None:
    """Raise UsageValueError naming the leaves of ``like`` that were not saved, and the
    reverse."""
    saved = set(saved_paths)
    missing = [p for p in like_paths if p not in saved]
    like_set = set(like_paths)
    extra = [p for p in saved_paths if p not in like_set]
    if missing or extra:
        raise UsageValueError(
            f"checkpoint {path} does not have the structure of `like`:\n"
            f"  leaves in `like` but not in the {source}: {listing(missing)}\n"
            f"  leaves in the {source} but not in `like`: {listing(extra)}\n{advice}"
        )


class NotATensor:
    """Stands for a saved leaf known not to be a tensor, whose value has not been read yet."""


def leaf_problems(leaf_path: str, got: Any, want: Any, source: str) -> list[str]:
    """How the saved leaf ``got`` differs from ``like``'s ``want``: kind, shape, dtype, type."""
    name = "non-tensor" if isinstance(got, NotATensor) else type(got).__name__
    if not isinstance(want, torch.Tensor):
        if isinstance(got, NotATensor) or type(got) is type(want):
            return []
        return [f"{leaf_path}: {name} in the {source}, {type(want).__name__} in like"]
    if not isinstance(got, torch.Tensor):
        return [f"{leaf_path}: {name} in the {source}, Tensor in like"]
    problems = []
    if got.shape != want.shape:
        shapes = f"{tuple(got.shape)} in the {source}, {tuple(want.shape)} in like"
        problems.append(f"{leaf_path}: shape {shapes}")
    if got.dtype != want.dtype:
        problems.append(f"{leaf_path}: dtype {got.dtype} in the {source}, {want.dtype} in like")
    return problems


def check_leaves(path: str, problems: list[str], advice: str) -> None:
    if problems:
        raise UsageValueError(
            f"checkpoint {path} does not match `like` ({len(problems)} mismatches):\n  "
            + listing(problems, sep="\n  ")
            + f"\n{advice}"
        )


def layouts(tree: Any) -> dict[str, dict[str, list]]:
    """By the path of each ``ShardedParams`` in ``tree``: the path, shape and dtype of every
    leaf of the full tree it is cut from (its shards alone do not say)."""
    out: dict[str, dict[str, list]] = {}
    paths, leaves, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, ShardedParams)
    )
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, ShardedParams):
            layout = leaf.layout
            out[path_str(path)] = {
                "paths": list(layout.paths),
                "shapes": [list(shape) for shape in layout.shapes],
                "dtypes": [str(dtype) for dtype in layout.dtypes],
            }
    return out


def _well_formed(layout: Any) -> bool:
    """Whether a manifest's record of a full tree is what :func:`layouts` writes."""
    if not isinstance(layout, dict):
        return False
    paths, shapes, dtypes = (layout.get(k) for k in ("paths", "shapes", "dtypes"))
    return (
        isinstance(paths, list)
        and isinstance(shapes, list)
        and isinstance(dtypes, list)
        and len(paths) == len(shapes) == len(dtypes) == len(set(map(str, paths)))
        and all(isinstance(p, str) and isinstance(d, str) for p, d in zip(paths, dtypes))
        and all(isinstance(s, list) and all(type(n) is int for n in s) for s in shapes)
    )


def check_layouts(path: str, saved: Any, like: Any, advice: str, broken: tuple[str, str]) -> None:
    """Compare the full trees of ``like``'s fully sharded parameters with those saved (a
    manifest's ``layouts``; None for a checkpoint that has none), leaf by leaf and by path.
    ``broken``: the file ``saved`` was read from, and what to do if it is malformed."""
    if not isinstance(saved, dict):
        return
    for key, want in layouts(like).items():
        got = saved.get(key)
        if got is None:
            continue  # not saved as fully sharded parameters: DCP's keys say so
        if not _well_formed(got):
            raise ValueError(
                f"checkpoint {path} is corrupted ({broken[0]}: the full tree of {key} is not "
                f"lists of paths, shapes and dtypes of one length){broken[1]}"
            )
        prefix = "" if key == "<root>" else key
        name = {p: prefix + p if p != "<root>" else key for p in want["paths"] + got["paths"]}
        check_structure(
            path,
            [name[p] for p in want["paths"]],
            [name[p] for p in got["paths"]],
            "checkpoint",
            advice,
        )
        problems = []
        theirs = {p: i for i, p in enumerate(got["paths"])}
        for i, p in enumerate(want["paths"]):
            j = theirs[p]
            shape, dtype = got["shapes"][j], got["dtypes"][j]
            if shape != want["shapes"][i]:
                problems.append(
                    f"{name[p]}: shape {tuple(shape)} in the checkpoint, "
                    f"{tuple(want['shapes'][i])} in like"
                )
            if dtype != want["dtypes"][i]:
                problems.append(
                    f"{name[p]}: dtype {dtype} in the checkpoint, {want['dtypes'][i]} in like"
                )
            if i != j:
                problems.append(
                    f"{name[p]}: leaf {j} of the checkpoint's fully sharded tree, leaf {i} of "
                    "like's (its place in the buckets)"
                )
        check_leaves(path, problems, advice)
