"""Passing shard axes on to a gradient transformation: whether its update takes them, the call."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from fddp._base._types import GradientTransformation, OptState, Params, Updates


def takes_shard_axes(transform: GradientTransformation) -> bool:
    """Whether ``transform.update`` accepts the ``shard_axes`` keyword (see
    ``fddp.optim.global_norm``); read once, when a wrapping transformation is built, never while a
    step is traced."""
    parameters = inspect.signature(transform.update).parameters.values()
    return any(p.name == "shard_axes" or p.kind is p.VAR_KEYWORD for p in parameters)


def call_update(
    transform: GradientTransformation,
    takes: bool,
    updates: Updates,
    state: OptState,
    params: Params | None,
    shard_axes: Sequence[str],
) -> tuple[Updates, OptState]:
    """``transform.update``, passing ``shard_axes`` on when it ``takes`` them."""
    if takes:
        return transform.update(updates, state, params, shard_axes=shard_axes)  # type: ignore[call-arg]
    return transform.update(updates, state, params)
