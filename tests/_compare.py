"""Comparisons of pytrees for the tests: the structure and every leaf path first, then each leaf.

Every comparison of two trees in the tests goes through :func:`assert_trees_equal` (bitwise) or
:func:`assert_trees_close` (within a tolerance). Both fail when a leaf is missing or extra (the
paths are named), when the containers differ (a tuple for a list, a dict for a named tuple),
and then when any leaf differs in kind, type, shape, dtype or value, naming the first one that
differs and how many others do. Zipping two lists of leaves would pass with a leaf missing.

>>> import torch
>>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
>>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.zeros(1)})
Traceback (most recent call last):
AssertionError: trees differ in their leaves: missing (in expected, not in actual): ['b']
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

MAX_LISTED = 8


def leaf_paths(tree: Any) -> list[str]:
    """Each leaf's path as Python would index it, e.g. ``['opt'][0].mu['w']``."""
    accessors, _, _ = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") or "<root>" for accessor in accessors]


def detached(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are detached clones (a snapshot to compare later)."""
    return optree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees of the same structure and shapes (to
    assert that training moved the parameters, or how far two runs are apart)."""
    a_paths, a_leaves, a_spec = _flatten(a)
    e_paths, e_leaves, e_spec = _flatten(b)
    assert a_paths == e_paths and a_spec == e_spec, f"trees differ: {a_spec} vs {e_spec}"
    diffs = [
        (x.detach().double() - y.detach().double()).abs().max().item()
        for x, y in zip(a_leaves, e_leaves, strict=True)
        if isinstance(x, torch.Tensor) and x.numel()
    ]
    assert diffs, "no tensor leaves to compare"
    return max(diffs)


def assert_trees_equal(actual: Any, expected: Any, what: str = "") -> None:
    """Same structure, leaf paths, leaf types, shapes, dtypes and values, bit for bit.

    A NaN equals a NaN in the same place (the same computation gives the same NaN).
    """
    _compare(actual, expected, what, exact=True, rtol=0.0, atol=0.0, equal_nan=True)


def assert_trees_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = False,
    what: str = "",
) -> None:
    """Same structure, leaf paths, types, shapes and dtypes; values within ``rtol``/``atol``.

    ``rtol``, ``atol`` and ``equal_nan`` are ``torch.testing.assert_close``'s (both tolerances
    or neither; neither: its defaults for the dtype). Integer, bool and string leaves must be
    equal.
    """
    if (rtol is None) != (atol is None):
        raise ValueError("assert_trees_close: pass both rtol and atol, or neither")
    _compare(actual, expected, what, exact=False, rtol=rtol, atol=atol, equal_nan=equal_nan)


def assert_ranks_equal(per_rank: Sequence[Any], what: str = "") -> None:
    """Every rank's tree is bitwise rank 0's (``per_rank[r]``: rank ``r``'s)."""
    assert len(per_rank) >= 1, f"{what}: no ranks"
    for r in range(1, len(per_rank)):
        assert_trees_equal(
            per_rank[r], per_rank[0], what=f"{what}: rank {r} vs rank 0".lstrip(": ")
        )


def _compare(
    actual: Any,
    expected: Any,
    what: str,
    *,
    exact: bool,
    rtol: float | None,
    atol: float | None,
    equal_nan: bool,
) -> None:
    head = f"{what}: " if what else ""
    a_paths, a_leaves, a_spec = _flatten(actual)
    e_paths, e_leaves, e_spec = _flatten(expected)
    if a_paths != e_paths:
        present = set(a_paths)
        wanted = set(e_paths)
        missing = [p for p in e_paths if p not in present]
        extra = [p for p in a_paths if p not in wanted]
        parts = []
        if missing:
            parts.append(f"missing (in expected, not in actual): {_listing(missing)}")
        if extra:
            parts.append(f"extra (in actual, not in expected): {_listing(extra)}")
        if not parts:
            parts.append(f"the same leaves in another order: {_listing(a_paths)}")
        raise AssertionError(f"{head}trees differ in their leaves: " + "; ".join(parts))
    if a_spec != e_spec:
        raise AssertionError(
            f"{head}trees have the same leaf paths but different containers:\n"
            f"  actual:   {a_spec}\n  expected: {e_spec}"
        )
    problems = []
    for path, a, e in zip(a_paths, a_leaves, e_leaves, strict=True):
        problem = _leaf_problem(a, e, exact=exact, rtol=rtol, atol=atol, equal_nan=equal_nan)
        if problem is not None:
            problems.append((path, problem))
    if problems:
        path, problem = problems[0]
        message = f"{head}leaf {path} differs ({len(problems)} of {len(a_paths)} leaves differ)"
        if len(problems) > 1:
            message += f"; the others: {_listing([p for p, _ in problems[1:]])}"
        raise AssertionError(f"{message}\n{problem}")


def _flatten(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    return [a.codify("") or "<root>" for a in accessors], leaves, spec


def _leaf_problem(
    a: Any, e: Any, *, exact: bool, rtol: float | None, atol: float | None, equal_nan: bool
) -> str | None:
    a_tensor, e_tensor = isinstance(a, torch.Tensor), isinstance(e, torch.Tensor)
    if a_tensor != e_tensor:
        return f"a {type(a).__name__} in actual, a {type(e).__name__} in expected"
    if a_tensor:
        if a.shape != e.shape:
            return f"shape {tuple(a.shape)} in actual, {tuple(e.shape)} in expected"
        if a.dtype != e.dtype:
            return f"dtype {a.dtype} in actual, {e.dtype} in expected"
        try:
            torch.testing.assert_close(
                a.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=equal_nan, check_device=True
            )
        except AssertionError as error:
            return str(error)
        return None
    if type(a) is not type(e):
        return f"{type(a).__name__} {a!r} in actual, {type(e).__name__} {e!r} in expected"
    if isinstance(a, float) and math.isnan(a) and math.isnan(e) and equal_nan:
        return None
    if isinstance(a, float) and not exact:
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        except AssertionError as error:
            return str(error)
        return None
    return None if a == e else f"{a!r} in actual, {e!r} in expected"


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_LISTED])
    return shown + (f" (+{len(paths) - MAX_LISTED} more)" if len(paths) > MAX_LISTED else "")


@contextlib.contextmanager
def one_thread():
    """Run as the spawned ranks run, on one intra-op thread: CPU kernels split their sums by the
    number of threads, so bitwise comparisons with the ranks need the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
