"""Named axes: which replica dimension a collective's ``axis_name`` refers to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

DEFAULT_AXIS = "data"


class Axis(Protocol):
    """What a collective needs from a bound axis; each kind implements the per-leaf math."""

    @property
    def name(self) -> str: ...

    @property
    def traced(self) -> bool:  # collectives go one per leaf into a graph that fddp schedules
        ...

    def size(self) -> int: ...

    def index(self) -> torch.Tensor: ...

    def psum(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def psum_scatter(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def all_gather(self, leaves: list[torch.Tensor], tiled: bool) -> list[torch.Tensor]: ...

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]: ...


_bound: list[Axis] = []


@contextlib.contextmanager
def bind(*axes: Axis) -> Iterator[None]:
    """Make each axis the meaning of its name inside the block (innermost binding wins)."""
    _bound.extend(axes)
    try:
        yield
    finally:
        del _bound[len(_bound) - len(axes) :]


def bound_names() -> list[str]:
    return [a.name for a in reversed(_bound)]


def bound_axes() -> list[Axis]:
    """The axes bound here, innermost first, one per name (the one the name means here)."""
    seen: set[str] = set()
    out = []
    for axis in reversed(_bound):
        if axis.name not in seen:
            seen.add(axis.name)
            out.append(axis)
    return out


def find(name: str) -> Axis | None:
    """The innermost axis bound to ``name``, or None if no transform binds it here."""
    for axis in reversed(_bound):
        if axis.name == name:
            return axis
    return None


def unbound_error(name: str) -> ValueError:
    return ValueError(
        f"axis name {name!r} is not bound here (bound: {[*bound_names(), DEFAULT_AXIS]}). "
        f"Call the collective inside fddp.data_parallel(..., axis_name={name!r}) or "
        f"fddp.vmap(..., axis_name={name!r}), or use the default axis_name='data'."
    )
