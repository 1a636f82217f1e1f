"""save_sharded and load_sharded: every rank writes its shards, a checksummed manifest publishes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from fddp._base import _files
from fddp._base._errors import RankFailureError, UsageValueError
from fddp._base._types import TensorTree
from fddp._checkpoint import _dcp, _like, _manifest, _storage
from fddp._checkpoint._source import METADATA, Source
from fddp._ranks import _agree, _machine, _pending, _runtime
from fddp._sharding import cut_ranks

__all__ = ["load_sharded", "save_sharded"]

# The files a plain torch.distributed.checkpoint save (fddp before the manifest) writes.
_LEGACY = r"\.metadata(\.tmp)?|__\d+_\d+\.distcp"
_SAVE, _LOAD = "fddp.save_sharded", "fddp.load_sharded"
_LIKE_ADVICE = (
    "Build `like` the way the saved tree was built: the same model config and dtypes, and for "
    "sharded optimizer state opt.init(params) of the same shard_state optimizer (same "
    "bucket_cap_mb), made on this run's ranks."
)


def save_sharded(
    path: str | os.PathLike[str], tree: TensorTree, *, group: dist.ProcessGroup | None = None
) -> None:
    """Write ``tree`` with ``torch.distributed.checkpoint``: every rank calls it, writes its part.

    ``tree`` is a pytree such as ``{"params": params, "opt": opt_state, "step": 7}`` whose
    optimizer state may come from ``fddp.optim.shard_state``: each rank writes its own shard
    of it, as a ``Shard(0)`` DTensor piece of each bucket; replicated tensors (parameters,
    step counts) are written once. :func:`load_sharded` reads it on any number of ranks.

    The save is atomic, like :func:`fddp.save`'s: the ranks write a new
    ``torch.distributed.checkpoint`` directory ``path/shards-<random>``, each hashing its
    files (SHA-256) as it writes them and fsyncing them; once every rank has succeeded, rank 0
    publishes it by replacing the manifest ``path/fddp-sharded.json`` (JSON: the data
    directory and each file's size and checksum) with one ``os.replace``, then removes the
    previous data directory. Until then ``path`` holds the previous checkpoint, untouched: a
    rank that dies, a full disk or any error leaves it as it was, and the new directory is
    removed (the next save to ``path`` removes one left by a killed save). A checkpoint of an
    older fddp (a plain ``torch.distributed.checkpoint`` directory) at ``path`` is replaced
    by the first save and its files removed.

    Like :func:`fddp.save`, it records the link and compute figures the default bucket caps
    were chosen from, which :func:`load_sharded` hands to a resumed run.

    Args:
        path: the checkpoint directory (created if missing; on a file system every rank sees).
        tree: the pytree to save; leaves are tensors or bool/int/float/str values.
        group: the process group the state is sharded over (default: the world): the one its
            layouts were cut over (under hybrid sharding, the shard group). The manifest
            records its ranks and, for fully sharded parameters, the path, shape and dtype of
            every leaf of the full tree, which :func:`load_sharded` checks ``like`` against.

    Raises:
        TypeError: If a leaf is neither a tensor nor a bool, int, float or str (on any rank);
            nothing is written.
        UsageValueError: (a ``ValueError``) If the tree's sharded state was cut over another
            group than ``group``; raised on every rank, nothing is written.
        OSError: If writing fails on any rank (disk full, permissions), with its ``errno``, on
            every rank; the message names the rank and ``path``.
        RankFailureError: If another rank died or the process group already failed.

    Example:
        >>> import os, tempfile, torch, fddp
        >>> opt = fddp.optim.shard_state(fddp.optim.adam(0.1))
        >>> params = {"w": torch.ones(3)}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     fddp.save_sharded(d, {"params": params, "opt": opt.init(params)})
        ...     back = fddp.load_sharded(d, {"params": params, "opt": opt.init(params)})
        ...     len(os.listdir(d))
        2
        >>> back["params"]["w"]
        tensor([1., 1., 1.])
    """
    path = os.fspath(path)
    given = group is not None
    n, group = _world(group)
    rank = dist.get_rank(group) if group is not None else 0
    tree = _pending.finished(tree)
    start = time.monotonic()
    error: BaseException | None = None
    state_dict: dict[str, Any] = {}
    data, fd = None, None
    try:
        state_dict = _state_dict(tree, rank, group, given, n)
        if rank == 0:
            data, fd = _new_data_directory(path)
    except Exception as e:  # raised on every rank by gather_or_raise
        error = e
    replaced = None
    try:
        with _runtime.peer_failures(_SAVE, start):
            # Every rank's leaves are fine and rank 0 made the directory: all write into it.
            name = _agree.gather_or_raise(error, data and os.path.basename(data), group)[0]
            files, named = _write(path, name, state_dict, group, n, rank)
            published: BaseException | None = None
            if rank == 0:  # and tells the others whether it could
                try:
                    assert fd is not None and {METADATA, *named} <= set(files)
                    os.fsync(fd)  # the data directory's entries, before the manifest names it
                    replaced = _manifest.published(path)
                    record = {"group_ranks": list(_ranks(group)), "layouts": _like.layouts(tree)}
                    _manifest.publish(path, name, files, n, _machine.recorded(group), record)
                except BaseException as e:
                    published = e
            _agree.raise_everywhere(published, group)
    except BaseException as e:
        _discard(path, data, e)
        raise
    finally:
        if fd is not None:
            os.close(fd)
            _files.done(cast(str, data))
    if rank == 0:
        _remove_replaced(path, replaced)


def _state_dict(
    tree: TensorTree, rank: int, group: dist.ProcessGroup | None, given: bool, n: int
) -> dict[str, Any]:
    """DCP's state dict of this rank's part of ``tree``, its leaves checked first."""
    _check_cut(tree, group, given, _SAVE)
    entries = _dcp.entries(tree, rank)
    for key, leaf, _ in entries:
        _like.check_savable(key, leaf, _SAVE)
    mesh = _dcp.mesh(group, entries) if n > 1 else None
    state_dict = {}
    for key, leaf, piece in entries:
        value = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        state_dict[key] = value if piece is None else _dcp.part(value, piece, mesh)
    return state_dict


def _new_data_directory(path: str) -> tuple[str, int]:
    """A new data directory in checkpoint directory ``path`` (made if missing), locked."""
    try:
        os.makedirs(path, exist_ok=True)
        _manifest.remove_unpublished(path)
        return _files.create_temp(os.path.join(path, _manifest.DATA_PREFIX), directory=True)
    except OSError as e:
        raise _files.write_error(e, path) from e


def _write(
    path: str,
    name: str,
    state_dict: dict[str, Any],
    group: dist.ProcessGroup | None,
    n: int,
    rank: int,
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Every rank writes its part into data directory ``name`` (DCP raises on every rank if
    one failed); every rank's files with their sizes and SHA-256, and the files DCP's
    metadata names (on rank 0, which writes it)."""
    writer = _storage.dcp().Writer(os.path.join(path, name))
    with _storage.one_process_quietly(n), _storage.errors(path, rank, writing=True):
        _storage.dcp().api.save(
            state_dict, storage_writer=writer, process_group=group, no_dist=n == 1
        )
    files: dict[str, dict[str, Any]] = {}
    for written in _agree.gather_or_raise(None, writer.files(), group):
        files.update(written)
    return files, writer.referenced


def _discard(path: str, data: str | None, error: BaseException) -> None:
    """After a failed save: remove its data directory ``data`` (rank 0's) unless published;
    after a rank failure, the one a dead rank 0 left, unlocked now."""
    if data is not None and _manifest.published(path) != os.path.basename(data):
        shutil.rmtree(data, ignore_errors=True)
    elif isinstance(error, RankFailureError):
        _manifest.remove_unpublished(path)


def _remove_replaced(path: str, replaced: str | None) -> None:
    """Remove the data directory a save replaced (unless a load holds it) and the files of a
    plain DCP checkpoint of an older fddp."""
    _manifest.remove_unpublished(path, replaced)
    for legacy in os.listdir(path):
        if re.fullmatch(_LEGACY, legacy):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, legacy))


