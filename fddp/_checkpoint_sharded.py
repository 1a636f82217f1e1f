"""Sharded checkpoints: every rank writes its shard with ``torch.distributed.checkpoint`` into a
new directory, published by a checksummed manifest; a load verifies it and reshards."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, cast

import optree
import torch
import torch.distributed as dist

from fddp import _machine, _pending, _runtime
from fddp._checkpoint import (
    _O_CLOEXEC,
    _O_DIRECTORY,
    _check_leaves,
    _check_structure,
    _create_temp,
    _HashingWriter,
    _leaf_problems,
    _lock_shared,
    _NotATensor,
    _os_errors,
    _peer_checked,
    _remove_unlocked,
    _replace_atomically,
    _sha256,
    _unpickler_reason,
    _write_error,
    _writing,
    _writing_lock,
)
from fddp._errors import RankFailureError, UsageValueError
from fddp._sharded_params import ShardedParams, cut_ranks
from fddp._tree import path_str
from fddp._types import TensorTree
from fddp._zero import ShardedState, bucket_piece

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint pulls in
    # torch.distributed.nn, which `import fddp` must not (see tests/_exit_script.py)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["load_sharded", "save_sharded"]

_SCALARS = (bool, int, float, str)
# A checkpoint directory: the manifest names the one data directory that holds the checkpoint
# (a torch.distributed.checkpoint directory) and the size and SHA-256 of each of its files.
MANIFEST = "fddp-sharded.json"
_FORMAT = "fddp.sharded_checkpoint"
_VERSION = 1
_DATA_PREFIX = "shards-"
_DATA = r"shards-[0-9a-f]+"
_FILE = r"(?!\.\.?$)[^/\\]+"  # a file of the data directory: a plain name
_METADATA = ".metadata"
# The files a plain torch.distributed.checkpoint save (fddp before the manifest) writes.
_LEGACY = r"\.metadata(\.tmp)?|__\d+_\d+\.distcp"
_OPEN_ATTEMPTS = 5
_SAVE, _LOAD = "fddp.save_sharded", "fddp.load_sharded"
_BROKEN_ADVICE = (
    "; save_sharded publishes a checkpoint only after every rank has written and checksummed "
    "its files, so this one was damaged afterwards (disk, copy, edit): load an older one"
)
_LIKE_ADVICE = (
    "Build `like` the way the saved tree was built: the same model config and dtypes, and for "
    "sharded optimizer state opt.init(params) of the same shard_state optimizer (same "
    "bucket_cap_mb), made on this run's ranks."
)


def _is_sharded(x: Any) -> bool:
    return isinstance(x, (ShardedState, ShardedParams))


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


def _layouts(tree: Any) -> dict[str, dict[str, list]]:
    """By the path of each ``ShardedParams`` in ``tree``: the path, shape and dtype of every
    leaf of the full tree it is cut from (its shards alone do not say)."""
    out: dict[str, dict[str, list]] = {}
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=_is_sharded)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, ShardedParams):
            layout = leaf.layout
            out[path_str(path)] = {
                "paths": list(layout.paths),
                "shapes": [list(shape) for shape in layout.shapes],
                "dtypes": [str(dtype) for dtype in layout.dtypes],
            }
    return out


def _well_formed(layout: Any) -> bool:
    """Whether a manifest's record of a full tree is what :func:`_layouts` writes."""
    if not isinstance(layout, dict):
        return False
    paths, shapes, dtypes = (layout.get(k) for k in ("paths", "shapes", "dtypes"))
    return (
        isinstance(paths, list)
        and isinstance(shapes, list)
        and isinstance(dtypes, list)
        and len(paths) == len(shapes) == len(dtypes) == len(set(map(str, paths)))
        and all(isinstance(p, str) and isinstance(d, str) for p, d in zip(paths, dtypes))
        and all(isinstance(s, list) and all(type(n) is int for n in s) for s in shapes)
    )


