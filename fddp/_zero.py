"""Sharded optimizer state (ZeRO stages 1 and 2): each replica keeps and updates 1/N of it.

The parameters are grouped into flat buckets of whole leaves (one dtype each, up to a byte
cap). Bucket ``b`` of ``s_b`` elements is padded to ``N * c_b`` with ``c_b = ceil(s_b / N)``
and replica ``r`` owns elements ``r*c_b`` to ``(r+1)*c_b`` of it: ``torch.chunk``'s split, so
the shard is a ``Shard(0)`` DTensor piece of the bucket (see ``_checkpoint_sharded``). The
wrapped optimizer runs on the list of this replica's bucket shards, one tensor per bucket.

Each bucket's gradients go through one reduce-scatter. Under ``data_parallel`` it is launched
as soon as that bucket's last gradient exists (each weight's matmul writes its gradient straight
into the bucket), so it overlaps the rest of the backward pass; the update of bucket ``b`` runs
while later buckets are still on the wire, and its all-gather starts right after it. Memory
(stage 2): the scheduler keeps at most two reduce-scatters or all-gathers in flight
(``_overlap.bound_sharding_collectives``): before the next launch, the oldest is waited for and
its result summed to this replica's shard (or added to the parameters), so a whole bucket of
gradients lives from its first gradient until its reduce-scatter completes, two launches later
at most, and after the backward pass only the ``1/N`` shards do. A step under ``trace=False``
waits for each collective at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import optree
import torch
import torch.nn.functional as F

from fddp import _axes, _bucket_policy, _gathered, _mesh
from fddp._axes import DEFAULT_AXIS
from fddp._collectives import (
    ProcessAxis,
    all_gather,
    axis_index,
    axis_size,
    named_axis,
    pmean,
    psum_scatter,
)
from fddp._errors import UsageValueError
from fddp._optim import call_update, takes_shard_axes
from fddp._types import GradientTransformation, OptState, Params, Updates


@dataclasses.dataclass(frozen=True)
class Members:
    """The process group a sharded layout was cut over: its ranks in the group's order, in
    global numbering. A pytree node without leaves: it travels in the tree's structure."""

    ranks: tuple[int, ...]
    axis_name: str  # the axis that was bound to the group

    def __repr__(self) -> str:
        # A step's argument tree is compared across its ranks, and under hybrid sharding each
        # pair cuts its layout over its own pair: only the group's size is the same everywhere.
        return f"Members({len(self.ranks)} ranks of axis {self.axis_name!r})"


optree.register_pytree_node(
    Members,
    lambda m: ((), m),  # itself as the node's metadata, shown by its repr
    lambda m, _: m,
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # the namespace fddp flattens in
)


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


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves (indices in flattening order) of one dtype reduced together."""

    leaves: tuple[int, ...]
    size: int
    chunk: int  # elements per replica: ceil(size / replicas)


@functools.lru_cache(maxsize=64)
def _buckets(
    shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...], replicas: int, cap_bytes: int | None
) -> tuple[Bucket, ...]:
    """Whole leaves in flattening order, one dtype per bucket, each up to the cap."""
    if cap_bytes is None:  # the layout is the state's: noise in a measurement must not move it
        total = sum(math.prod(s) * d.itemsize for s, d in shapes)
        cap_bytes = _bucket_policy.rule_of_thumb(total, _bucket_policy.FIRST_CAP_BYTES)
    open_buckets: dict[torch.dtype, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, (shape, dtype) in enumerate(shapes):
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype in open_buckets:
            members, used = open_buckets[dtype]
            if used < cap_bytes:
                open_buckets[dtype] = ([*members, i], used + nbytes)
                continue
            done.append(members)
        open_buckets[dtype] = ([i], nbytes)
    done.extend(members for members, _ in open_buckets.values())
    done.sort(key=lambda members: members[0])
    out = []
    for members in done:
        size = sum(math.prod(shapes[i][0]) for i in members)
        out.append(Bucket(tuple(members), size, -(-size // replicas)))
    return tuple(out)


def _layout(leaves: list[torch.Tensor], replicas: int, cap_bytes: int | None) -> tuple[Bucket, ...]:
    for x in leaves:
        if not x.is_floating_point():
            raise TypeError(
                f"shard_state: a parameter has dtype {x.dtype}; sharded optimizer state needs "
                "floating-point parameters. Keep integer values out of the parameter tree."
            )
    return _buckets(tuple((tuple(x.shape), x.dtype) for x in leaves), replicas, cap_bytes)


def _flat_bucket(leaves: list[torch.Tensor], bucket: Bucket, replicas: int) -> torch.Tensor:
    """The bucket's leaves as one vector, zero-padded to ``replicas * chunk`` elements."""
    parts = [leaves[i].reshape(-1) for i in bucket.leaves]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    pad = replicas * bucket.chunk - bucket.size
    return F.pad(flat, (0, pad)) if pad else flat


