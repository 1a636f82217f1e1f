"""A step's reduction context: the axis its gradients reduce over, the values already reduced."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from fddp._base._errors import UsageValueError


@dataclasses.dataclass
class Context:
    """The step that ``data_parallel`` or ``vmap`` runs, over ``axis_name``: in the invariant
    mode ``run`` computes a value_and_grad call per chunk (see ``fddp._func._invariant``),
    else it is None and a value_and_grad call of an ``fddp.Loss`` sums it over the axis (see
    ``fddp._func._grad.normalised``). ``reduced`` holds the tensors either returned, already
    the value over the global batch, the same on every replica of ``axis_name`` and so of each
    of ``sub_axes`` (axes over subgroups of its group): ``pmean`` over any of them passes them
    through unchanged."""

    axis_name: str
    run: Callable[..., Any] | None
    sub_axes: tuple[str, ...] = ()
    reduced: dict[int, weakref.ref] = dataclasses.field(default_factory=dict)

    def covers(self, axis_name: str) -> bool:
        """Whether the mode's results are the same on every replica of ``axis_name``."""
        return axis_name == self.axis_name or axis_name in self.sub_axes

    def mark(self, tree: Any) -> None:
        for x in optree.tree_leaves(tree):
            if isinstance(x, torch.Tensor):
                self.reduced[id(x)] = weakref.ref(x)

    def is_reduced(self, x: torch.Tensor) -> bool:
        ref = self.reduced.get(id(x))
        return ref is not None and ref() is x


_stack: list[Context | None] = []  # None: suspended (inside a differentiated function)


@contextlib.contextmanager
def entered(context: Context | None) -> Iterator[None]:
    """Make ``context`` the active one inside the block (None suspends the mode)."""
    _stack.append(context)
    try:
        yield
    finally:
        _stack.pop()


def active() -> Context | None:
    """The innermost active context, None outside every step or inside a differentiated
    function."""
    return _stack[-1] if _stack else None


def covers(axis_name: str) -> bool:
    """Whether the active step's reduced results are the same on every replica of
    ``axis_name``."""
    context = active()
    return context is not None and context.covers(axis_name)


def passes_through(tree: Any, axis_name: str, where: str = "pmean") -> bool:
    """Whether a mean of ``tree`` over ``axis_name`` (``where``: ``pmean``, or a sharded
    optimizer's reduce-scatter) is the identity: every tensor leaf was reduced by the active
    step (the invariant mode, or an ``fddp.Loss``), whose results are the same on every replica
    of that axis. A tree that mixes reduced and other leaves is an error."""
    context = active()
    if context is None or not context.covers(axis_name):
        return False
    leaves = [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    marked = [context.is_reduced(x) for x in leaves]
    if not any(marked):
        return False
    if not all(marked):
        fix = (
            "Call pmean on them separately: on the former it returns them as they are, the "
            "latter are averaged as usual (and are not world-size invariant)."
            if where == "pmean"
            else "Pass it only the gradients that fddp.value_and_grad returned."
        )
        raise UsageValueError(
            f"{where}: this tree mixes values that fddp.value_and_grad already reduced over the "
            "global batch (in the invariant mode, or of an fddp.Loss: the loss, the gradients "
            f"and, in the invariant mode, the aux) with other tensors. {fix}"
        )
    return True
