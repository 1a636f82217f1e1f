"""Sharded optimizer state (ZeRO stages 1 and 2): each replica keeps and updates 1/N of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import optree
import torch

from fddp._base import _axes, _invariant_marks
from fddp._base._axes import DEFAULT_AXIS
from fddp._base._errors import UsageTypeError
from fddp._base._types import GradientTransformation, OptState, Params, Updates
from fddp._collectives._ops import all_gather, axis_index, axis_size, pmean, psum_scatter
from fddp._sharding import _gathered
from fddp._sharding._group import Members, check_hybrid, check_members, members_of
from fddp._sharding._layout import (
    Bucket,
    _own_chunk,
    bucket_views,
    cap_bytes,
    flat_bucket,
    layout_of,
    own_shard,
    pieces,
)
from fddp._sharding._shard_axes import call_update, takes_shard_axes


class ShardedState(NamedTuple):
    """State of :func:`shard_state`: the wrapped optimizer's state over this replica's shards.

    Attributes:
        inner: the wrapped optimizer's state, whose per-parameter leaves are lists with one
            1-d tensor per bucket: this replica's part of that bucket.
        pieces: one int64 row per bucket, ``(shard_length, offset, length, bucket_size)``:
            this replica's valid elements are ``length`` elements at ``offset`` of a bucket
            of ``bucket_size`` elements (the rest of the shard is padding).
        members: the process group the state was cut over (None: over ``fddp.vmap``'s
            replicas, or not recorded); ``update`` refuses it over another group.
    """

    inner: OptState
    pieces: torch.Tensor
    members: Members | None = None

    def lost_with_its_rank(self) -> str:
        """Why no survivor can rebuild this state when its rank dies (``fddp.recoverable``)."""
        return (
            "the optimizer state is sharded (fddp.optim.shard_state): each rank holds the only "
            "copy of its 1/N of the moments, which dies with the rank. Use a replicated "
            "optimizer (e.g. fddp.optim.adamw) with recoverable, or keep shard_state and "
            "restart from fddp.save_sharded checkpoints (docs/guides/restarts-deep-models.md)."
        )


def shard_state(
    inner: GradientTransformation,
    axis_name: str = DEFAULT_AXIS,
    *,
    bucket_cap_mb: float | None = None,
    comm_dtype: torch.dtype | None = None,
    replicate_axis: str | None = None,
) -> GradientTransformation:
    """Shard ``inner``'s state over the replicas of ``axis_name`` (ZeRO stages 1 and 2).

    ``init(params)`` keeps only this replica's ``1/N`` of the state. ``update(grads, state,
    params)`` takes this replica's own gradients, *not* averaged: each flat bucket of them is
    reduce-scattered (every replica receives the mean of its shard), ``inner`` updates the
    shard, and the updated shards are all-gathered, so the result is the full, replicated
    updates, equal to ``inner.update(pmean(grads), ...)``. In a step, drop the ``pmean`` of the
    gradients and wrap the optimizer: that is the whole change.

    The parameters are grouped into flat buckets of whole leaves (one dtype each, up to the
    byte cap); bucket ``b`` is padded to ``N * c_b`` elements and replica ``r`` owns elements
    ``r * c_b`` to ``(r + 1) * c_b``. Under ``data_parallel`` each bucket's reduce-scatter is
    launched as soon as its last gradient exists and overlaps the rest of the backward pass;
    at most two reduce-scatters or all-gathers are in flight, so after the backward pass only
    the ``1/N`` shards of the gradients remain (stage 2).

    ``inner.update`` is called with ``shard_axes=(..., axis_name)`` when it takes that
    keyword (``chain``, ``clip_by_global_norm`` and ``apply_if_finite`` do, and pass it on), so
    the global norm and the global finiteness are computed over all shards (each sums its
    per-shard part over the replicas) and every replica takes the same decision. ``inner``
    must act elementwise on the updates apart from those (as every fddp optimizer does); a
    transformation of your own that needs a global reduction takes ``shard_axes`` and passes
    it to ``fddp.optim.global_norm`` / ``all_finite``. ``init`` and ``update`` must run where
    ``axis_name`` is bound: inside ``data_parallel`` or ``fddp.vmap``, or (``"data"``) in the
    process group.

    Args:
        inner: the optimizer to shard, e.g. ``fddp.optim.adamw(1e-3)``.
        axis_name: the replica axis the state is sharded over.
        bucket_cap_mb: bytes of parameters per bucket (one reduce-scatter and one all-gather
            each); None: a sixteenth of all, within [1, 25] MiB. The same value must be used to
            load a checkpoint of this state.
        comm_dtype: reduce-scatter the gradients in this dtype (e.g. ``torch.bfloat16``);
            the updates are all-gathered in the parameters' dtype. (``data_parallel``'s own
            ``comm_dtype`` applies to the all-reduces it buckets, not to these.)
        replicate_axis: hybrid sharding (HSDP): an axis over which the state is replicated,
            not sharded. Each gradient shard, reduce-scattered over ``axis_name``, is then
            averaged over this axis too (an all-reduce of ``1/N`` of the gradient bytes), so
            the updates are the mean over both axes; the state is ``1/N`` of the whole on
            each rank, ``N`` the size of ``axis_name``. Inside ``data_parallel``, bind it with
            ``axes`` (docs/guides/from-fsdp2.md, "Hybrid sharding"). Each of its groups holds
            one rank of each ``axis_name`` group; in a step with such an axis, leaving it unset
            is an error.

    The state records the process group it was cut over; ``update`` refuses it where
    ``axis_name`` is bound to another group.

    Returns:
        A ``GradientTransformation`` whose state is a :class:`ShardedState`.

    Example:
        >>> import fddp, torch
        >>> opt = fddp.optim.shard_state(fddp.optim.adam(0.1))
        >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
        >>> fddp.optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 1.9000, 2.9000])
    """
    cap = cap_bytes(bucket_cap_mb, "shard_state")

    def members() -> Members | None:
        """The group ``axis_name`` is bound to, checked as a hybrid mesh (not under Dynamo,
        which would have to trace the lookup; the step's signature holds the group)."""
        if torch.compiler.is_compiling():
            return None
        found = members_of(axis_name)
        if found is not None:
            check_hybrid(axis_name, replicate_axis, found)
        return found

    def init(params: Params) -> ShardedState:
        leaves = optree.tree_leaves(params, none_is_leaf=False)
        n = axis_size(axis_name)
        buckets = layout_of(leaves, n, cap, "shard_state")
        table = pieces(buckets, n, axis_index(axis_name).to(_device(leaves)))
        shards = [own_shard(leaves, b, n, axis_name) for b in buckets]
        return ShardedState(inner.init(shards), table, members())

    takes = takes_shard_axes(inner)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, ShardedState]:
        if not isinstance(state, ShardedState):
            raise UsageTypeError(
                f"shard_state's update got a {type(state).__name__} as its state; pass the "
                "state made by this optimizer's init (a ShardedState)."
            )
        check_members(state.members, members(), axis_name, "shard_state's update")
        leaves, spec = optree.tree_flatten(updates, none_is_leaf=False)
        n = axis_size(axis_name)
        buckets = layout_of(leaves, n, cap, "shard_state")
        if _invariant_marks.passes_through(leaves, axis_name, "shard_state's update"):
            # already the exact mean on every replica (fddp.Invariant): its own shard is the
            # mean a reduce-scatter would round again; cut by the traced index, so that every
            # rank's graph keeps every reduced leaf and issues the same collectives
            grads = [flat_bucket(leaves, b, n) for b in buckets]
            if n > 1:
                index = axis_index(axis_name)
                grads = [_own_chunk(flat, b, index) for flat, b in zip(grads, buckets)]
            if replicate_axis is not None and not _invariant_marks.covers(replicate_axis):
                grads = pmean(grads, replicate_axis)
        else:
            grads = [_reduce_scatter_mean(flat_bucket(leaves, b, n), n) for b in buckets]
            if replicate_axis is not None:
                grads = pmean(grads, replicate_axis)
        param_shards = None
        gathered: list[_gathered.Piece | None] = [None] * len(buckets)
        if params is not None:
            param_leaves = optree.tree_leaves(params, none_is_leaf=False)
            gathered = [_gathered_bucket(param_leaves, b) for b in buckets]
            param_shards = [
                own_shard(param_leaves, b, n, axis_name) if found is None else found.shard
                for b, found in zip(buckets, gathered)
            ]
        axes = (*shard_axes, axis_name)  # the shards of a shard: the norm sums over both
        new, inner_state = call_update(inner, takes, grads, state.inner, param_shards, axes)
        shapes = [x.shape for x in leaves]
        out: list[Any] = [None] * len(leaves)
        for b, shard, found in zip(buckets, cast("list[torch.Tensor]", new), gathered, strict=True):
            views = bucket_views(all_gather(shard, axis_name, tiled=True), b, shapes)
            for i, view in zip(b.leaves, views):
                out[i] = view
            if found is not None:  # fully sharded parameters: the update of their shard
                _gathered.note(views, found.layout, found.bucket, "updates", shard)
        new_state = ShardedState(inner_state, state.pieces, state.members)
        return optree.tree_unflatten(spec, out), new_state

    def _reduce_scatter_mean(flat: torch.Tensor, n: int) -> torch.Tensor:
        # the division runs on the 1/N shard; a wire dtype narrower than the gradients' is
        # divided first, as data_parallel's bucket pass does, to keep the sum in range
        if comm_dtype is not None and comm_dtype != flat.dtype:
            wire = (flat / n).to(comm_dtype)
            return psum_scatter(wire, axis_name, tiled=True).to(flat.dtype)
        return psum_scatter(flat, axis_name, tiled=True) / n

    return GradientTransformation(init, update)


