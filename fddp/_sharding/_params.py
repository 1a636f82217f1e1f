"""Fully sharded parameters (ZeRO-3): a parameter tree's layout and this replica's shards of it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base import _axes
from fddp._base._axes import DEFAULT_AXIS
from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._base._tree import path_str, tensor_leaves
from fddp._collectives._ops import axis_size, process_axis
from fddp._sharding._group import members_of, ranks_of
from fddp._sharding._layout import Bucket, cap_bytes, layout_of, own_shard


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

    @functools.cached_property
    def names(self) -> dict[str, int]:
        """Each leaf's index by its name: the keys of its path joined by dots, as in
        ``model.state_dict()`` (``"0.weight"`` for a flat dict's key ``"0.weight"``)."""
        names = [".".join(map(str, path)) for path in self.tree.paths()]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise UsageValueError(
                f"ShardedParams: leaves of this tree share the names {twice} (paths joined by "
                "dots); index the full tree from fddp.full_params instead, or give the leaves "
                "distinct keys."
            )
        return {name: i for i, name in enumerate(names)}

    @functools.cached_property
    def places(self) -> tuple[tuple[int, int], ...]:
        """Each leaf's bucket and first element in it, by leaf index."""
        places = [(0, 0)] * len(self.shapes)
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for i in bucket.leaves:
                places[i] = (b, offset)
                offset += math.prod(self.shapes[i])
        return tuple(places)


class ShardedParams(Mapping[str, torch.Tensor]):
    """A parameter tree at rest as this replica's shards: one flat tensor per bucket.

    Made by :func:`fddp.shard_params`; pass it where the step takes its parameters. Inside
    ``data_parallel`` the step sees the full tree; ``fddp.full_params`` gathers it outside.
    A pytree whose leaves are the shards (the layout is static), so ``fddp.save_sharded``,
    ``fddp.optim.state_bytes`` and tree utilities take it as it is.

    A read-only ``Mapping`` from each leaf's name (its path's keys joined by dots, as in
    ``model.state_dict()``; in flattening order) to this replica's piece of that leaf: a 1-d
    view of the shard holding the elements :meth:`local_slice` of the flattened leaf (empty
    where this replica holds none of it). It shares memory with the shard, as
    ``DTensor.to_local()`` does: an in-place write changes this replica's parameters only. The
    full leaf is ``fddp.full_params(sharded)[name]``.

    >>> import fddp, torch
    >>> sharded = fddp.shard_params({"w": torch.ones(2, 3), "b": torch.zeros(3)})
    >>> list(sharded), "w" in sharded
    (['b', 'w'], True)
    >>> sharded["w"]  # on one replica, all of it
    tensor([1., 1., 1., 1., 1., 1.])
    """

    __slots__ = ("layout", "shards")

    def __init__(self, shards: tuple[torch.Tensor, ...], layout: Layout) -> None:
        self.shards, self.layout = tuple(shards), layout

    def __repr__(self) -> str:
        return (
            f"ShardedParams({len(self.layout.shapes)} leaves in {len(self.shards)} shards, "
            f"{self.layout.shard_bytes()} of {self.layout.full_bytes()} bytes on this replica)"
        )

    __eq__ = object.__eq__  # an object, not its values: a Mapping would compare tensors
    __hash__ = object.__hash__

    def __len__(self) -> int:
        return len(self.layout.shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.names

    def __getitem__(self, name: str) -> torch.Tensor:
        span, (b, offset) = self.local_slice(name), self._place(name)
        start = _chunk_index(self.layout) * self.layout.buckets[b].chunk
        return self.shards[b][offset + span.start - start : offset + span.stop - start]

    def local_slice(self, name: str) -> slice:
        """The elements of leaf ``name``, flattened, that this replica holds: ``sharded[name]``
        is ``fddp.full_params(sharded)[name].reshape(-1)[sharded.local_slice(name)]``.

        >>> import fddp, torch
        >>> fddp.shard_params({"w": torch.ones(2, 3)}).local_slice("w")
        slice(0, 6, None)
        """
        b, offset = self._place(name)
        chunk = self.layout.buckets[b].chunk
        start = _chunk_index(self.layout) * chunk
        numel = math.prod(self.layout.shapes[self.layout.names[name]])
        lo, hi = max(offset, start) - offset, min(offset + numel, start + chunk) - offset
        return slice(lo, hi) if lo < hi else slice(0, 0)

    def _place(self, name: str) -> tuple[int, int]:
        index = self.layout.names.get(name)
        if index is None:
            known = ", ".join(repr(n) for n in list(self.layout.names)[:8])
            raise KeyError(
                f"ShardedParams has no leaf {name!r}; its leaves are named by their paths' keys "
                f"joined by dots: {known}{', ...' if len(self) > 8 else ''}"
            )
        return self.layout.places[index]


optree.register_pytree_node(
    ShardedParams,
    lambda s: (s.shards, s.layout),
    lambda layout, shards: ShardedParams(tuple(shards), layout),
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # the namespace fddp flattens in
)


def _chunk_index(layout: Layout) -> int:
    """Which chunk of each bucket this process holds: its rank in the group they were cut over."""
    if layout.ranks is None or not dist.is_initialized() or dist.get_rank() not in layout.ranks:
        raise UsageValueError(
            "ShardedParams: these shards were not cut over a process group of this process "
            "(fddp.vmap's replicas hold them all), so no piece of a leaf is this process's; "
            "index fddp.full_params(sharded) instead."
        )
    return layout.ranks.index(dist.get_rank())


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
    then ``1/N`` of the replicated step's. The two share one layout: with the same cap, a
    bucket of parameters and the bucket of its gradients that ``shard_state`` reduce-scatters
    are the same elements, so the optimizer updates the parameter shards where they rest.

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
        A :class:`ShardedParams`; ``fddp.full_params`` gives the full tree back, and
        ``sharded[name]`` this replica's piece of one leaf.

    >>> import fddp, torch
    >>> fddp.shard_params({"w": torch.ones(2, 3)})
    ShardedParams(1 leaves in 1 shards, 24 of 24 bytes on this replica)
    """
    cap = cap_bytes(bucket_cap_mb, "shard_params")
    if isinstance(params, ShardedParams):
        raise UsageTypeError("shard_params: these parameters are already sharded.")
    paths = optree.tree_paths(params)
    leaves, tree = tensor_leaves(params, "shard_params' params")
    if not leaves:
        raise UsageValueError("shard_params: the parameter tree has no tensors to shard.")
    with bound(axis_name, group):
        replicas = axis_size(axis_name)
        layout = Layout(
            tree,
            tuple(tuple(x.shape) for x in leaves),
            tuple(x.dtype for x in leaves),
            tuple(path_str(p) for p in paths),
            layout_of(leaves, replicas, cap, "shard_params"),
            replicas,
            comm_dtype,
            reshard_after_forward,
            axis_name,
            ranks_of(members_of(axis_name)),
        )
        detached = [x.detach() for x in leaves]
        shards = [own_shard(detached, b, replicas, axis_name).clone() for b in layout.buckets]
        return ShardedParams(tuple(shards), layout)


def bound(axis_name: str, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
    """``axis_name`` bound to ``group`` where one is given (else as the caller bound it)."""
    if group is None:
        return contextlib.nullcontext()
    return _axes.bind(process_axis(axis_name, group))


def check_replicas(sharded: ShardedParams, axis_name: str, where: str) -> None:
    """Refuse ``sharded`` where ``axis_name`` has another number of replicas."""
    if axis_size(axis_name) != sharded.layout.replicas:
        raise UsageValueError(
            f"{where}: these parameters are sharded over {sharded.layout.replicas} replicas, "
            f"but axis {axis_name!r} has {axis_size(axis_name)} here. {_fix(where)}"
        )


def check_group(layout: Layout, axis_name: str, where: str) -> None:
    """Refuse ``layout`` where ``axis_name`` is bound to a process group other than the one
    it was cut over (a piece gathered from rank ``i`` of another group is another piece)."""
    here = ranks_of(members_of(axis_name))
    if layout.ranks is None or here is None or here == layout.ranks:
        return
    raise UsageValueError(
        f"{where}: these parameters were sharded over the group of ranks {layout.ranks}, but "
        f"axis {axis_name!r} is bound to the group of ranks {here} here: each rank would "
        f"assemble its parameters from other ranks' pieces. {_fix(where)}"
    )


def _fix(where: str) -> str:
    if where.startswith("fddp.full_"):
        return (
            f"Leave group= (and axis_name=) unset: {where} gathers over the group they were "
            "sharded over, called on every rank of it."
        )
    return (
        "Run the step over the group they were sharded over, or shard them over the step's "
        "group (fddp.shard_params(params, axis_name, group=...) with the group the step's "
        "data_parallel binds that axis to); to move sharded parameters to another group, take "
        "fddp.full_params(sharded) (it gathers over their own group) and shard that, or go "
        "through fddp.save_sharded / fddp.load_sharded."
    )
