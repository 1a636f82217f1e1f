"""Fully sharded parameters (ZeRO-3, FSDP): at rest, each replica holds 1/N of every bucket.

The layout is ``shard_state``'s: whole leaves in flattening order grouped into flat buckets of
one dtype, bucket ``b`` padded to ``N * c_b`` elements, replica ``r`` holding elements
``r*c_b`` to ``(r+1)*c_b`` (``torch.chunk``'s split). With the same cap, a bucket of
parameters and the bucket of its gradients that ``shard_state`` reduce-scatters are the same
elements, so the optimizer updates the parameter shards where they rest.

Inside a traced step a :class:`ShardedParams` argument is gathered bucket by bucket into the
full tree the step expects; the compiler (``_schedule._param_gathers``) places each gather just
ahead of the parameters' first use and gathers again where they are used after other buckets
(the backward pass). The output in the same position is cut back into shards: where it is
``apply_updates(params, updates)`` of ``shard_state`` updates, each shard is this replica's
parameter shard plus its update shard, and the updates are never gathered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.fx import traceback as fx_traceback

from fddp import _axes, _gathered, _mesh, _runtime
from fddp._annotations import LEAF_PATH, PARAM_GATHER, PARAM_GATHER_KEPT
from fddp._axes import DEFAULT_AXIS
from fddp._collectives import (
    ProcessAxis,
    all_gather,
    axis_size,
    gather_rows,
    named_axis,
    process_axis,
)
from fddp._errors import UsageValueError
from fddp._tree import path_str, tensor_leaves
from fddp._zero import (
    Bucket,
    Members,
    ShardedState,
    _layout,
    check_state_group,
    members_of,
    own_shard,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a parameter tree is cut into shards: compiled into the step, the same on every rank.

    Attributes:
        tree: the full parameter tree's structure.
        shapes, dtypes: of its leaves, in flattening order.
        paths: the leaves' readable paths.
        buckets: the flat buckets (``shard_state``'s, for the same cap).
        replicas: how many replicas share each bucket.
        comm_dtype: the dtype of the gathers (None: the parameters' own).
        reshard_after_forward: gather again for the backward pass (True) or keep the gathered
            parameters from their first use to their last (False).
        axis_name: the axis the shards are cut over (a step gathers them over it).
        ranks: the process group they were cut over: its ranks in the group's order, global
            numbering (None: over ``fddp.vmap``'s replicas). Not in the repr, which ranks
            compare: under hybrid sharding each pair cuts over its own pair.
    """

    tree: optree.PyTreeSpec
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    paths: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    replicas: int
    comm_dtype: torch.dtype | None
    reshard_after_forward: bool
    axis_name: str = DEFAULT_AXIS
    ranks: tuple[int, ...] | None = None

    def __repr__(self) -> str:  # the step's signature compares it across ranks
        return (
            f"Layout({len(self.shapes)} leaves in {len(self.buckets)} buckets over "
            f"{self.replicas} replicas of axis {self.axis_name!r}, comm_dtype={self.comm_dtype}, "
            f"reshard_after_forward={self.reshard_after_forward}, buckets="
            f"{[(b.leaves[0], b.leaves[-1], b.size) for b in self.buckets]}, tree={self.tree})"
        )

    def shard_bytes(self) -> int:
        return sum(b.chunk * self.dtypes[b.leaves[0]].itemsize for b in self.buckets)

    def full_bytes(self) -> int:
        return sum(b.size * self.dtypes[b.leaves[0]].itemsize for b in self.buckets)


class ShardedParams:
    """A parameter tree at rest as this replica's shards: one flat tensor per bucket.

    Made by :func:`fddp.shard_params`; pass it where the step takes its parameters. Inside
    ``data_parallel`` the step sees the full tree; ``fddp.full_params`` gathers it outside.
    A pytree whose leaves are the shards (the layout is static), so ``fddp.save_sharded``,
    ``fddp.optim.state_bytes`` and tree utilities take it as it is.
    """

    __slots__ = ("layout", "shards")

    def __init__(self, shards: tuple[torch.Tensor, ...], layout: Layout) -> None:
        self.shards, self.layout = tuple(shards), layout

    def __repr__(self) -> str:
        return (
            f"ShardedParams({len(self.layout.shapes)} leaves in {len(self.shards)} shards, "
            f"{self.layout.shard_bytes()} of {self.layout.full_bytes()} bytes on this replica)"
        )


optree.register_pytree_node(
    ShardedParams,
    lambda s: (s.shards, s.layout),
    lambda layout, shards: ShardedParams(tuple(shards), layout),
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # the namespace fddp flattens in
)


