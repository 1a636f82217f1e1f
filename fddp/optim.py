"""Optax-style optimizers: pure ``init``/``update`` transformations, chains and schedules.

Every transformation runs on ``torch._foreach_*`` kernels, and under ``torch.func`` transforms
(``vmap``, ``grad``, ``vjp``, ``jvp``, ``fddp.vmap``) on the per-leaf ops those transforms
support, so one optimizer trains an ensemble under ``torch.func.vmap`` (state per member), runs
in simulated replicas that carry their own copy, and can be differentiated through.

Example:
    >>> import torch
    >>> import fddp.optim as optim
    >>> opt = optim.sgd(0.5, momentum=0.9)
    >>> def step(params, state, grads):
    ...     updates, state = opt.update(grads, state, params)
    ...     return optim.apply_updates(params, updates), state
    >>> params = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}  # two members
    >>> state = torch.func.vmap(opt.init)(params)
    >>> params, state = torch.func.vmap(step)(params, state, {"w": torch.ones(2, 2)})
    >>> params["w"]
    tensor([[0.5000, 1.5000],
            [2.5000, 3.5000]])
"""

import warnings
from typing import Any

from fddp._base import _types
from fddp._base._types import GradientTransformation
from fddp._optim._alias import adam, adamw, sgd
from fddp._optim._clipping import clip_by_global_norm, global_norm
from fddp._optim._combine import MaskedState, chain, masked
from fddp._optim._finite import ApplyIfFiniteState, all_finite, apply_if_finite
from fddp._optim._schedule import (
    constant_schedule,
    cosine_decay_schedule,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from fddp._optim._transform import (
    EmptyState,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    identity,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from fddp._optim._update import apply_updates
from fddp._optim._wrappers import InjectHyperparamsState, inject_hyperparams
from fddp._sharding import ShardedState, shard_state, state_bytes

__all__ = [
    "ApplyIfFiniteState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "ShardedState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "linear_schedule",
    "masked",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "shard_state",
    "state_bytes",
    "trace",
    "warmup_cosine_decay_schedule",
]

_RENAMED = {"InitFn": "TransformInitFn", "UpdateFn": "TransformUpdateFn"}


def __getattr__(name: str) -> Any:
    """The optimizer protocol's old short names, kept for a release: they warn."""
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"fddp.optim.{name} is deprecated: use fddp.typing.{new}, the same protocol "
            "(fddp.typing holds the types to annotate with)",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(_types, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
