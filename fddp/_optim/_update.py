"""Applying updates to parameters."""

from __future__ import annotations

import optree
import torch

from fddp._base._types import ParamsT, Updates
from fddp._optim._kernels import flatten, foreach
from fddp._sharding import _gathered


def apply_updates(params: ParamsT, updates: Updates) -> ParamsT:
    """Returns ``params + updates`` as new tensors, in the parameters' dtypes.

    Example:
        >>> import torch
        >>> from fddp.optim import apply_updates
        >>> apply_updates({"w": torch.tensor(1.0)}, {"w": torch.tensor(-0.25)})
        {'w': tensor(0.7500)}
    """
    leaves, spec = flatten(params)
    update_leaves, update_spec = flatten(updates)
    if update_spec != spec:
        raise ValueError(
            f"apply_updates: params and updates have different tree structures "
            f"({spec} vs {update_spec}); the updates must come from gradients of these params."
        )
    if not leaves:
        return params
    cast_leaves = [u.to(p.dtype) for p, u in zip(leaves, update_leaves, strict=True)]
    results = foreach(torch._foreach_add, leaves, cast_leaves)
    _gathered.follow_update(leaves, update_leaves, results)
    return optree.tree_unflatten(spec, results)
