"""The full parameters and state dict of sharded parameters, gathered outside a step."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base import _axes
from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._collectives._ops import ProcessAxis, named_axis
from fddp._ranks import _mesh, _runtime
from fddp._sharding._gather import unpacked
from fddp._sharding._layout import bucket_views
from fddp._sharding._params import Layout, ShardedParams, bound, check_group, check_replicas


def full_params(
    sharded: ShardedParams,
    axis_name: str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    rank0_only: bool = False,
) -> Any:
    """The full parameter tree of ``sharded``, on every replica (one gather per bucket).

    For evaluation and export. ``rank0_only=True`` (over a process group) gathers the shards to
    the group's rank 0 only, which returns the tree; the other ranks send their shards and
    return None, holding no full bucket at any time (FSDP's ``rank0_only`` state dicts). For
    what ``model.load_state_dict`` takes, buffers included, see :func:`full_state_dict`.

    A collective over the group the parameters were sharded over (their layout records it;
    under hybrid sharding, this rank's shard group): every rank of it calls ``full_params``.
    ``axis_name`` (default: the one they were sharded over) and ``group`` choose another
    binding, which must be a group of the same ranks; inside a transform, ``axis_name`` is
    the axis bound there.

    Raises:
        UsageValueError: if ``group`` (or the bound axis) is not the group they were cut over.
        RankFailureError: if another rank of the group died or did not call it in time.

    >>> import fddp, torch
    >>> fddp.full_params(fddp.shard_params({"w": torch.ones(2)}))
    {'w': tensor([1., 1.])}
    """
    if not isinstance(sharded, ShardedParams):
        raise UsageTypeError(
            f"full_params takes the ShardedParams made by fddp.shard_params, not a "
            f"{type(sharded).__name__}."
        )
    return _gathered(sharded, axis_name, group, rank0_only, "fddp.full_params")


def full_state_dict(
    params: ShardedParams | Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    rank0_only: bool = False,
) -> dict[str, torch.Tensor] | None:
    """What ``model.load_state_dict(..., strict=True)`` takes: the full parameters and the
    buffers in one dict, the inverse of ``params, buffers = fddp.state(model)``.

    ``params`` fully sharded (:func:`fddp.shard_params`) are gathered as :func:`full_params`
    gathers them: a collective that every rank of their group calls. Replicated ``params`` (the
    dict itself) are taken as they are. ``buffers`` are replicated (BatchNorm's running
    statistics, as the step returns them).

    Args:
        params: the parameters, sharded or not, as a flat dict name -> tensor.
        buffers: the buffers, a dict name -> tensor (``{}`` for a model without any).
        group: as for :func:`full_params` (sharded parameters only).
        rank0_only: only rank 0 (of the sharded parameters' group; of the world for a plain
            dict) returns the dict, the others None: with sharded parameters, no other rank
            holds a full bucket at any time.

    Returns:
        The parameters' entries, then the buffers'; None where ``rank0_only`` says so.

    Raises:
        UsageTypeError: if the parameters or buffers are not flat dicts of tensors.
        UsageValueError: if a name is both a parameter and a buffer.

    >>> import fddp, torch
    >>> model = torch.nn.BatchNorm1d(2)
    >>> params, buffers = fddp.state(model)
    >>> full = fddp.full_state_dict(fddp.shard_params(params), buffers)
    >>> model.load_state_dict(full, strict=True)
    <All keys matched successfully>
    """
    flat_buffers = _flat(buffers, "buffers")
    if isinstance(params, ShardedParams):
        full = _gathered(params, None, group, rank0_only, "fddp.full_state_dict")
        if full is None:
            return None
    else:
        if group is not None:
            raise UsageValueError(
                "fddp.full_state_dict: group= is for sharded parameters (the group they are "
                "sharded over); these are a plain dict, held whole on every rank. Leave it unset."
            )
        if rank0_only and _runtime.rank() != 0:
            return None
        full = params
    flat_params = _flat(full, "params")
    both = sorted(set(flat_params) & set(flat_buffers))
    if both:
        raise UsageValueError(
            f"fddp.full_state_dict: {both} are both parameters and buffers; pass the two dicts "
            "of fddp.state(model), which never share a name."
        )
    return {**flat_params, **flat_buffers}


def _flat(tree: Any, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(tree, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()
    ):
        raise UsageTypeError(
            f"fddp.full_state_dict: the {what} must be a flat dict name -> tensor, as "
            f"fddp.state(model) returns; got {_short(tree)}. For another tree, gather it with "
            "fddp.full_params and build the state dict yourself."
        )
    return dict(tree)


def _short(tree: Any) -> str:
    if not isinstance(tree, Mapping):
        return f"a {type(tree).__name__}"
    wrong = next(k for k, v in tree.items() if not isinstance(k, str) or not torch.is_tensor(v))
    return f"a dict whose entry {wrong!r} is a {type(tree[wrong]).__name__}"


def _gathered(
    sharded: ShardedParams,
    axis_name: str | None,
    group: dist.ProcessGroup | None,
    rank0_only: bool,
    where: str,
) -> Any:
    layout = sharded.layout
    name = layout.axis_name if axis_name is None else axis_name
    collective = (
        f"{where} (a collective: every rank of the group the parameters are sharded over "
        "calls it, with rank0_only=True too)"
    )
    with _runtime.peer_failures(collective), _own_group(layout, name, group, where):
        check_replicas(sharded, name, where)
        check_group(layout, name, where)
        if rank0_only:
            return _on_rank0(sharded, name, where)
        return unpacked(sharded, name, annotate=None)


def _own_group(
    layout: Layout, axis_name: str, group: dist.ProcessGroup | None, where: str
) -> contextlib.AbstractContextManager:
    """``axis_name`` bound to ``group``, else as a transform binds it here, else to the group
    ``layout`` was cut over."""
    if group is not None or _axes.find(axis_name) is not None or layout.ranks is None:
        return bound(axis_name, group)
    _runtime.ensure_group()
    own = _mesh.group_over(layout.ranks)
    if own is None:
        raise UsageValueError(
            f"{where}: these parameters were sharded over the group of ranks "
            f"{layout.ranks}, which is not a process group of this rank (destroyed, or made in "
            "another run); pass group=, a group of those ranks."
        )
    return bound(axis_name, own)


def _on_rank0(sharded: ShardedParams, axis_name: str, where: str) -> Any:
    axis = named_axis(axis_name)
    if not isinstance(axis, ProcessAxis):
        raise UsageValueError(
            f"{where}(rank0_only=True) gathers over a process group; axis {axis_name!r} "
            "is not one here (under fddp.vmap, gather on every replica instead)."
        )
    group = dist.distributed_c10d._resolve_process_group(axis.group_name)
    root = axis.group_rank == 0
    layout = sharded.layout
    leaves: list[Any] = [None] * len(layout.shapes)
    for bucket, shard in zip(layout.buckets, sharded.shards, strict=True):
        received = [torch.empty_like(shard) for _ in range(axis.group_size)] if root else None
        dist.gather(shard.contiguous(), received, group=group, group_dst=0)
        if received is not None:
            views = bucket_views(torch.cat(received), bucket, layout.shapes)
            for i, view in zip(bucket.leaves, views):
                leaves[i] = view
    return optree.tree_unflatten(layout.tree, leaves) if root else None
