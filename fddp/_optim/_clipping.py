"""The global norm of a tree of updates, and clipping the updates to a largest norm."""

from __future__ import annotations

from collections.abc import Sequence

import optree
import torch

from fddp._base._types import GradientTransformation, OptState, Params, TensorTree, Updates
from fddp._collectives._ops import psum
from fddp._optim._kernels import flatten, foreach, with_scalar
from fddp._optim._transform import EmptyState


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales the updates so that their global L2 norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``min(1, max_norm / (norm + 1e-6))``, applied without branching on the norm's value.

    Args:
        max_norm: The largest global norm let through.

    Example:
        >>> import torch
        >>> from fddp.optim import clip_by_global_norm
        >>> opt = clip_by_global_norm(1.0)
        >>> opt.update([torch.tensor([3.0, 4.0])], opt.init(None))[0]
        [tensor([0.6000, 0.8000])]
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive; got {max_norm}.")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        if not leaves:
            return updates, state
        norm = global_norm(leaves, shard_axes)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return optree.tree_unflatten(spec, with_scalar(torch._foreach_mul, leaves, factor)), state

    return GradientTransformation(init, update)


def global_norm(tree: TensorTree, shard_axes: Sequence[str] = ()) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` taken together.

    Args:
        tree: the tensors.
        shard_axes: named axes over whose replicas ``tree`` is one shard of the whole, as the
            updates are that an optimizer sees inside ``fddp.optim.shard_state`` (which passes
            them to its inner transformation's ``update`` as ``shard_axes=``): the squares are
            summed over those replicas, so every replica gets the norm of the whole.

    Example:
        >>> import torch
        >>> from fddp.optim import global_norm
        >>> global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]})
        tensor(5.)
    """
    leaves = flatten(tree)[0]
    if not leaves:
        return torch.zeros(())
    norms = foreach(torch._foreach_norm, leaves)
    device = norms[0].device
    norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    if not shard_axes:
        return norm
    square = norm * norm
    for name in shard_axes:
        square = psum(square, name)
    return torch.sqrt(square)