def load_sharded(
    path: str | os.PathLike[str], like: TensorTree, *, group: dist.ProcessGroup | None = None
) -> Any:
    """Read a checkpoint written by :func:`save_sharded`, resharded for this run.

    ``like`` gives the structure, shapes and dtypes, and for sharded optimizer state the
    layout of this run: pass ``opt.init(params)`` of the same ``shard_state`` optimizer (same
    ``bucket_cap_mb``), made on this run's ranks. The checkpoint may come from a run with
    another number of ranks; it must hold the same kind of state (sharded or not). Every rank
    calls it.

    Loading is safe, as :func:`fddp.load` is: the manifest's checksum, then the size and
    SHA-256 of every file a rank reads are verified before it reads them; DCP's ``.metadata``
    (a pickle) is unpickled with an allowlist of DCP's metadata classes and the torch types
    they hold, and saved non-tensor leaves with ``weights_only=True``, so no code from the
    checkpoint runs. The saved leaves must match ``like`` leaf for leaf (the same paths,
    shapes, dtypes and types): nothing is cast; fully sharded parameters are matched by the
    full tree they were cut from, leaf by leaf. Rank 0 of ``group`` reads the manifest and the
    other ranks open the data directory it names, so every rank loads the same save even
    while another save to ``path`` publishes a new one. A plain ``torch.distributed.checkpoint``
    directory without a manifest (written by an older fddp) is read the same way, with no
    checksums to verify. Each rank holds a shared lock on the data directory while it reads,
    so a save to ``path`` meanwhile does not remove it.

    Args:
        path: the checkpoint directory.
        like: a tree of the same structure; its values are not read, only its shapes.
        group: the process group the state is sharded over (default: the world): the one the
            layouts of ``like`` were cut over.

    Returns:
        A new tree like ``like`` holding the saved values.

    Raises:
        FileNotFoundError: If ``path`` is missing or holds no checkpoint (a save interrupted
            before it published one leaves none).
        ValueError: If a file is corrupted or truncated (named), not a checkpoint, holds
            objects other than tensors and plain values, or a rank cannot open the save rank
            0 opened (not a shared file system); raised on every rank.
        UsageValueError: (a ``ValueError``) If the checkpoint does not match ``like`` (the
            message names the leaves), or ``like``'s sharded state was cut over another group
            than ``group``; raised on every rank.
        OSError: If reading fails (permissions, I/O errors), with its ``errno``.
        RankFailureError: If another rank died or the process group already failed.
    """
    path = os.fspath(path)
    given = group is not None
    n, group = _world(group)
    rank = dist.get_rank(group) if group is not None else 0
    entries = _dcp.entries(like, rank)
    with _runtime.peer_failures(_LOAD):
        source = _open(path, like, entries, group, given, rank)
        try:
            values = _read(path, source, entries, group, n, rank)
        finally:
            source.close()
    _machine.restore(source.machine, group)
    problems = []
    for (key, leaf, _), value in zip(entries, values):
        problems += _like.leaf_problems(key, value, leaf, "checkpoint")
    _like.check_leaves(path, problems, _LIKE_ADVICE)
    return _dcp.rebuild(like, iter(values))


