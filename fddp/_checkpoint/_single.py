"""``fddp.save`` and ``fddp.load``: one checksummed file, written atomically, loaded by path."""

from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base import _saved_together
from fddp._base._errors import UsageValueError
from fddp._base._types import TensorTree
from fddp._checkpoint import _format, _like, _rank0
from fddp._ranks import _machine, _pending
from fddp._sharding import ShardedState

__all__ = ["load", "save"]

PathLike = str | os.PathLike[str]


def save(path: PathLike, tree: TensorTree, *, rank0_only: bool = True) -> None:
    """Write ``tree`` to ``path`` atomically.

    The tree is any optree pytree (None is an empty subtree) whose leaves are tensors or plain
    ``bool``/``int``/``float``/``str`` values, e.g. ``{"params": ..., "opt": ..., "step": 7}``.
    The file holds the leaves, their paths and a checksum; the structure comes back from the
    ``like`` tree given to :func:`load`. Tensors are saved on their own device and dtype.
    ``torch.load`` (and ``pickle.load``) of the file raises a ``LookupError`` that says to
    call :func:`load` instead; files written by the previous release still load.

    The bytes go to a new ``<path>.tmp-<random>`` in the same directory, are flushed and
    fsynced, and replace ``path`` with one ``os.replace``: a crash or an error during the save
    leaves the previous checkpoint at ``path`` untouched and removes the temporary file (a
    killed writer's file is removed by the next save to ``path``). Saves to one path from
    several threads or processes at once each complete or raise, and ``path`` always holds one
    complete checkpoint, the last one renamed.

    The file also records the link and compute figures that ``data_parallel`` chose its default
    bucket caps from (measured once per process group, see ``fddp.data_parallel``):
    :func:`load` in a process that has not measured them yet takes them, so a resumed run
    builds the same buckets as the run it resumes and, on 3 or more ranks, sums every
    gradient in the same order (bitwise the same run).

    Under ``torch.distributed`` with more than one rank and ``rank0_only=True`` (replicated
    state), every rank calls ``save``: only rank 0 writes, and every rank returns only once
    the file is in place, so any rank may load it right after; an error on rank 0 is raised
    on every rank. If another rank has not entered ``save`` within 10 seconds of rank 0, rank 0
    raises instead of writing. With ``rank0_only=False`` every rank that calls ``save`` writes
    its own file (pass a different ``path`` per rank) and waits for no other rank: that is the
    way to save from one rank alone, e.g. ``if fddp.rank() == 0: save(p, t, rank0_only=False)``.
    A file of a tree holding sharded state (``shard_params``, ``shard_state``) records the rank
    that saved it and the world size, and :func:`load` refuses it on another rank.

    A ``rank0_only`` save of a tree holding a ``fddp.LowCommState`` (DiLoCo, LocalSGD), beside
    which the inner parameters and optimizer state are per-rank between synchronizations,
    first compares a digest of every leaf across the ranks (one all-reduce) and refuses
    values that differ: rank 0's would be the only ones written.

    Note:
        This writes one file from one process. For sharded optimizer state
        (``fddp.optim.shard_state``) or states too large for one process, use
        :func:`fddp.save_sharded`: every rank writes its shard, with the same guarantees.

    Args:
        path: File to write; its directory must exist.
        tree: The pytree to save.
        rank0_only: Whether only rank 0 writes (state replicated on every rank).

    Raises:
        TypeError: If a leaf is neither a tensor nor a bool, int, float or str; or, with
            ``rank0_only=True`` on more than one rank, if the tree holds the state of
            ``fddp.optim.shard_state`` (each rank has its own shard: save it with
            :func:`fddp.save_sharded`); nothing is written.
        OSError: If writing fails (disk full, permissions), with its ``errno`` and ``path``.
        UsageValueError: (a ``ValueError``) With ``rank0_only=True`` on more than one rank, if
            the tree holds a ``LowCommState`` and a leaf differs between ranks (named, with the
            fix); raised on every rank, nothing is written.
        SaveArrivalError: (a ``ValueError`` and a ``RankFailureError``) If a rank did not call
            ``save`` in time with ``rank0_only=True``; nothing is written.
        RankFailureError: If another rank died or the process group already failed.

    Example:
        >>> import os, tempfile, torch
        >>> tree = {"w": torch.ones(2, 3), "step": 7}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save(os.path.join(d, "ckpt.pt"), tree)
        ...     os.listdir(d)
        ['ckpt.pt']
    """
    path = os.fspath(path)
    paths, leaves, treespec = _like.flatten(_pending.finished(tree))
    for leaf_path, leaf in zip(paths, leaves):
        _like.check_savable(leaf_path, leaf, "fddp.save")
    apart = _saved_together.missing(leaves)
    if apart is not None:
        raise UsageValueError(f"fddp.save({path!r}): {apart}. Nothing was written.")
    payload = {
        "format": "fddp.checkpoint",
        "version": _format.VERSION,
        "structure": str(treespec),
        "paths": paths,
        "leaves": [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
        "machine": _machine.recorded(),  # a resumed run's bucket caps are this run's
    }
    if _like.found(tree, _like.is_sharded):
        payload["per_rank"] = {"rank": _rank(), "world_size": _world_size()}
    distributed = rank0_only and dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_world_size() == 1:
        _format.write(path, payload)
        return
    _refuse_sharded_state(tree)
    _rank0.save_from_rank0(path, payload, tree, paths, leaves)


def load(path: PathLike, like: TensorTree | None = None) -> TensorTree:
    """Read a checkpoint written by :func:`save`, checked against ``like``.

    The file's checksum is verified first, then it is unpickled with ``weights_only=True``:
    only tensors and plain Python values are accepted, no code from the file runs. The saved
    leaves must match ``like`` leaf for leaf: the same paths, and for tensors the same shape
    and dtype, for other leaves the same type. Tensors are placed on the device of the
    corresponding ``like`` leaf and do not require grad. Every rank reads the file itself, so
    under ``torch.distributed`` the path must be visible to all ranks (otherwise load on rank 0
    and ``fddp.replicate`` the result).

    Args:
        path: A file written by :func:`save`.
        like: A tree with the structure, shapes, dtypes and devices to restore, e.g. freshly
            initialised params and optimizer state; its values are not used. Without it,
            returns the file's content as a flat ``{leaf path: leaf}`` dict, keyed by the
            indexing that reaches each leaf (``"['params']['0.weight']"``,
            ``"['opt'][0].mu['0.bias']"``), to inspect or migrate an old checkpoint: the file
            holds no container classes (no code runs on load), so the tree itself comes back
            only through ``like``.

    Returns:
        A new tree with the structure of ``like`` holding the saved leaves (without ``like``:
        the flat dict above).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If the file is corrupted, truncated, not an fddp checkpoint, or holds
            objects other than tensors and plain values.
        UsageValueError: (a ``ValueError``) If the file does not match ``like`` (the message
            names the mismatching leaves), or holds the shards of another rank or of another
            number of ranks (saved per rank with sharded state: each rank loads its own file;
            ``fddp.save_sharded`` reshards).

    Example:
        >>> import os, tempfile, torch
        >>> tree = {"w": torch.ones(2, 3), "step": 7}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save(os.path.join(d, "ckpt.pt"), tree)
        ...     like = {"w": torch.zeros(2, 3), "step": 0}
        ...     restored = load(os.path.join(d, "ckpt.pt"), like=like)
        >>> restored["step"], restored["w"].sum().item()
        (7, 6.0)
    """
    path = os.fspath(path)
    if like is None:
        payload = _format.read(path, map_location="cpu")
        return dict(zip(payload["paths"], payload["leaves"]))

    like_paths, like_leaves, treespec = _like.flatten(like)
    devices = {leaf.device for leaf in like_leaves if isinstance(leaf, torch.Tensor)}
    payload = _format.read(path, map_location=devices.pop() if len(devices) == 1 else "cpu")
    _check_owner(path, payload.get("per_rank"))
    _machine.restore(payload.get("machine"))
    saved = dict(zip(payload["paths"], payload["leaves"]))
    _like.check_structure(
        path,
        like_paths,
        payload["paths"],
        "file",
        f"  saved structure: {_like.shorten(payload['structure'])}\n"
        "Build `like` the way the saved tree was built (same model config, same optimizer), "
        "or call load(path) without `like` to get the saved {path: leaf} dict and migrate it.",
    )
    leaves = []
    problems = []
    for leaf_path, want in zip(like_paths, like_leaves):
        got = saved[leaf_path]
        problems += _like.leaf_problems(leaf_path, got, want, "file")
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            got = got.to(want.device)
        leaves.append(got)
    _like.check_leaves(
        path,
        problems,
        "Build `like` with the shapes and dtypes of the saved run (same model config and "
        "dtype), or call load(path) without `like` and convert the leaves yourself.",
    )
    return optree.tree_unflatten(treespec, leaves)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_owner(path: str, per_rank: Any) -> None:
    """Refuse a file of one rank's shards (``per_rank``: its rank and world size) on another."""
    if not isinstance(per_rank, dict):
        return
    saved, here = (per_rank.get("rank"), per_rank.get("world_size")), (_rank(), _world_size())
    if saved != here:
        raise UsageValueError(
            f"checkpoint {path} holds the shards of rank {saved[0]} of {saved[1]} (sharded "
            f"state saved with fddp.save, a file per rank), but this is rank {here[0]} of "
            f"{here[1]}: its shards are not this rank's. Load on each rank the file that rank "
            'saved (fddp.load(f"ckpt-{fddp.rank()}", like)) on as many ranks; to load on '
            "other ranks or another number of them, save with fddp.save_sharded(directory, "
            "tree), which reshards."
        )


def _refuse_sharded_state(tree: TensorTree) -> None:
    """Refuse a rank0_only save of sharded optimizer state: rank 0's file would hand rank 0's
    shards to every rank that loads it, and the parameters would drift apart unnoticed."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, is_leaf=_like.is_sharded)
    for accessor, leaf in zip(accessors, leaves):
        if _like.is_sharded(leaf):
            what = (
                "the state of fddp.optim.shard_state"
                if isinstance(leaf, ShardedState)
                else "fully sharded parameters (fddp.shard_params)"
            )
            raise TypeError(
                f"fddp.save: leaf {accessor.codify('') or '<root>'} is {what}, whose shards "
                "differ between ranks; a rank0_only save "
                "would write rank 0's shards only, and every rank would load them. Save it with "
                "fddp.save_sharded(directory, tree) on every rank (it loads on any number of "
                "ranks), or each rank's own file with fddp.save(path_of_this_rank, tree, "
                "rank0_only=False). Nothing was written."
            )