def _own_chunk(flat: torch.Tensor, bucket: Bucket, index: torch.Tensor) -> torch.Tensor:
    """This replica's chunk of a padded bucket (``index`` may be batched by ``fddp.vmap``)."""
    return flat.view(-1, bucket.chunk).index_select(0, index.reshape(1)).reshape(-1)


def _own_slice(leaves: list[torch.Tensor], bucket: Bucket, rank: int) -> torch.Tensor:
    """Chunk ``rank`` of a padded bucket, built from views of only the leaves it overlaps."""
    start, stop = rank * bucket.chunk, (rank + 1) * bucket.chunk
    parts, offset = [], 0
    for i in bucket.leaves:
        flat = leaves[i].reshape(-1)
        lo, hi = offset, offset + flat.numel()
        offset = hi
        if max(lo, start) < min(hi, stop):
            parts.append(flat[max(lo, start) - lo : min(hi, stop) - lo])
    if not parts:
        return leaves[bucket.leaves[0]].new_zeros(bucket.chunk)
    own = torch.cat(parts) if len(parts) > 1 else parts[0]
    return F.pad(own, (0, bucket.chunk - own.numel())) if own.numel() < bucket.chunk else own


def own_shard(
    leaves: list[torch.Tensor], bucket: Bucket, replicas: int, axis_name: str
) -> torch.Tensor:
    """This replica's chunk of ``bucket`` of ``leaves`` on ``axis_name``."""
    axis = named_axis(axis_name)
    # The rank is a constant: copy only this shard. Not under Dynamo, where a fully sharded
    # step takes this general path (see _gathered): slicing by rank would give every rank a
    # different graph, and the compiler could then schedule the parameter gathers differently.
    if isinstance(axis, ProcessAxis) and not torch.compiler.is_compiling():
        return _own_slice(leaves, bucket, axis.group_rank)
    return _own_chunk(_flat_bucket(leaves, bucket, replicas), bucket, axis_index(axis_name))


def members_of(axis_name: str) -> Members | None:
    """The process group ``axis_name`` is bound to here (None: not a process group)."""
    axis = named_axis(axis_name)
    if not isinstance(axis, ProcessAxis):
        return None
    return Members(_mesh.ranks_of(axis.group_name), axis_name)


def _check_hybrid(axis_name: str, replicate_axis: str | None, shard: Members) -> None:
    """Refuse a ``replicate_axis`` that is not orthogonal to ``axis_name`` and, without one, a
    step that has such an axis (hybrid sharding that would not average across the groups)."""
    own = set(shard.ranks)
    if replicate_axis is not None:  # checked where it is bound (update needs it there)
        replicate = members_of(replicate_axis) if _axes.find(replicate_axis) else None
        if replicate is not None and len(own & set(replicate.ranks)) != 1:
            raise UsageValueError(
                f"shard_state(axis_name={axis_name!r}, replicate_axis={replicate_axis!r}): the "
                f"groups meet in ranks {sorted(own & set(replicate.ranks))} (shard group "
                f"{shard.ranks}, replicate group {replicate.ranks}); a replicate group holds one "
                f"rank of each {axis_name!r} group (with pairs {{0, 1}} and {{2, 3}}: "
                "{0, 2} and {1, 3}), neither the whole world nor the shard group itself. Pass "
                "those groups in data_parallel(..., axes=...)."
            )
        return
    for axis in _axes.bound_axes():
        if axis.name == axis_name or not isinstance(axis, ProcessAxis) or axis.size() < 2:
            continue
        other = set(_mesh.ranks_of(axis.group_name))
        if len(own & other) == 1:
            raise UsageValueError(
                f"shard_state(axis_name={axis_name!r}) in a step whose axis {axis.name!r} "
                f"(ranks {tuple(sorted(other))}) crosses the shard groups (this one: "
                f"{shard.ranks}): each {axis_name!r} group would train alone and the groups "
                f"drift apart. For hybrid sharding pass replicate_axis={axis.name!r} to "
                "shard_state, which averages each gradient shard across the groups."
            )


