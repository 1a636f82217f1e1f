"""Skip optimizer updates whose gradients hold NaN or Inf, with the same decision on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import optree
import torch

from fddp._base._types import GradientTransformation, OptState, Params, TensorTree, Updates
from fddp._collectives._ops import psum
from fddp._sharding._shard_axes import call_update, takes_shard_axes


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`; the counts are int64 and the flag bool 0-d tensors.

    Attributes:
        notfinite_count: consecutive non-finite updates up to now (0 after a finite one).
        last_finite: whether the last update was finite.
        total_notfinite: non-finite updates since ``init``.
        inner_state: the wrapped transformation's state, as of its last applied update.
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: OptState


def all_finite(tree: TensorTree, shard_axes: Sequence[str] = ()) -> torch.Tensor:
    """Whether every element of every tensor leaf of ``tree`` is finite, as a 0-d bool tensor.

    Args:
        tree: the tensors.
        shard_axes: named axes over whose replicas ``tree`` is one shard of the whole (see
            ``fddp.optim.global_norm``): the result says whether every shard is finite.

    Example:
        >>> import torch
        >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
        tensor(False)
    """
    leaves = optree.tree_leaves(tree, none_is_leaf=False)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    device = leaves[0].device
    finite = torch.stack([torch.isfinite(x).all().to(device) for x in leaves]).all()
    if not shard_axes:
        return finite
    failures = (~finite).to(torch.int32)
    for name in shard_axes:
        failures = psum(failures, name)
    return failures == 0


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """Wraps ``inner`` so that an update with a NaN or Inf in its input is skipped.

    When any element of the incoming updates is not finite, the output updates are zero (so
    ``apply_updates`` leaves the parameters as they were) and ``inner``'s state is not advanced
    (Adam's step count and moments stay as they were). After more than
    ``max_consecutive_errors`` non-finite updates in a row the update is applied anyway, so a
    run that has truly diverged shows NaNs instead of silently standing still (as
    ``optax.apply_if_finite``).

    The decision is made with ``torch.where`` on a finite flag, never with Python control flow,
    so the step stays one graph under ``fddp.data_parallel`` and ``torch.compile``; ``inner`` is
    evaluated on every update. Every tensor leaf of ``inner``'s state is rolled back on a skip.

    Under ``fddp.data_parallel``, wrap the optimizer that receives the averaged gradients
    (``opt.update(fddp.pmean(grads), ...)``): the all-reduce hands every rank bitwise the same
    gradients, and a NaN or Inf on one rank makes the averaged gradients non-finite on all of
    them, so every rank takes the same decision without communicating, and the replicas never
    diverge. Applied to local gradients before the ``pmean``, ranks would decide differently.

    Args:
        inner: the transformation to protect, e.g. ``fddp.optim.adamw(1e-3)``.
        max_consecutive_errors: how many non-finite updates in a row to skip before applying.

    Example:
        >>> import torch
        >>> from fddp.optim import apply_updates, sgd
        >>> opt = apply_if_finite(sgd(0.5), max_consecutive_errors=3)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, float("nan")])}, state, params)
        >>> apply_updates(params, updates)["w"], state.notfinite_count
        (tensor([1., 2.]), tensor(1))
        >>> updates, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params)
        >>> apply_updates(params, updates)["w"], state.notfinite_count, state.total_notfinite
        (tensor([0.5000, 1.5000]), tensor(0), tensor(1))
    """
    if max_consecutive_errors < 0:
        raise ValueError(
            f"max_consecutive_errors must be non-negative; got {max_consecutive_errors}."
        )

    def init(params: Params) -> ApplyIfFiniteState:
        leaves = optree.tree_leaves(params, none_is_leaf=False)
        device = leaves[0].device if leaves else None
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.ones((), dtype=torch.bool, device=device),
            total_notfinite=zero.clone(),
            inner_state=inner.init(params),
        )

    takes = takes_shard_axes(inner)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, ApplyIfFiniteState]:
        finite = all_finite(updates, shard_axes)
        notfinite_count = torch.where(finite, 0, state.notfinite_count + 1)
        apply = finite | (notfinite_count > max_consecutive_errors)
        new_updates, new_inner = call_update(
            inner, takes, updates, state.inner_state, params, shard_axes
        )
        new_updates = optree.tree_map(
            lambda u: torch.where(apply, u, 0.0), new_updates, none_is_leaf=False
        )
        new_inner = optree.tree_map(
            lambda new, old: torch.where(apply, new, old),
            new_inner,
            state.inner_state,
            none_is_leaf=False,
        )
        return new_updates, ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=state.total_notfinite + (~finite).to(torch.int64),
            inner_state=new_inner,
        )

    return GradientTransformation(init, update)
