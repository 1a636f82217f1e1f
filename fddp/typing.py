"""Types to annotate fddp code with: trees of tensors and the optimizer protocol.

A tree is what optree flattens: tensors (the leaves) nested in dicts, lists, tuples and named
tuples, with ``None`` as an empty subtree. The containers are read-only ``Mapping`` and
``Sequence`` so that a ``dict[str, torch.Tensor]`` is a :data:`TensorTree` (a ``dict`` is
invariant in its values, a ``Mapping`` is not). Custom optree nodes are not covered: annotate
those with your own type.

Example:
    >>> import torch
    >>> import fddp.optim
    >>> from fddp.typing import GradientTransformation, Grads, OptState
    >>> Params = dict[str, torch.Tensor]  # a dict of tensors is a TensorTree
    >>> def apply(
    ...     opt: GradientTransformation, params: Params, state: OptState, grads: Grads
    ... ) -> tuple[Params, OptState]:
    ...     updates, state = opt.update(grads, state, params)
    ...     return fddp.optim.apply_updates(params, updates), state  # keeps the dict type
    >>> opt = fddp.optim.sgd(0.5)
    >>> params = {"w": torch.ones(2)}
    >>> apply(opt, params, opt.init(params), {"w": torch.ones(2)})[0]
    {'w': tensor([0.5000, 0.5000])}
"""

from fddp._base._types import (
    Batch,
    GradientTransformation,
    Grads,
    OptState,
    Params,
    ParamsT,
    ScalarOrSchedule,
    TensorTree,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
)
from fddp._compiler._passes._rematerialize import RegionPlan, RematPlan, SavedValue
from fddp._compiler._plan import CollectivePlan, Plan
from fddp._lowcomm._low_comm import LowCommStep, Phase
from fddp._lowcomm._powersgd import PowerSGD, PowerSGDState
from fddp._step._data_parallel import DataParallelStep

__all__ = [
    "Batch",
    "CollectivePlan",
    "DataParallelStep",
    "GradientTransformation",
    "Grads",
    "LowCommStep",
    "OptState",
    "Params",
    "ParamsT",
    "Phase",
    "Plan",
    "PowerSGD",
    "PowerSGDState",
    "RegionPlan",
    "RematPlan",
    "SavedValue",
    "ScalarOrSchedule",
    "TensorTree",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
]