def _check_layouts(path: str, saved: Any, like: Any) -> None:
    """Compare the full trees of ``like``'s fully sharded parameters with those saved (a
    manifest's ``layouts``; None for a checkpoint that has none), leaf by leaf and by path."""
    if not isinstance(saved, dict):
        return
    for key, want in _layouts(like).items():
        got = saved.get(key)
        if got is None:
            continue  # not saved as fully sharded parameters: DCP's keys say so
        if not _well_formed(got):
            raise ValueError(
                f"checkpoint {path} is corrupted ({MANIFEST}: the full tree of {key} is not "
                f"lists of paths, shapes and dtypes of one length){_BROKEN_ADVICE}"
            )
        prefix = "" if key == "<root>" else key
        name = {p: prefix + p if p != "<root>" else key for p in want["paths"] + got["paths"]}
        _check_structure(
            path,
            [name[p] for p in want["paths"]],
            [name[p] for p in got["paths"]],
            "checkpoint",
            _LIKE_ADVICE,
        )
        problems = []
        theirs = {p: i for i, p in enumerate(got["paths"])}
        for i, p in enumerate(want["paths"]):
            j = theirs[p]
            shape, dtype = got["shapes"][j], got["dtypes"][j]
            if shape != want["shapes"][i]:
                problems.append(
                    f"{name[p]}: shape {tuple(shape)} in the checkpoint, "
                    f"{tuple(want['shapes'][i])} in like"
                )
            if dtype != want["dtypes"][i]:
                problems.append(
                    f"{name[p]}: dtype {dtype} in the checkpoint, {want['dtypes'][i]} in like"
                )
            if i != j:
                problems.append(
                    f"{name[p]}: leaf {j} of the checkpoint's fully sharded tree, leaf {i} of "
                    "like's (its place in the buckets)"
                )
        _check_leaves(path, problems, _LIKE_ADVICE)