def _open(
    path: str,
    like: TensorTree,
    entries: list[_dcp.Entry],
    group: dist.ProcessGroup | None,
    given: bool,
    rank: int,
) -> Source:
    """The save rank 0 opened, opened on every rank and checked against ``like``; an error on
    any rank is raised on every rank."""
    source: Source | None = None
    error: BaseException | None = None
    try:
        _check_cut(like, group, given, _LOAD)
        if rank == 0:  # the others open the save it opened: every rank loads the same one
            source = Source.open(path)
    except Exception as e:  # raised on every rank by gather_or_raise
        error = e
    try:
        manifest = None if source is None else source.manifest
        manifest = _agree.gather_or_raise(error, manifest, group)[0]
        try:
            if source is None:
                source = Source.chosen(path, manifest)
            saved = None if manifest is None else manifest.get("layouts")
            broken = (_manifest.MANIFEST, _manifest.BROKEN_ADVICE)
            _like.check_layouts(path, saved, like, _LIKE_ADVICE, broken)
            source.check(entries, _LIKE_ADVICE)
        except Exception as e:  # raised on every rank by raise_everywhere
            error = e
        _agree.raise_everywhere(error, group)
    except BaseException:
        if source is not None:
            source.close()
        raise
    assert source is not None
    return source


def _read(
    path: str,
    source: Source,
    entries: list[_dcp.Entry],
    group: dist.ProcessGroup | None,
    n: int,
    rank: int,
) -> list[Any]:
    """Every rank reads its part of each leaf (DCP reshards); the leaves in ``entries`` order."""
    mesh = _dcp.mesh(group, entries) if n > 1 else None
    state_dict: dict[str, Any] = {}
    buffers: dict[str, torch.Tensor] = {}
    for key, leaf, piece in entries:
        if piece is None:
            state_dict[key] = torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
            continue
        buffers[key] = torch.zeros_like(leaf)  # the padding stays zero
        state_dict[key] = _dcp.part(buffers[key], piece, mesh)
    planner = _storage.dcp().Planner(source)
    with _storage.one_process_quietly(n), _storage.errors(path, rank, writing=False):
        _storage.dcp().api.load(
            state_dict,
            storage_reader=_storage.dcp().Reader(source),
            planner=planner,
            process_group=group,
            no_dist=n == 1,
        )
    return [buffers.get(key, planner.values.get(key, state_dict[key])) for key, _, _ in entries]


def _world(group: dist.ProcessGroup | None) -> tuple[int, dist.ProcessGroup | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, None
    group = group if group is not None else dist.group.WORLD
    return dist.get_world_size(group), group


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (of a world of one without one)."""
    return (0,) if group is None else tuple(dist.get_process_group_ranks(group))


def _check_cut(tree: Any, group: dist.ProcessGroup | None, given: bool, where: str) -> None:
    """Refuse a tree whose shards were cut over other ranks than those of ``group``: each
    rank's shard would be taken for the part of the bucket of its rank in ``group``."""
    cut, ranks = cut_ranks(tree), _ranks(group)
    if cut is None or tuple(cut) == ranks:
        return
    default = "" if given else " (the default: the world)"
    raise UsageValueError(
        f"{where}: the sharded state in this tree was cut over ranks {list(cut)}, but this "
        f"call is over the group of ranks {list(ranks)}{default}, so each rank's shards would "
        "be taken for another part of every bucket. Pass group= the process group the state "
        "is sharded over (the group of its shard axis, as given to fddp.shard_params and "
        "data_parallel's axes); in hybrid sharding, each replica group saves and loads over "
        "its own shard group (e.g. to a path of its own)."
    )