def shard_params(
    params: Any,
    axis_name: str = DEFAULT_AXIS,
    *,
    bucket_cap_mb: float | None = None,
    comm_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    group: dist.ProcessGroup | None = None,
) -> ShardedParams:
    """This replica's shards of ``params``, for a fully sharded step (ZeRO-3, FSDP).

    Pass the result where the step takes its parameters: ``data_parallel`` gathers each bucket
    just ahead of its first use inside the step, which sees the full tree as before, and the
    step's output in the same position comes back as shards. Pair it with
    ``fddp.optim.shard_state`` (same ``bucket_cap_mb``) so that gradients are reduce-scattered
    and the update touches shards only: parameters, gradients and optimizer state at rest are
    then ``1/N`` of the replicated step's.

    Args:
        params: the full parameter tree (every replica passes the same values).
        axis_name: the replica axis to shard over (``"data"``: the process group).
        bucket_cap_mb: bytes of parameters per bucket (one gather each); None: the rule
            ``shard_state`` uses by default, so that the two layouts agree.
        comm_dtype: gather in this dtype (e.g. ``torch.bfloat16``); the step sees the
            parameters cast back to their own dtype.
        reshard_after_forward: True (FSDP2's default) frees each bucket after its forward
            use and gathers it again for the backward pass; False gathers once per step and
            keeps it until its last use (gradient accumulation then gathers once per step,
            not once per microbatch).
        group: outside a transform, the process group to shard over (default: the world;
            pass the group the step's ``data_parallel`` uses).

    The layout records the process group it was cut over (``layout.ranks``): a step or
    ``full_params`` over another group refuses it.

    Returns:
        A :class:`ShardedParams`; ``fddp.full_params`` gives the full tree back.
    """
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"shard_params: bucket_cap_mb must be positive; got {bucket_cap_mb}.")
    if isinstance(params, ShardedParams):
        raise TypeError("shard_params: these parameters are already sharded.")
    paths = optree.tree_paths(params)
    leaves, tree = tensor_leaves(params, "shard_params' params")
    if not leaves:
        raise ValueError("shard_params: the parameter tree has no tensors to shard.")
    cap = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20))
    with _bound(axis_name, group):
        replicas = axis_size(axis_name)
        layout = Layout(
            tree,
            tuple(tuple(x.shape) for x in leaves),
            tuple(x.dtype for x in leaves),
            tuple(path_str(p) for p in paths),
            _layout(leaves, replicas, cap),
            replicas,
            comm_dtype,
            reshard_after_forward,
            axis_name,
            _ranks(members_of(axis_name)),
        )
        return ShardedParams(tuple(_own_shards(leaves, layout, axis_name)), layout)


