"""The domain types fddp's modules are annotated with (re-exported by ``fddp.typing``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

import torch

TensorTree: TypeAlias = torch.Tensor | Mapping[Any, "TensorTree"] | Sequence["TensorTree"] | None
"""A pytree whose leaves are tensors: tensors in (nested) mappings and sequences, or ``None``."""

Params: TypeAlias = TensorTree
"""Model parameters, e.g. ``fddp.state(model)[0]`` (a dict name -> tensor)."""

Grads: TypeAlias = TensorTree
"""Gradients: a tree with the structure of the parameters."""

Updates: TypeAlias = TensorTree
"""What a gradient transformation maps gradients to; added to the parameters at the end."""

OptState: TypeAlias = Any
"""Optimizer state: whatever ``init`` returned, opaque to the caller and fed back each step.

Each transformation keeps its own named tuple of tensors (``TraceState``, ``ScaleByAdamState``,
...), and ``update`` reads its fields; a tree union here would make every ``update`` cast its own
state back, so the state is typed by the transformation, not by this alias.
"""

Batch: TypeAlias = Any
"""A step's data argument: any pytree, its leaves tensors or Python values."""

ParamsT = TypeVar("ParamsT", bound=TensorTree)
"""A parameter tree's own type, kept by functions that return a tree of the same structure."""

ScalarOrSchedule: TypeAlias = float | torch.Tensor | Callable[[torch.Tensor], Any]
"""A constant, or a function of the step count (an int64 tensor) returning the value."""


class TransformInitFn(Protocol):
    """Builds the initial optimizer state from the parameters."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """Maps ``(updates, state, params)`` to ``(new_updates, new_state)`` without mutating inputs."""

    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init(params)`` and ``update(updates, state, params=None)``.

    Example:
        >>> import torch
        >>> from fddp.optim import sgd, apply_updates
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> opt = sgd(0.5)
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
        >>> apply_updates(params, updates)["w"]
        tensor([0.5000, 1.5000])
    """

    init: TransformInitFn
    update: TransformUpdateFn
