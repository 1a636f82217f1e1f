"""Sharded parameters gathered into their full tree, one all-gather per bucket."""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import torch
from torch.fx import traceback as fx_traceback

from fddp._base._annotations import LEAF_PATH, PARAM_GATHER, PARAM_GATHER_KEPT
from fddp._collectives._ops import ProcessAxis, all_gather, gather_rows, named_axis
from fddp._sharding import _gathered
from fddp._sharding._layout import Bucket, bucket_views
from fddp._sharding._params import Layout, ShardedParams


def unpacked(
    sharded: ShardedParams,
    axis_name: str,
    annotate: str | None,
    skeleton: Any = None,
    one_at_a_time: bool = False,
) -> Any:
    """The full tree of ``sharded``, gathered over ``axis_name``.

    Args:
        annotate: in a traced step, the name the gathers are tagged with for the compiler
            (which places and frees them; the gathers then use the layout's ``comm_dtype``
            and the leaves are noted as gathered parameters); None: outside a step, exact.
        skeleton: :func:`skeleton` of the layout, to build the tree under Dynamo.
        one_at_a_time: see :func:`fddp._sharding._step.gathering`.
    """
    layout = sharded.layout
    leaves: list[Any] = [None] * len(layout.shapes)
    for b, (bucket, shard) in enumerate(zip(layout.buckets, sharded.shards, strict=True)):
        tags: dict[str, object] = {}
        if annotate is not None:
            tags = {PARAM_GATHER: f"{annotate}.{b}", LEAF_PATH: _bucket_paths(layout, bucket)}
        if tags and not layout.reshard_after_forward:
            tags[PARAM_GATHER_KEPT] = True
        with fx_traceback.annotate(tags) if tags else contextlib.nullcontext():
            dtype = shard.dtype
            wire_dtype = layout.comm_dtype if annotate is not None else None  # exact outside
            wire = shard if wire_dtype in (None, dtype) else shard.to(wire_dtype)
            full = _gather(wire, axis_name, alone=one_at_a_time)
            full = full if full.dtype == dtype else full.to(dtype)
            views = bucket_views(full, bucket, layout.shapes)
        for i, view in zip(bucket.leaves, views):
            leaves[i] = view
        if annotate is not None:
            _gathered.note(views, layout, b, "params", shard)
    if skeleton is None:
        return optree.tree_unflatten(layout.tree, leaves)
    return optree.tree_map(lambda i: leaves[i], skeleton)


def skeleton(layout: Layout) -> Any:
    """The parameter tree with each leaf's index in its place, made before a trace: Dynamo
    traces a ``tree_map`` over it, but cannot unflatten a tree spec made outside its trace."""
    return optree.tree_unflatten(layout.tree, list(range(len(layout.shapes))))


def _gather(shard: torch.Tensor, axis_name: str, alone: bool) -> torch.Tensor:
    """``all_gather(shard, tiled=True)``; ``alone``: in a step whose schedule runs parameter
    gathers one at a time, through the process group's own all-gather (see gather_rows)."""
    axis = named_axis(axis_name)
    if not (alone and isinstance(axis, ProcessAxis)) or shard.requires_grad:
        return all_gather(shard, axis_name, tiled=True)
    return gather_rows(shard, axis.group_name, axis.group_size, axis.gloo, alone=True)


def _bucket_paths(layout: Layout, bucket: Bucket) -> tuple[str, ...]:
    return tuple(layout.paths[i] for i in bucket.leaves)