def _entries(tree: Any, rank: int = 0) -> list[tuple[str, Any, tuple[int, ...] | None]]:
    """``(key, leaf, piece)`` for every leaf; ``piece`` is ``(shard_length, offset, length,
    bucket_size)`` for a leaf that holds this rank's part of a bucket of a ``ShardedState``.

    Inside a ``ShardedState``, a leaf is bucket ``b``'s part when it is 1-d, its path ends in
    the list index ``b`` and its length is that bucket's shard length (the per-parameter state
    of every fddp optimizer); the ``pieces`` table itself is not saved: it depends on the world
    size and comes from ``like`` on load. A ``ShardedParams``' shards are the same kind of
    parts of its buckets, on ``rank``.
    """
    out: list[tuple[str, Any, tuple[int, ...] | None]] = []
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=_is_sharded)
    for path, leaf in zip(paths, leaves):
        if not _is_sharded(leaf):
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
    entries = _entries(tree, rank)
    start = time.monotonic()
    error: BaseException | None = None
    state_dict: dict[str, Any] = {}
    try:
        _check_cut(tree, group, given, _SAVE)
        for key, leaf, _ in entries:
            _check_leaf(key, leaf)
        mesh = _mesh(group, entries) if n > 1 else None
        for key, leaf, piece in entries:
            value = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
            state_dict[key] = value if piece is None else _part(value, piece, mesh)
    except Exception as e:  # raised on every rank by _gather_or_raise
        error = e
    data, fd = None, None
    if rank == 0 and error is None:
        try:
            os.makedirs(path, exist_ok=True)
            _remove_unpublished(path)
            data, fd = _create_temp(os.path.join(path, _DATA_PREFIX), directory=True)
        except OSError as e:
            error = _write_error(e, path)
    try:
        # Every rank's leaves are fine and rank 0 made the directory: all write into it.
        name = _gather_or_raise(error, data and os.path.basename(data), group, start, _SAVE)[0]
        writer = _dcp().Writer(os.path.join(path, name))
        with _one_process_quietly(n), _dcp_errors(path, rank, start, writing=True):
            _peer_checked(
                _dcp().api.save,
                state_dict,
                storage_writer=writer,
                process_group=group,
                no_dist=n == 1,
                start=start,
                where=_SAVE,
            )
        # Every rank wrote its files (DCP raises on every rank if one failed): rank 0 lists
        # them all in the manifest, publishes it, and tells the others whether it could.
        files: dict[str, dict[str, Any]] = {}
        for part in _gather_or_raise(None, writer.files(), group, start, _SAVE):
            files.update(part)
        published, replaced = None, None
        if rank == 0:
            try:
                assert fd is not None and {_METADATA, *writer.referenced} <= set(files)
                os.fsync(fd)  # the data directory's entries, before the manifest names it
                replaced = _published(path)
                record = {"group_ranks": list(_ranks(group)), "layouts": _layouts(tree)}
                _publish(path, name, files, n, _machine.recorded(group), record)
            except BaseException as e:
                published = e
        _gather_or_raise(published, None, group, start, _SAVE)
    except BaseException as e:
        if data is not None and _published(path) != os.path.basename(data):
            shutil.rmtree(data, ignore_errors=True)
        elif isinstance(e, RankFailureError):
            _remove_unpublished(path)  # a dead rank 0's directory, unlocked now
        raise
    finally:
        if fd is not None:
            os.close(fd)
            with _writing_lock:
                _writing.discard(cast(str, data))
    if rank == 0:
        _remove_unpublished(path, replaced)  # the previous one, unless a load holds it
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
    entries = _entries(like, rank)
    start = time.monotonic()
    source: _Source | None = None
    error: BaseException | None = None
    try:
        _check_cut(like, group, given, _LOAD)
        if rank == 0:  # the others open the save it opened: every rank loads the same one
            source = _Source.open(path)
    except Exception as e:  # raised on every rank by _gather_or_raise
        error = e
    try:
        manifest = None if source is None else source.manifest
        manifest = _gather_or_raise(error, manifest, group, start, _LOAD)[0]
        try:
            if source is None:
                source = _Source.chosen(path, manifest)
            _check_layouts(path, None if manifest is None else manifest.get("layouts"), like)
            source.check(entries)
        except Exception as e:  # raised on every rank by _gather_or_raise
            error = e
        _gather_or_raise(error, None, group, start, _LOAD)
        assert source is not None
        mesh = _mesh(group, entries) if n > 1 else None
        state_dict: dict[str, Any] = {}
        buffers: dict[str, torch.Tensor] = {}
        for key, leaf, piece in entries:
            if piece is None:
                state_dict[key] = torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
                continue
            buffers[key] = torch.zeros_like(leaf)  # the padding stays zero
            state_dict[key] = _part(buffers[key], piece, mesh)
        planner = _dcp().Planner(source)
        with _one_process_quietly(n), _dcp_errors(path, rank, start, writing=False):
            _peer_checked(
                _dcp().api.load,
                state_dict,
                storage_reader=_dcp().Reader(source),
                planner=planner,
                process_group=group,
                no_dist=n == 1,
                start=start,
                where=_LOAD,
            )
    finally:
        if source is not None:
            source.close()
    _machine.restore(source.machine, group)
    values = [buffers.get(key, planner.values.get(key, state_dict[key])) for key, _, _ in entries]
    problems = []
    for (key, leaf, _), value in zip(entries, values):
        problems += _leaf_problems(key, value, leaf, "checkpoint")
    _check_leaves(path, problems, _LIKE_ADVICE)
    return _rebuild(like, iter(values))


