"""A tree as torch.distributed.checkpoint's state dict: a key per leaf, shards as DTensor pieces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import optree
import torch
import torch.distributed as dist

from fddp._base._tree import path_str
from fddp._checkpoint._like import is_sharded
from fddp._sharding import ShardedParams, bucket_piece

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint pulls in
    # torch.distributed.nn, which `import fddp` must not (see tests/_exit_script.py)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["Entry", "entries", "mesh", "part", "rebuild"]

Entry = tuple[str, Any, "tuple[int, ...] | None"]  # key, leaf, its piece of a bucket


def entries(tree: Any, rank: int = 0) -> list[Entry]:
    """``(key, leaf, piece)`` for every leaf; ``piece`` is ``(shard_length, offset, length,
    bucket_size)`` for a leaf that holds this rank's part of a bucket of a ``ShardedState``.

    Inside a ``ShardedState``, a leaf is bucket ``b``'s part when it is 1-d, its path ends in
    the list index ``b`` and its length is that bucket's shard length (the per-parameter state
    of every fddp optimizer); the ``pieces`` table itself is not saved: it depends on the world
    size and comes from ``like`` on load. A ``ShardedParams``' shards are the same kind of
    parts of its buckets, on ``rank``.
    """
    out: list[Entry] = []
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_sharded)
    for path, leaf in zip(paths, leaves):
        if not is_sharded(leaf):
            out.append((path_str(path), leaf, None))
            continue
        if isinstance(leaf, ShardedParams):
            for index, (x, bucket) in enumerate(zip(leaf.shards, leaf.layout.buckets)):
                out.append((path_str((*path, "shards", index)), x, bucket_piece(bucket, rank)))
            continue
        pieces = [tuple(int(v) for v in row) for row in leaf.pieces.tolist()]
        inner_paths, inner_leaves, _ = optree.tree_flatten_with_path(leaf.inner)
        for sub, x in zip(inner_paths, inner_leaves):
            key = path_str((*path, "inner", *sub))
            b = sub[-1] if sub else None
            is_part = (
                isinstance(x, torch.Tensor)
                and isinstance(b, int)
                and b < len(pieces)
                and x.dim() == 1
                and x.shape[0] == pieces[b][0]
            )
            out.append((key, x, pieces[cast(int, b)] if is_part else None))
    return out


def part(
    local: torch.Tensor, piece: tuple[int, ...], mesh: DeviceMesh | None
) -> torch.Tensor | DTensor:
    """This rank's valid elements of a bucket, as a ``Shard(0)`` piece of the whole bucket."""
    from torch.distributed.tensor import DTensor, Shard

    _, _, length, size = piece
    valid = local.narrow(0, 0, length)
    if mesh is None:
        return valid
    return DTensor.from_local(
        valid, mesh, [Shard(0)], run_check=False, shape=torch.Size([size]), stride=(1,)
    )


def mesh(group: dist.ProcessGroup | None, entries: list[Entry]) -> DeviceMesh | None:
    """The 1-d mesh of ``group`` on the device of the sharded leaves (None: no group)."""
    if group is None:
        return None
    device = next((x.device.type for _, x, piece in entries if piece is not None), "cpu")
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device)


def rebuild(like: Any, values: Iterator[Any]) -> Any:
    """``like`` with its leaves taken from ``values`` in :func:`entries` order."""
    leaves, spec = optree.tree_flatten(like, is_leaf=is_sharded)
    out = []
    for leaf in leaves:
        if not is_sharded(leaf):
            out.append(next(values))
            continue
        if isinstance(leaf, ShardedParams):
            out.append(ShardedParams(tuple(next(values) for _ in leaf.shards), leaf.layout))
            continue
        inner_leaves, inner_spec = optree.tree_flatten(leaf.inner)
        inner = optree.tree_unflatten(inner_spec, [next(values) for _ in inner_leaves])
        out.append(leaf._replace(inner=inner))
    return optree.tree_unflatten(spec, out)