def _bound(axis_name: str, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
    """``axis_name`` bound to ``group`` where one is given (else as the caller bound it)."""
    if group is None:
        return contextlib.nullcontext()
    return _axes.bind(process_axis(axis_name, group))


def _own_shards(leaves: list[torch.Tensor], layout: Layout, axis_name: str) -> list[torch.Tensor]:
    """Copies of this replica's elements only."""
    leaves = [x.detach() for x in leaves]
    return [own_shard(leaves, b, layout.replicas, axis_name).clone() for b in layout.buckets]


def _ranks(members: Members | None) -> tuple[int, ...] | None:
    return None if members is None else members.ranks


def _check_replicas(sharded: ShardedParams, axis_name: str, where: str) -> None:
    if axis_size(axis_name) != sharded.layout.replicas:
        raise UsageValueError(
            f"{where}: these parameters are sharded over {sharded.layout.replicas} replicas, "
            f"but axis {axis_name!r} has {axis_size(axis_name)} here. {_fix(where)}"
        )


def _check_group(layout: Layout, axis_name: str, where: str) -> None:
    """Refuse ``layout`` where ``axis_name`` is bound to a process group other than the one
    it was cut over (a piece gathered from rank ``i`` of another group is another piece)."""
    here = _ranks(members_of(axis_name))
    if layout.ranks is None or here is None or here == layout.ranks:
        return
    raise UsageValueError(
        f"{where}: these parameters were sharded over the group of ranks {layout.ranks}, but "
        f"axis {axis_name!r} is bound to the group of ranks {here} here: each rank would "
        f"assemble its parameters from other ranks' pieces. {_fix(where)}"
    )


def _fix(where: str) -> str:
    if where == "fddp.full_params":
        return (
            "Leave group= (and axis_name=) unset: full_params gathers over the group they were "
            "sharded over, called on every rank of it."
        )
    return (
        "Run the step over the group they were sharded over, or shard them over the step's "
        "group (fddp.shard_params(params, axis_name, group=...) with the group the step's "
        "data_parallel binds that axis to); to move sharded parameters to another group, take "
        "fddp.full_params(sharded) (it gathers over their own group) and shard that, or go "
        "through fddp.save_sharded / fddp.load_sharded."
    )


def cut_ranks(tree: Any) -> tuple[int, ...] | None:
    """The ranks (global numbering, in the group's order) of the process group over which the
    sharded layouts in ``tree`` were cut: its ``ShardedParams`` and ``shard_state``'s
    ``ShardedState``. None when it holds none that recorded one (made under ``fddp.vmap``).

    Raises:
        UsageValueError: if it holds layouts cut over different groups.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, (ShardedParams, ShardedState))
    )
    found: dict[tuple[int, ...], str] = {}
    for path, leaf in zip(paths, leaves):
        ranks = None
        if isinstance(leaf, ShardedParams):
            ranks = leaf.layout.ranks
        elif isinstance(leaf, ShardedState):
            ranks = _ranks(leaf.members)
        if ranks is not None:
            found.setdefault(ranks, path_str(path) or "<root>")
    if len(found) > 1:
        listed = "; ".join(f"{where} over ranks {ranks}" for ranks, where in found.items())
        raise UsageValueError(
            f"this tree holds sharded layouts cut over different process groups ({listed}); "
            "a tree is saved, loaded or resharded over one group. Keep the layouts of each "
            "group in a tree of their own."
        )
    return next(iter(found), None)


_FULL_PARAMS = (
    "fddp.full_params (a collective: every rank of the group the parameters are sharded over "
    "calls it, with rank0_only=True too)"
)


def full_params(
    sharded: ShardedParams,
    axis_name: str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    rank0_only: bool = False,
) -> Any:
    """The full parameter tree of ``sharded``, on every replica (one gather per bucket).

    For evaluation and export: ``model.load_state_dict(fddp.full_params(sharded))`` takes it
    when the tree is the dict of ``fddp.state(model)``. ``rank0_only=True`` (over a process
    group) gathers the shards to the group's rank 0 only, which returns the tree; the other
    ranks send their shards and return None, holding no full bucket at any time (FSDP's
    ``rank0_only`` state dicts).

    A collective over the group the parameters were sharded over (their layout records it;
    under hybrid sharding, this rank's shard group): every rank of it calls ``full_params``.
    ``axis_name`` (default: the one they were sharded over) and ``group`` choose another
    binding, which must be a group of the same ranks; inside a transform, ``axis_name`` is
    the axis bound there.

    Raises:
        UsageValueError: if ``group`` (or the bound axis) is not the group they were cut over.
        RankFailureError: if another rank of the group died or did not call it in time.
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(
            f"full_params takes the ShardedParams made by fddp.shard_params, not a "
            f"{type(sharded).__name__}."
        )
    layout = sharded.layout
    name = layout.axis_name if axis_name is None else axis_name
    with _runtime.peer_failures(_FULL_PARAMS), _own_group(layout, name, group):
        _check_replicas(sharded, name, "fddp.full_params")
        _check_group(layout, name, "fddp.full_params")
        if rank0_only:
            return _on_rank0(sharded, name)
        return _unpacked(sharded, name, annotate=None)


def _own_group(
    layout: Layout, axis_name: str, group: dist.ProcessGroup | None
) -> contextlib.AbstractContextManager:
    """``axis_name`` bound to ``group``, else as a transform binds it here, else to the group
    ``layout`` was cut over."""
    if group is not None or _axes.find(axis_name) is not None or layout.ranks is None:
        return _bound(axis_name, group)
    _runtime.ensure_group()
    own = _mesh.group_over(layout.ranks)
    if own is None:
        raise UsageValueError(
            f"fddp.full_params: these parameters were sharded over the group of ranks "
            f"{layout.ranks}, which is not a process group of this rank (destroyed, or made in "
            "another run); pass group=, a group of those ranks."
        )
    return _bound(axis_name, own)


def _on_rank0(sharded: ShardedParams, axis_name: str) -> Any:
    axis = named_axis(axis_name)
    if not isinstance(axis, ProcessAxis):
        raise ValueError(
            f"full_params(rank0_only=True) gathers over a process group; axis {axis_name!r} "
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
            for i, view in zip(bucket.leaves, _bucket_views(torch.cat(received), bucket, layout)):
                leaves[i] = view
    return optree.tree_unflatten(layout.tree, leaves) if root else None


def _bucket_views(full: torch.Tensor, bucket: Bucket, layout: Layout) -> list[torch.Tensor]:
    """The leaves of ``bucket``, as views of its gathered flat buffer ``full``."""
    sizes = [math.prod(layout.shapes[i]) for i in bucket.leaves]
    parts = full[: bucket.size].split(sizes)
    return [p.view(layout.shapes[i]) for p, i in zip(parts, bucket.leaves)]


# The functions that take sharded parameters themselves: fddp.vmap does not gather for them.
TAKES_SHARDS = frozenset({full_params})


def _unpacked(
    sharded: ShardedParams,
    axis_name: str,
    annotate: str | None,
    skeleton: Any = None,
    one_at_a_time: bool = False,
) -> Any:
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
            views = _bucket_views(full, bucket, layout)
        for i, view in zip(bucket.leaves, views):
            leaves[i] = view
        if annotate is not None:
            _gathered.note(views, layout, b, "params", shard)
    if skeleton is None:
        return optree.tree_unflatten(layout.tree, leaves)
    return optree.tree_map(lambda i: leaves[i], skeleton)


def _skeleton(layout: Layout) -> Any:
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


def _resharded(tree: Any, layout: Layout, skeleton: Any, where: str) -> ShardedParams:
    leaves, spec = optree.tree_flatten(tree)
    if spec != optree.tree_structure(skeleton) or any(
        not isinstance(x, torch.Tensor) or tuple(x.shape) != s or x.dtype != d
        for x, s, d in zip(leaves, layout.shapes, layout.dtypes)
    ):
        raise UsageValueError(
            f"{where} takes sharded parameters, so the step's output in the same position must "
            "be the new parameters, with the same tree, shapes and dtypes (they are cut back "
            f"into shards); it returned {_short(tree)}. Return the parameters at the position "
            "of the argument they came in, or pass the full tree (not fddp.shard_params)."
        )
    shards = []
    for b, bucket in enumerate(layout.buckets):
        members = [leaves[i] for i in bucket.leaves]
        piece = _gathered.bucket_of(members, "params")
        if piece is not None and piece.layout is layout and piece.bucket == b:
            shards.append(piece.shard)
        else:
            shards.append(own_shard(leaves, bucket, layout.replicas, layout.axis_name))
    return ShardedParams(tuple(shards), layout)


def _short(tree: Any) -> str:
    leaves, spec = optree.tree_flatten(tree)
    return f"a tree of {len(leaves)} leaves {spec}"


def _states(args: tuple) -> list[ShardedState]:
    leaves = optree.tree_leaves(args, is_leaf=lambda x: isinstance(x, ShardedState))
    return [x for x in leaves if isinstance(x, ShardedState)]


def holds_shards(args: tuple) -> bool:
    """Whether ``args`` hold sharded parameters or optimizer state: each rank's graph then
    updates its own shards, with nodes of its own, so the graphs are not compared."""
    sharded = (ShardedParams, ShardedState)
    leaves = optree.tree_leaves(args, is_leaf=lambda x: isinstance(x, sharded), none_is_leaf=True)
    return any(isinstance(x, sharded) for x in leaves)


def sharded_positions(args: tuple) -> tuple[int, ...]:
    """The positions of ``args`` that hold :class:`ShardedParams`."""
    return tuple(i for i, a in enumerate(args) if isinstance(a, ShardedParams))


def gathering(
    step_fn: Callable[..., Any], args: tuple, where: str, one_at_a_time: bool = False
) -> Any:
    """``step_fn`` as a step on ``args``' sharded parameters: each :class:`ShardedParams`
    argument gathered into its full tree over the axis it is sharded over, the output in its
    position cut back into shards (``step_fn`` itself where no argument is sharded). Sharded
    parameters and ``shard_state`` states bound to another group than they were cut over are
    refused first, before any capture.

    ``one_at_a_time``: the step runs as fddp schedules it, whose parameter gathers never
    overlap (``_schedule._param_gathers``), so they may use gloo's own all-gather. Not under
    Inductor, which moves waits and would let two run at once: that corrupts gloo's heap."""
    for state in _states(args):  # before tracing, on every capture path
        check_state_group(state, f"{where}, shard_state's state")
    positions = sharded_positions(args)
    if not positions:
        return step_fn
    layouts = {n: args[n].layout for n in positions}
    skeletons = {n: _skeleton(layout) for n, layout in layouts.items()}
    for n in positions:  # before tracing: every rank raises it alike
        _check_replicas(args[n], layouts[n].axis_name, f"{where}, argument {n}")
        _check_group(layouts[n], layouts[n].axis_name, f"{where}, argument {n}")

    def sharded_step(*call_args: Any) -> Any:
        with _gathered.recording():
            full = list(call_args)
            for n in positions:
                full[n] = _unpacked(
                    call_args[n], layouts[n].axis_name, str(n), skeletons[n], one_at_a_time
                )
            out = step_fn(*full)
            single = not isinstance(out, tuple)
            outs = [out] if single else list(out)
            for n in positions:
                if n >= len(outs):
                    raise UsageValueError(
                        f"{where} takes sharded parameters as argument {n}, so the step must "
                        f"return the new parameters at position {n}; it returned "
                        f"{len(outs)} value{'s' * (len(outs) != 1)}."
                    )
                outs[n] = _resharded(outs[n], layouts[n], skeletons[n], where)
            if single:
                return outs[0]
            return tuple(outs) if type(out) is tuple else type(out)(*outs)

    return sharded_step