def _gather_or_raise(
    error: BaseException | None,
    value: Any,
    group: dist.ProcessGroup | None,
    start: float,
    where: str,
) -> list[Any]:
    """Every rank's ``value``; if a rank had an ``error``, it is raised on every rank (this
    rank's own first, else the lowest rank's)."""
    pairs: list[Any] = [(error, value)]
    if group is not None:
        pairs = [None] * dist.get_world_size(group)
        pair = (None if error is None else _portable(error), value)
        _peer_checked(dist.all_gather_object, pairs, pair, group=group, start=start, where=where)
    if error is not None:
        raise error
    failed = next(((r, e) for r, (e, _) in enumerate(pairs) if e is not None), None)
    if failed is not None:
        raise _on_rank(failed[1], failed[0])
    return [v for _, v in pairs]


def _portable(error: BaseException) -> BaseException:
    """``error`` as another rank can unpickle it: a built-in exception or fddp's, else a
    RuntimeError that names it."""
    if type(error).__module__ in ("builtins", "fddp._errors") and isinstance(error, Exception):
        return error
    if isinstance(error, RankFailureError):
        return RankFailureError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")


def _on_rank(error: BaseException, rank: int) -> BaseException:
    """``error``, raised on ``rank``, as another rank raises it: same type, the rank named."""
    note = f" (on rank {rank})"
    if isinstance(error, OSError) and error.errno is not None:
        return OSError(error.errno, f"{error.strerror}{note}", error.filename)
    first, *rest = str(error).split("\n", 1)
    message = "\n".join([first + note, *rest])
    try:
        return type(error)(message)
    except TypeError:  # a constructor of other arguments
        return RuntimeError(f"{type(error).__name__}: {message}")


@contextlib.contextmanager
def _dcp_errors(path: str, rank: int, start: float, *, writing: bool) -> Iterator[None]:
    """Raise the error of the lowest failing rank that ``torch.distributed.checkpoint`` (DCP)
    reports as a ``CheckpointException`` (a ``BaseException``, of multi-line tracebacks) as
    fddp's: an ``OSError`` keeps its errno, fddp's own errors are raised as they are."""
    try:
        yield
    except _dcp().CheckpointException as e:
        failed, (error, _) = min(e.failures.items(), key=lambda item: item[0])
        if not isinstance(error, Exception):
            raise error from None  # KeyboardInterrupt and the like
        note = "" if failed == rank else f" (on rank {failed})"
        if isinstance(error, OSError) and error.errno is not None:
            if writing:
                raise _write_error(error, path, f" on rank {failed}") from None
            reason = f"cannot read checkpoint {path}: {error.strerror}{note}"
            raise OSError(error.errno, reason, error.filename or path) from None
        if isinstance(error, RuntimeError) and _runtime.is_peer_failure(error):
            where = _SAVE if writing else _LOAD
            raise _runtime.peer_failure(error, where, time.monotonic() - start) from error
        if isinstance(error, (ValueError, TypeError, RankFailureError)):
            raise (error if failed == rank else _on_rank(error, failed)) from None
        what = (
            f"cannot write checkpoint {path}; the previous checkpoint, if any, is untouched"
            if writing
            else f"checkpoint {path} is corrupted or truncated"
        )
        first_line = (str(error).strip().splitlines() or [""])[0]
        cause = f"{type(error).__name__}: {first_line}"
        raise (RuntimeError if writing else ValueError)(f"{what} ({cause}{note})") from None