def bucket_piece(bucket: Bucket, rank: int) -> tuple[int, int, int, int]:
    """``(shard_length, offset, length, bucket_size)``: replica ``rank``'s valid elements of
    ``bucket`` are ``length`` elements at ``offset`` (the rest of its shard is padding)."""
    offset = rank * bucket.chunk
    return bucket.chunk, offset, max(0, min(bucket.chunk, bucket.size - offset)), bucket.size


def _pieces(buckets: tuple[Bucket, ...], replicas: int, index: torch.Tensor) -> torch.Tensor:
    rows = [[list(bucket_piece(b, r)) for b in buckets] for r in range(replicas)]
    table = torch.tensor(rows, dtype=torch.int64, device=index.device)
    return table.index_select(0, index.reshape(1)).squeeze(0)


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
            ``axes`` (README, "Hybrid sharding"). Each of its groups holds one rank of each
            ``axis_name`` group; in a step with such an axis, leaving it unset is an error.

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
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"shard_state: bucket_cap_mb must be positive; got {bucket_cap_mb}.")
    cap_bytes = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20))

    def members() -> Members | None:
        """The group ``axis_name`` is bound to, checked as a hybrid mesh (not under Dynamo,
        which would have to trace the lookup; the step's signature holds the group)."""
        if torch.compiler.is_compiling():
            return None
        found = members_of(axis_name)
        if found is not None:
            _check_hybrid(axis_name, replicate_axis, found)
        return found

    def init(params: Params) -> ShardedState:
        leaves = optree.tree_leaves(params, none_is_leaf=False)
        n = axis_size(axis_name)
        buckets = _layout(leaves, n, cap_bytes)
        pieces = _pieces(buckets, n, axis_index(axis_name).to(_device(leaves)))
        return ShardedState(
            inner.init([own_shard(leaves, b, n, axis_name) for b in buckets]), pieces, members()
        )

    takes = takes_shard_axes(inner)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, ShardedState]:
        if not isinstance(state, ShardedState):
            raise TypeError(
                f"shard_state's update got a {type(state).__name__} as its state; pass the "
                "state made by this optimizer's init (a ShardedState)."
            )
        _check_members(state.members, members(), axis_name)
        leaves, spec = optree.tree_flatten(updates, none_is_leaf=False)
        n = axis_size(axis_name)
        buckets = _layout(leaves, n, cap_bytes)
        grads = [_reduce_scatter_mean(_flat_bucket(leaves, b, n), n) for b in buckets]
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
        out: list[Any] = [None] * len(leaves)
        for b, shard, found in zip(buckets, cast("list[torch.Tensor]", new), gathered, strict=True):
            full = all_gather(shard, axis_name, tiled=True)
            sizes = [leaves[i].numel() for i in b.leaves]
            parts = full[: b.size].split(sizes) if len(sizes) > 1 else [full[: b.size]]
            views = [part.view(leaves[i].shape) for i, part in zip(b.leaves, parts)]
            for i, view in zip(b.leaves, views):
                out[i] = view
            if found is not None:  # fully sharded parameters: the update of their shard
                _gathered.note(views, found.layout, found.bucket, "updates", shard)
        return optree.tree_unflatten(spec, out), ShardedState(
            inner_state, state.pieces, state.members
        )

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
        _check_members(cut, members_of(cut.axis_name), cut.axis_name, where)


def _check_members(
    cut: Members | None, here: Members | None, axis_name: str, where: str = "shard_state's update"
) -> None:
    if cut is None or here is None or cut.ranks == here.ranks:
        return
    raise UsageValueError(
        f"{where}: this state was cut over the group of ranks {cut.ranks}, but "
        f"axis {axis_name!r} is bound to ranks {here.ranks} here; its shards would be updated "
        "with other ranks' gradients. Run the update over the group the state was made on "
        "(init it where the step binds the axis: the same group= or axes=), or move the state "
        "to this group through fddp.save_sharded and fddp.load_sharded."
    )


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
