"""A member's share of the global batch, and the step that sums its micro-batches' gradients."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fddp._base._types import GradientTransformation
from fddp._batches import shard
from fddp._collectives._ops import pmean, psum
from fddp._func._accumulate import accumulate_gradients
from fddp._func._grad import value_and_grad
from fddp._optim._update import apply_updates


def micro_rows(batch: Any, micro_batches: int) -> int:
    """The rows of one of the ``micro_batches`` equal micro-batches of the global ``batch``."""
    tensors = [x for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    rows = {x.shape[0] for x in tensors if x.dim()}
    if len(rows) != 1 or any(x.dim() == 0 for x in tensors):
        found = sorted(rows) + (["0-d"] if any(x.dim() == 0 for x in tensors) else [])
        raise ValueError(
            "recoverable: every tensor of the global batch needs the same leading (row) "
            f"dimension to be cut into micro-batches; found {found or 'none'}."
        )
    (total,) = rows
    if total % micro_batches:
        raise ValueError(
            f"recoverable: the global batch has {total} rows, which do not split into "
            f"micro_batches={micro_batches} equal micro-batches; use a global batch that is a "
            "multiple of micro_batches."
        )
    return total // micro_batches


def share(batch: Any, micro_batches: int, n: int) -> tuple[Any, torch.Tensor | None]:
    """This member's consecutive micro-batches of the global ``batch`` (its rank's
    :func:`fddp.shard` of them, the first ranks one more when ``n`` does not divide
    ``micro_batches``), and, when the shares differ, a weight per row: the short members repeat
    their first micro-batch with weight 0, so that every member runs the same program."""
    micro = micro_rows(batch, micro_batches)
    k = -(-micro_batches // n)
    leaves, spec = optree.tree_flatten(batch)
    grouped = [_grouped(x, micro_batches) for x in leaves]
    mine = [shard(x, uneven=True) if isinstance(x, torch.Tensor) else x for x in grouped]
    have = next(x.shape[0] for x in mine if isinstance(x, torch.Tensor))
    local = optree.tree_unflatten(spec, [_padded(x, k) for x in mine])
    if micro_batches % n == 0:
        return local, None
    weights = torch.zeros(k, micro)
    weights[:have] = 1.0
    return local, weights.reshape(-1)


def _grouped(leaf: Any, micro_batches: int) -> Any:
    """A tensor's rows as ``(micro_batches, rows per micro-batch, ...)``."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf.reshape(micro_batches, -1, *leaf.shape[1:])


def _padded(leaf: Any, k: int) -> Any:
    """``k`` micro-batches, the missing ones copies of the first, flattened back into rows."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.shape[0] < k:
        leaf = torch.cat([leaf, leaf[:1].expand(k - leaf.shape[0], *leaf.shape[1:])])
    return leaf.reshape(-1, *leaf.shape[2:])


def member_step(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: GradientTransformation,
    k: int,
    micro_batches: int,
    weighted: bool,
    invariant: bool = False,
) -> Callable[..., Any]:
    """The step a member runs on its ``k`` micro-batches: their mean loss and gradients
    (:func:`fddp.accumulate_gradients`; weighted by row when some are padding), averaged over
    the members into the mean over the global batch, then the optimizer's update. In invariant
    mode ``data_parallel(invariant=)`` takes the exact mean per micro-batch itself."""
    if invariant:
        vg = value_and_grad(loss_fn)
    elif weighted:
        vg = accumulate_gradients(_weighted(loss_fn), k)
    else:
        vg = accumulate_gradients(loss_fn, k)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        if weighted:  # the mean of k weighted micro-batches: sum over members, k / micro_batches
            loss, grads = optree.tree_map(
                lambda t: t * (k / micro_batches), psum(vg(params, batch))
            )
        else:
            loss, grads = pmean(vg(params, batch))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss

    step.__qualname__ = "recoverable_step" if not weighted else "recoverable_weighted_step"
    return functools.wraps(loss_fn, assigned=("__module__",))(step)


def _weighted(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` of a ``(micro_batch, row_weights)`` pair, times the micro-batch's weight."""

    def weighted_loss(params: Any, batch: tuple[Any, torch.Tensor]) -> torch.Tensor:
        micro_batch, weights = batch
        return loss_fn(params, micro_batch) * weights[0]

    return weighted_loss