def _publish(
    path: str,
    name: str,
    files: dict[str, dict[str, Any]],
    world: int,
    machine: list,
    record: dict[str, Any],
) -> None:
    """Replace the manifest of ``path`` with one naming data directory ``name``; ``machine``
    is the link and compute figures this run chose its bucket caps from, for a resumed run;
    ``record``: the group's ranks and the fully sharded parameters' full trees."""
    body = {"format": _FORMAT, "version": _VERSION, "data": name, "world_size": world}
    body["files"] = dict(sorted(files.items()))
    body["machine"] = machine
    body.update(record)
    text = json.dumps({**body, "sha256": _digest(body)}, indent=1)

    def write(f: BinaryIO) -> None:
        f.write(text.encode())

    _replace_atomically(os.path.join(path, MANIFEST), write)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_manifest(path: str) -> dict[str, Any] | None:
    """The verified manifest of checkpoint ``path``, or None if it has none."""
    manifest = os.path.join(path, MANIFEST)
    try:
        with open(manifest, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    broken = f"checkpoint {path} is corrupted or truncated ({MANIFEST}"
    try:
        body = json.loads(raw)
    except ValueError:
        raise ValueError(f"{broken} is not JSON){_BROKEN_ADVICE}") from None
    if not (isinstance(body, dict) and body.get("format") == _FORMAT):
        raise ValueError(f"{manifest} is not the manifest of an fddp sharded checkpoint")
    if not isinstance(body.get("version"), int) or body["version"] > _VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {body.get('version')}, this fddp reads up "
            f"to {_VERSION}; upgrade fddp to load it."
        )
    if body.pop("sha256", None) != _digest(body):
        raise ValueError(f"{broken}: SHA-256 checksum mismatch){_BROKEN_ADVICE}")
    files = body.get("files")
    if not (
        isinstance(body.get("data"), str)
        and re.fullmatch(_DATA, body["data"])
        and isinstance(files, dict)
        and all(re.fullmatch(_FILE, f) for f in files)
    ):
        raise ValueError(f"{broken} does not name a data directory and its files)")
    return body


def _published(path: str) -> str | None:
    """The data directory the manifest of ``path`` names; None if none or unreadable."""
    try:
        manifest = _read_manifest(path)
    except (OSError, ValueError):
        return None
    return None if manifest is None else manifest["data"]


def _remove_unpublished(path: str, replaced: str | None = None) -> None:
    """Remove the data directories in ``path`` that the manifest does not name and no live
    save or load holds: those of killed saves, and ``replaced``, the one the last save
    replaced, which has no writer (so it goes where locks are missing too)."""

    def keep(name: str) -> bool:
        try:
            manifest = _read_manifest(path)
        except (OSError, ValueError):
            return True  # which one is published is unknown: keep them all
        return manifest is not None and manifest["data"] == name

    _remove_unlocked(path, _DATA, keep)
    if replaced is not None:
        _remove_unlocked(path, re.escape(replaced), keep, finished=True)


# DCP's metadata classes and the torch types they hold: all `.metadata` may name.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A global that ``.metadata`` names and :class:`_MetadataUnpickler` does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: the classes of ``_METADATA_GLOBALS`` and torch's dtypes,
    layouts and memory formats, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise _RefusedGlobal(f"{module}.{name}")


