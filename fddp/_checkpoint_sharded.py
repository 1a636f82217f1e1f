"""Checkpoints of sharded state through ``torch.distributed.checkpoint``: each rank writes its
shard, and loading reshards to the world size of the loading run."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import optree
import torch
import torch.distributed as dist

from fddp import _pending
from fddp._tree import path_str
from fddp._zero import ShardedState
from fddp.typing import TensorTree

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint pulls in
    # torch.distributed.nn, which `import fddp` must not (see tests/_exit_script.py)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

_SCALARS = (bool, int, float, str)


def _is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedState)


def _world(group: dist.ProcessGroup | None) -> tuple[int, dist.ProcessGroup | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, None
    group = group if group is not None else dist.group.WORLD
    return dist.get_world_size(group), group


def _entries(tree: Any) -> list[tuple[str, Any, tuple[int, ...] | None]]:
    """``(key, leaf, piece)`` for every leaf; ``piece`` is ``(shard_length, offset, length,
    bucket_size)`` for a leaf that holds this rank's part of a bucket of a ``ShardedState``.

    Inside a ``ShardedState``, a leaf is bucket ``b``'s part when it is 1-d, its path ends in
    the list index ``b`` and its length is that bucket's shard length (the per-parameter state
    of every fddp optimizer); the ``pieces`` table itself is not saved: it depends on the world
    size and comes from ``like`` on load.
    """
    out: list[tuple[str, Any, tuple[int, ...] | None]] = []
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=_is_sharded)
    for path, leaf in zip(paths, leaves):
        if not _is_sharded(leaf):
            out.append((path_str(path), leaf, None))
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


def _check_leaf(key: str, leaf: Any) -> None:
    if not (isinstance(leaf, torch.Tensor) or type(leaf) in _SCALARS):
        raise TypeError(
            f"save_sharded: leaf {key} is a {type(leaf).__name__}; leaves must be tensors or "
            "plain bool/int/float/str values. Convert it or keep it out of the saved tree."
        )


def _part(
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


def _mesh(group: dist.ProcessGroup | None, entries: list) -> DeviceMesh | None:
    if group is None:
        return None
    device = next(
        (x.device.type for _, x, piece in entries if piece is not None),
        "cpu",
    )
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device)


def save_sharded(
    path: str | os.PathLike[str], tree: TensorTree, *, group: dist.ProcessGroup | None = None
) -> None:
    """Write ``tree`` with ``torch.distributed.checkpoint``: every rank calls it, writes its part.

    ``tree`` is a pytree such as ``{"params": params, "opt": opt_state, "step": 7}`` whose
    optimizer state may come from ``fddp.optim.shard_state``: each rank writes its own shard
    of it, as a ``Shard(0)`` DTensor piece of each bucket; replicated tensors (parameters,
    step counts) are written once. The result is a ``torch.distributed.checkpoint`` directory
    that :func:`load_sharded` reads on any number of ranks.

    Args:
        path: the checkpoint directory (created if missing; on a file system every rank sees).
        tree: the pytree to save; leaves are tensors or bool/int/float/str values.
        group: the process group the state is sharded over (default: the world).

    Example:
        >>> import os, tempfile, torch, fddp
        >>> opt = fddp.optim.shard_state(fddp.optim.adam(0.1))
        >>> params = {"w": torch.ones(3)}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     fddp.save_sharded(d, {"params": params, "opt": opt.init(params)})
        ...     back = fddp.load_sharded(d, {"params": params, "opt": opt.init(params)})
        >>> back["params"]["w"]
        tensor([1., 1., 1.])
    """
    entries = _entries(_pending.finished(tree))
    for key, leaf, _ in entries:
        _check_leaf(key, leaf)
    n, group = _world(group)
    mesh = _mesh(group, entries) if n > 1 else None
    state_dict = {
        key: _part(leaf.detach(), piece, mesh)
        if piece is not None
        else (leaf.detach() if isinstance(leaf, torch.Tensor) else leaf)
        for key, leaf, piece in entries
    }
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly(n):
        dcp.save(state_dict, checkpoint_id=os.fspath(path), process_group=group, no_dist=n == 1)


def load_sharded(
    path: str | os.PathLike[str], like: TensorTree, *, group: dist.ProcessGroup | None = None
) -> Any:
    """Read a checkpoint written by :func:`save_sharded`, resharded for this run.

    ``like`` gives the structure, shapes and dtypes, and for sharded optimizer state the
    layout of this run: pass ``opt.init(params)`` of the same ``shard_state`` optimizer (same
    ``bucket_cap_mb``), made on this run's ranks. The checkpoint may come from a run with
    another number of ranks; it must hold the same kind of state (sharded or not). Every rank
    calls it.

    Args:
        path: the checkpoint directory.
        like: a tree of the same structure; its values are not read, only its shapes.
        group: the process group the state is sharded over (default: the world).

    Returns:
        A new tree like ``like`` holding the saved values.
    """
    entries = _entries(like)
    n, group = _world(group)
    mesh = _mesh(group, entries) if n > 1 else None
    state_dict: dict[str, Any] = {}
    buffers: dict[str, torch.Tensor] = {}
    for key, leaf, piece in entries:
        if piece is None:
            state_dict[key] = torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
            continue
        buffers[key] = torch.zeros_like(leaf)  # the padding stays zero
        state_dict[key] = _part(buffers[key], piece, mesh)
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly(n):
        dcp.load(state_dict, checkpoint_id=os.fspath(path), process_group=group, no_dist=n == 1)
    values = iter(buffers.get(key, state_dict[key]) for key, _, _ in entries)
    return _rebuild(like, values)


@contextlib.contextmanager
def _one_process_quietly(n: int) -> Iterator[None]:
    """In a world of one, without the warning that dcp assumes a single process."""
    with warnings.catch_warnings():
        if n == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rebuild(like: Any, values: Any) -> Any:
    """``like`` with its leaves taken from ``values`` in ``_entries`` order."""
    leaves, spec = optree.tree_flatten(like, is_leaf=_is_sharded)
    out = []
    for leaf in leaves:
        if not _is_sharded(leaf):
            out.append(next(values))
            continue
        inner_leaves, inner_spec = optree.tree_flatten(leaf.inner)
        inner = optree.tree_unflatten(inner_spec, [next(values) for _ in inner_leaves])
        out.append(ShardedState(inner, leaf.pieces))
    return optree.tree_unflatten(spec, out)