def check_state_group(state: ShardedState, where: str) -> None:
    """Refuse ``state`` where its axis is bound to another group than it was cut over."""
    cut = state.members
    if cut is not None and (_axes.find(cut.axis_name) is not None or cut.axis_name == DEFAULT_AXIS):
        check_members(cut, members_of(cut.axis_name), cut.axis_name, where)


def _gathered_bucket(leaves: list[torch.Tensor], bucket: Bucket) -> _gathered.Piece | None:
    """The fully sharded parameters' bucket that ``bucket`` of ``leaves`` was gathered from,
    if it is one with this very layout (its shard is then the parameters' shard)."""
    found = _gathered.bucket_of([leaves[i] for i in bucket.leaves], "params")
    if found is None:
        return None
    layout_buckets = getattr(found.layout, "buckets", ())
    if found.bucket >= len(layout_buckets) or layout_buckets[found.bucket] != bucket:
        return None
    return found


def _device(leaves: list[torch.Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


def state_bytes(state: OptState) -> int:
    """Bytes held by the tensor leaves of an optimizer state on this replica.

    >>> import fddp, torch
    >>> fddp.optim.state_bytes(fddp.optim.adam(0.1).init({"w": torch.zeros(10)}))
    88
    """
    return sum(
        x.numel() * x.element_size()
        for x in optree.tree_leaves(state, none_is_leaf=False)
        if isinstance(x, torch.Tensor)
    )