@dataclasses.dataclass
class _Source:
    """A checkpoint opened for reading: verified manifest (None for a plain DCP directory),
    DCP metadata, and the data directory, locked shared while the load reads it."""

    path: str
    data: str
    files: dict[str, dict[str, Any]] | None
    fd: int | None = None
    machine: Any = None  # the figures the saved run chose its bucket caps from
    manifest: dict[str, Any] | None = None  # verified (None for a plain DCP directory)
    metadata: Any = None
    verified: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def open(cls, path: str) -> _Source:
        if not os.path.isdir(path):
            if not os.path.exists(path):
                raise FileNotFoundError(
                    errno.ENOENT, "no sharded checkpoint: no such directory", path
                )
            raise ValueError(
                f"{path} is a file, not a sharded checkpoint (a directory written by "
                "fddp.save_sharded); a file written by fddp.save is read with fddp.load."
            )
        return cls._with_metadata(cls._locked(path))

    @classmethod
    def chosen(cls, path: str, manifest: dict[str, Any] | None) -> _Source:
        """The save that rank 0 opened, whose verified ``manifest`` it sent (None: a plain DCP
        directory), opened on this rank: it holds it locked, so it is there until all read."""
        source = None
        with contextlib.suppress(FileNotFoundError):
            source = cls(path, path, None) if manifest is None else cls._named(path, manifest)
        if source is None:
            assert manifest is not None
            seen = _published(path) or "none"
            raise ValueError(
                f"checkpoint {path}: rank 0 loads the save in {manifest['data']}, which this "
                f"rank cannot open (here {MANIFEST} names {seen}): it was removed meanwhile "
                "(by something that ignores the loading ranks' locks), or the path is not on "
                "one file system that every rank shares. Load it again, from a shared path."
            )
        return cls._with_metadata(source)

    @classmethod
    def _with_metadata(cls, source: _Source) -> _Source:
        try:
            source.metadata = source._read_metadata()
        except BaseException:
            source.close()
            raise
        return source

    @classmethod
    def _named(cls, path: str, manifest: dict[str, Any]) -> _Source | None:
        """The data directory ``manifest`` names, locked; None if it was replaced or a
        remover holds it. Raises FileNotFoundError if it is missing."""
        data = os.path.join(path, manifest["data"])
        fd = os.open(data, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            if _lock_shared(fd) and os.path.samestat(os.fstat(fd), os.stat(data)):
                files = manifest["files"]
                return cls(path, data, files, fd, manifest.get("machine"), manifest)
        os.close(fd)
        return None

    @classmethod
    def _locked(cls, path: str) -> _Source:
        """The data directory the manifest names, locked: a save that publishes another one
        meanwhile may remove it before this lock is taken, then read the manifest again."""
        gone = None
        for attempt in range(_OPEN_ATTEMPTS):
            time.sleep(0.01 * attempt)  # let a save that replaces it finish
            manifest = _read_manifest(path)
            if manifest is None:
                if not os.path.exists(os.path.join(path, _METADATA)):
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"no sharded checkpoint in this directory: it has no {MANIFEST} "
                        "(save_sharded writes it last, so a save that was interrupted before "
                        f"it completed leaves none) and no {_METADATA} of a plain "
                        "torch.distributed.checkpoint",
                        path,
                    )
                return cls(path, path, None)  # written by an older fddp
            try:
                source = cls._named(path, manifest)
            except FileNotFoundError:
                if gone == manifest["data"]:  # not a save replacing it: it is missing
                    raise ValueError(
                        f"checkpoint {path} is incomplete: its data directory "
                        f"{manifest['data']} is missing{_BROKEN_ADVICE}"
                    ) from None
                gone = manifest["data"]
                continue
            if source is not None:
                return source
        raise ValueError(
            f"checkpoint {path} was replaced {_OPEN_ATTEMPTS} times while this rank opened "
            "it (saves to it in quick succession); load it again."
        )

    @property
    def advice(self) -> str:
        if self.files is None:
            return (
                "; it was written by an older fddp, which did not save atomically: a save to it "
                "may have been interrupted"
            )
        return _BROKEN_ADVICE

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _read_metadata(self) -> Any:
        """DCP's metadata, checksum verified and unpickled through the allowlist."""
        with self._verified(_METADATA) as f:
            raw = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except _RefusedGlobal as e:
            raise ValueError(
                f"checkpoint {self.path}: its {_METADATA} names {e}, which "
                "is not one of torch.distributed.checkpoint's metadata classes; refusing to "
                "unpickle it (no code from a checkpoint runs)."
            ) from None
        except Exception as e:
            raise ValueError(
                f"checkpoint {self.path} is corrupted or truncated ({_METADATA} cannot be "
                f"unpickled: {type(e).__name__}: {e}){self.advice}"
            ) from None
        dcp = _dcp()
        storage = getattr(metadata, "storage_data", None)
        if not (
            isinstance(metadata, dcp.Metadata)
            and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(storage, dict)
            and all(isinstance(info, dcp.StorageInfo) for info in storage.values())
        ):
            raise ValueError(f"checkpoint {self.path}: {_METADATA} is not DCP's metadata")
        for info in storage.values():
            name = info.relative_path
            listed = name in self.files if self.files is not None else True
            if not (isinstance(name, str) and re.fullmatch(_FILE, name) and listed):
                raise ValueError(
                    f"checkpoint {self.path} is corrupted ({_METADATA} refers to file {name!r}, "
                    f"which is not a file of its data directory){self.advice}"
                )
        return metadata

    def _verified(self, name: str) -> BinaryIO:
        """File ``name`` of the data directory, open at its start, its size and checksum
        verified against the manifest (for a plain DCP directory, only its presence)."""
        file = os.path.join(self.data, name)
        broken = f"checkpoint {self.path} is corrupted or truncated"
        try:
            f = open(file, "rb")  # noqa: SIM115 (returned open)
        except FileNotFoundError:
            raise ValueError(f"{broken} ({file} is missing){self.advice}") from None
        if self.files is None or name in self.verified:
            return f
        with contextlib.ExitStack() as on_error:
            on_error.callback(f.close)
            expected = self.files.get(name)
            if expected is None:
                raise ValueError(f"{broken} ({MANIFEST} does not list {name}){self.advice}")
            size = os.fstat(f.fileno()).st_size
            if size != expected.get("bytes"):
                raise ValueError(
                    f"{broken} ({file}: {size} bytes, expected {expected.get('bytes')})"
                    f"{self.advice}"
                )
            if _sha256(f).hex() != expected.get("sha256"):
                raise ValueError(f"{broken} ({file}: SHA-256 checksum mismatch){self.advice}")
            f.seek(0)
            self.verified.add(name)
            on_error.pop_all()
        return f

    def verify(self, name: str) -> None:
        """Verify file ``name`` (once per load) and, in a plain DCP directory, that it holds
        every byte the metadata places in it."""
        with self._verified(name) as f:
            if self.files is None:
                size = os.fstat(f.fileno()).st_size
                end = max(
                    info.offset + info.length
                    for info in self.metadata.storage_data.values()
                    if info.relative_path == name
                )
                if size < end:
                    raise ValueError(
                        f"checkpoint {self.path} is corrupted or truncated ({f.name}: {size} "
                        f"bytes, the metadata places data up to byte {end}){self.advice}"
                    )

    def check(self, entries: list[tuple[str, Any, tuple[int, ...] | None]]) -> None:
        """Compare the saved keys, shapes and dtypes with ``like``'s, before reading any."""
        saved = self.metadata.state_dict_metadata
        _check_structure(
            self.path, [k for k, _, _ in entries], list(saved), "checkpoint", _LIKE_ADVICE
        )
        problems = []
        for key, leaf, piece in entries:
            meta = saved[key]
            if isinstance(meta, _dcp().TensorStorageMetadata):
                got: Any = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
            else:
                got = _NotATensor()
            want = leaf
            if piece is not None:  # a bucket is saved whole
                want = torch.empty(piece[3], dtype=leaf.dtype, device="meta")
            problems += _leaf_problems(key, got, want, "checkpoint")
        _check_leaves(self.path, problems, _LIKE_ADVICE)


class _DCP(NamedTuple):
    api: Any  # torch.distributed.checkpoint
    CheckpointException: Any
    Metadata: Any
    TensorStorageMetadata: Any
    StorageInfo: Any
    Writer: Any
    Reader: Any
    Planner: Any


@functools.cache
def _dcp() -> _DCP:
    """``torch.distributed.checkpoint`` and fddp's subclasses of its file writer and reader
    and load planner, made on first use: DCP pulls in torch.distributed.nn, which
    ``import fddp`` must not (see tests/_exit_script.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import (
        FileSystem,
        FileSystemReader,
        FileSystemWriter,
        _StorageInfo,
    )
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
    )
    from torch.futures import Future

    class HashingFileSystem(FileSystem):
        """DCP's file system, hashing every file written through it."""

        def __init__(self) -> None:
            super().__init__()
            self.writers: dict[str, _HashingWriter] = {}

        @contextlib.contextmanager
        def create_stream(
            self, path: str | os.PathLike, mode: str
        ) -> Generator[io.IOBase, None, None]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                writer = _HashingWriter(cast(BinaryIO, stream))
                self.writers[os.path.basename(path)] = writer
                yield cast(io.IOBase, writer)

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)
            self.writers[os.path.basename(new_path)] = self.writers.pop(os.path.basename(path))

    class Writer(FileSystemWriter):
        """DCP's file writer (one file per rank, fsynced), whose failed writes raise their
        ``OSError`` and which reports each file's size and SHA-256."""

        def __init__(self, path: str) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = self.hashing = HashingFileSystem()
            self.referenced: set[str] = set()  # the files the metadata names (rank 0)

        def write_data(self, plan: Any, planner: Any) -> Any:
            with _os_errors(self.hashing.writers.values()):
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            with _os_errors(self.hashing.writers.values()):
                super().finish(metadata, results)
            self.referenced = {info.relative_path for info in metadata.storage_data.values()}

        def files(self) -> dict[str, dict[str, Any]]:
            return {
                name: {"bytes": w.size, "sha256": w.sha256.hexdigest()}
                for name, w in self.hashing.writers.items()
            }

    class Reader(FileSystemReader):
        """DCP's file reader, with the metadata already read safely and every file verified
        before it is read."""

        def __init__(self, source: _Source) -> None:
            super().__init__(source.data)
            self.source = source

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = self.source.metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            """Read file by file, each verified first; what DCP cannot read names its file."""
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                name = self.storage_data[item.storage_index].relative_path
                per_file.setdefault(name, []).append(item)
            for name, items in sorted(per_file.items()):
                self.source.verify(name)
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except (OSError, ValueError):
                    raise
                except Exception as e:
                    reason = (
                        _unpickler_reason(e)
                        if isinstance(e, pickle.UnpicklingError)
                        else (str(e).strip().splitlines() or [""])[0]
                    )
                    raise ValueError(
                        f"checkpoint {self.source.path} is corrupted or truncated "
                        f"({os.path.join(self.path, name)} cannot be read: "
                        f"{type(e).__name__}: {reason}){self.source.advice}"
                    ) from None
            done: Future[None] = Future()
            done.set_result(None)
            return done

    class Planner(DefaultLoadPlanner):
        """DCP's load planner, reading non-tensor leaves with ``weights_only=True``."""

        def __init__(self, source: _Source) -> None:
            super().__init__()
            self.source = source
            self.values: dict[str, Any] = {}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            try:
                self.values[key] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise ValueError(
                    f"checkpoint {self.source.path}: leaf {key} holds objects other than plain "
                    "Python values; refusing to unpickle them (weights_only=True): "
                    f"{_unpickler_reason(e)}"
                ) from None

    return _DCP(
        dcp,
        CheckpointException,
        Metadata,
        TensorStorageMetadata,
        _StorageInfo,
        Writer,
        Reader,
        Planner,
    )


@contextlib.contextmanager
def _one_process_quietly(n: int) -> Iterator[None]:
    """In a world of one, without the warning that dcp assumes a single process."""
    with warnings.catch_warnings():
        if n == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rebuild(like: Any, values: Iterator[Any]) -> Any:
    """``like`` with its leaves taken from ``values`` in ``_entries`` order."""
    leaves, spec = optree.tree_flatten(like, is_leaf=_is_sharded)
    out = []
    for leaf in leaves:
        if not _is_sharded(leaf):
            out.append(next(values))
            continue
        if isinstance(leaf, ShardedParams):
            out.append(ShardedParams(tuple(next(values) for _ in leaf.shards), leaf.layout))
            continue
        inner_leaves, inner_spec = optree.tree_flatten(leaf.inner)
        inner = optree.tree_unflatten(inner_spec, [next(values) for _ in inner_leaves])
        out.append(leaf._replace(inner=inner))
    return optree.tree_unflatten(spec, out)
