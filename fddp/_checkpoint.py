"""Checkpoints: atomic, checksummed `save` and pickle-free, structure-checked `load`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar

import optree
import torch
import torch.distributed as dist

from fddp import _agree, _machine, _pending, _runtime
from fddp._errors import SaveArrivalError, UsageValueError
from fddp._sharded_params import ShardedParams
from fddp._types import TensorTree
from fddp._zero import ShardedState

try:
    import fcntl
except ImportError:  # Windows: no flock, so no removal of orphaned temporary files
    fcntl = None  # type: ignore[assignment]

__all__ = ["load", "save"]

# File layout: a fixed header, then the bytes `torch.save` wrote for the payload dict.
# The header carries the payload length (truncation) and its SHA-256 (corruption), which the
# zip container of `torch.save` does not check on read.
_MAGIC = b"FDDPCKPT"
_VERSION = 1
_HEADER = struct.Struct("<8sI32sQ")  # magic, format version, sha256(payload), len(payload)
_SCALARS = (bool, int, float, str)
_CHUNK = 1 << 20
_MAX_LISTED = 10
# How long rank 0 waits for the other ranks to enter a rank0_only save before it calls the save
# a mistake (`if rank == 0: fddp.save(...)`); independent of the, much longer, collective timeout.
_ARRIVAL_TIMEOUT_S = 10.0
# An unlocked temporary file (or directory) this young and still empty may be a writer's,
# created but not yet locked (see _remove_unlocked).
_FRESH_TEMP_S = 60.0
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

PathLike = str | os.PathLike[str]
T = TypeVar("T")

_saves = 0  # rank0_only saves this process has entered: each one's keys in the store
_saves_lock = threading.Lock()
_writing: set[str] = set()  # temporary files this process is writing now
_writing_lock = threading.Lock()


def save(path: PathLike, tree: TensorTree, *, rank0_only: bool = True) -> None:
    """Write ``tree`` to ``path`` atomically.

    The tree is any optree pytree (None is an empty subtree) whose leaves are tensors or plain
    ``bool``/``int``/``float``/``str`` values, e.g. ``{"params": ..., "opt": ..., "step": 7}``.
    The file holds the leaves, their paths and a checksum; the structure comes back from the
    ``like`` tree given to :func:`load`. Tensors are saved on their own device and dtype.

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
    paths, leaves, treespec = _flatten(_pending.finished(tree))
    for leaf_path, leaf in zip(paths, leaves):
        # Exact types: subclasses (IntEnum, numpy.float64) would not pass weights_only loading.
        if not (isinstance(leaf, torch.Tensor) or type(leaf) in _SCALARS):
            raise TypeError(
                f"cannot save leaf {leaf_path} of type {type(leaf).__name__}: checkpoint leaves "
                "must be tensors or plain bool/int/float/str values. Convert it (torch.as_tensor, "
                "int(), float(), str()) or keep it out of the saved tree."
            )
    payload = {
        "format": "fddp.checkpoint",
        "version": _VERSION,
        "structure": str(treespec),
        "paths": paths,
        "leaves": [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
        "machine": _machine.recorded(),  # a resumed run's bucket caps are this run's
    }
    if _holds_sharded(tree):
        payload["per_rank"] = {"rank": _rank(), "world_size": _world_size()}
    distributed = rank0_only and dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_world_size() == 1:
        _write_atomic(path, payload)
        return
    _refuse_sharded_state(tree)
    with _saves_lock:  # one save at a time, so that every rank numbers them alike
        global _saves
        number, _saves = _saves, _saves + 1
        _save_from_rank0(path, payload, number, tree, _replica_lines(tree, paths, leaves))


def _save_from_rank0(
    path: str, payload: dict[str, Any], number: int, tree: TensorTree, lines: list[_agree.Line]
) -> None:
    """The ``rank0_only`` save number ``number`` of this process, on every rank; ``lines``
    describe what must be the same on every rank (see :func:`_replica_lines`)."""
    start = time.monotonic()
    _peer_checked(_check_arrival, path, number, start=start)
    # Every rank is in this save: a group that already failed (a peer died or timed out
    # earlier) fails here at once, before rank 0 replaces the file.
    _peer_checked(dist.barrier, start=start)
    if dist.get_rank() == 0:  # every rank has read the verdict of _check_arrival
        _peer_checked(_forget, number, start=start)
    difference = _peer_checked(_agree.find_difference, lines, start=start)
    if difference is not None:
        raise _per_rank_values_error(path, tree, difference)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            _write_atomic(path, payload)
        except BaseException as e:  # reported to the other ranks, then re-raised
            error = e
    # The broadcast doubles as the barrier: no rank returns before rank 0 has finished.
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    _peer_checked(dist.broadcast_object_list, status, src=0, start=start)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"rank 0 failed to save checkpoint {path}: {status[0]}")


def _peer_checked(
    fn: Callable[..., T], *args: Any, start: float, where: str = "fddp.save", **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)``, a collective or store operation of ``where``, with a failure
    to hear from another rank raised as :class:`RankFailureError`."""
    with _runtime.peer_failures(where, start):
        return fn(*args, **kwargs)


def _check_arrival(path: str, number: int) -> None:
    """Make sure every rank has entered this save, through the process group's store.

    Each rank other than 0 sets a key and waits (up to the store's timeout: rank 0 may come
    late, e.g. after evaluating alone) for rank 0's verdict. Rank 0 waits only
    ``_ARRIVAL_TIMEOUT_S`` for those keys: a rank missing then most likely skipped ``save``
    (``if rank == 0: fddp.save(...)``) and is blocked in its next collective, where waiting
    the full collective timeout would only end in misleading errors on both ranks. No
    collective is started before every rank is known to be here, so a rank that gives up
    leaves the group usable. Without a store (a group made without one), nothing is checked.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"fddp/save/{number}/"
    arrived = [f"{prefix}arrived/{r}" for r in range(1, world)]
    if rank != 0:
        store.set(arrived[rank - 1], "1")
        store.wait([f"{prefix}verdict"], store.timeout)  # type: ignore[attr-defined]
        verdict = store.get(f"{prefix}verdict").decode()
        if verdict != "go":
            raise SaveArrivalError(
                f"fddp.save({path!r}) on rank {rank}: rank 0 stopped waiting before this rank "
                f"came: {verdict}"
            )
        return
    timeout = store.timeout  # type: ignore[attr-defined]  # a property torch's stub lacks
    wait_s = min(_ARRIVAL_TIMEOUT_S, timeout.total_seconds())
    deadline, pause = time.monotonic() + wait_s, 0.001
    # Polled: a store.wait that times out logs socket warnings from C++.
    while not store.check(arrived) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    missing = [r for r, key in enumerate(arrived, start=1) if not store.check([key])]
    if missing:
        ranks = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        message = (
            f"{ranks} did not call fddp.save within {wait_s:g} s of rank 0. With "
            "rank0_only=True (the default) every rank calls fddp.save with the same arguments: "
            "rank 0 writes the file and the others wait until it is in place. Call it on every "
            "rank, not under `if rank == 0:`; to write from one rank alone pass "
            f"rank0_only=False. (If {ranks} did call fddp.save, it came later or has died or "
            "hung: see its own log.) Nothing was written."
        )
        store.set(f"{prefix}verdict", message)
        raise SaveArrivalError(f"fddp.save({path!r}) on rank 0: {message}")
    store.set(f"{prefix}verdict", "go")
    for key in arrived:
        store.delete_key(key)


def _forget(number: int) -> None:
    """Delete the last key of save ``number`` from the store, once every rank has read it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    store.delete_key(f"fddp/save/{number}/verdict")


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
            returns the file's content as a flat ``{leaf path: leaf}`` dict, to inspect or
            migrate an old checkpoint.

    Returns:
        A new tree with the structure of ``like`` holding the saved leaves.

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
        payload = _read(path, map_location="cpu")
        return dict(zip(payload["paths"], payload["leaves"]))

    like_paths, like_leaves, treespec = _flatten(like)
    devices = {leaf.device for leaf in like_leaves if isinstance(leaf, torch.Tensor)}
    payload = _read(path, map_location=devices.pop() if len(devices) == 1 else "cpu")
    _check_owner(path, payload.get("per_rank"))
    _machine.restore(payload.get("machine"))
    saved = dict(zip(payload["paths"], payload["leaves"]))
    _check_structure(
        path,
        like_paths,
        payload["paths"],
        "file",
        f"  saved structure: {_shorten(payload['structure'])}\n"
        "Build `like` the way the saved tree was built (same model config, same optimizer), "
        "or call load(path) without `like` to get the saved {path: leaf} dict and migrate it.",
    )
    leaves = []
    problems = []
    for leaf_path, want in zip(like_paths, like_leaves):
        got = saved[leaf_path]
        problems += _leaf_problems(leaf_path, got, want, "file")
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            got = got.to(want.device)
        leaves.append(got)
    _check_leaves(
        path,
        problems,
        "Build `like` with the shapes and dtypes of the saved run (same model config and "
        "dtype), or call load(path) without `like` and convert the leaves yourself.",
    )
    return optree.tree_unflatten(treespec, leaves)


def _flatten(tree: TensorTree) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into (readable leaf paths such as ``['opt'].mu['w']``, leaves, spec)."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") or "<root>" for accessor in accessors], leaves, treespec


def _check_structure(
    path: str, like_paths: list[str], saved_paths: list[str], source: str, advice: str
) -> None:
    """Raise ValueError naming the leaves of ``like`` that were not saved, and the reverse."""
    saved = set(saved_paths)
    missing = [p for p in like_paths if p not in saved]
    like_set = set(like_paths)
    extra = [p for p in saved_paths if p not in like_set]
    if missing or extra:
        raise UsageValueError(
            f"checkpoint {path} does not have the structure of `like`:\n"
            f"  leaves in `like` but not in the {source}: {_listing(missing)}\n"
            f"  leaves in the {source} but not in `like`: {_listing(extra)}\n{advice}"
        )


class _NotATensor:
    """Stands for a saved leaf known not to be a tensor, whose value has not been read yet."""


def _leaf_problems(leaf_path: str, got: Any, want: Any, source: str) -> list[str]:
    """How the saved leaf ``got`` differs from ``like``'s ``want``: kind, shape, dtype, type."""
    name = "non-tensor" if isinstance(got, _NotATensor) else type(got).__name__
    if not isinstance(want, torch.Tensor):
        if isinstance(got, _NotATensor) or type(got) is type(want):
            return []
        return [f"{leaf_path}: {name} in the {source}, {type(want).__name__} in like"]
    if not isinstance(got, torch.Tensor):
        return [f"{leaf_path}: {name} in the {source}, Tensor in like"]
    problems = []
    if got.shape != want.shape:
        shapes = f"{tuple(got.shape)} in the {source}, {tuple(want.shape)} in like"
        problems.append(f"{leaf_path}: shape {shapes}")
    if got.dtype != want.dtype:
        problems.append(f"{leaf_path}: dtype {got.dtype} in the {source}, {want.dtype} in like")
    return problems


def _check_leaves(path: str, problems: list[str], advice: str) -> None:
    if problems:
        raise UsageValueError(
            f"checkpoint {path} does not match `like` ({len(problems)} mismatches):\n  "
            + _listing(problems, sep="\n  ")
            + f"\n{advice}"
        )


# A method that returns True: a tree holding an instance of the class holds values saved beside
# it that differ per rank (fddp.LowCommState: the inner parameters between synchronizations).
_PER_RANK_MARK = "saved_with_per_rank_values"


def _marked(x: Any) -> bool:
    mark = getattr(x, _PER_RANK_MARK, None)
    return callable(mark) and mark() is True


def _replica_lines(tree: TensorTree, paths: list[str], leaves: list[Any]) -> list[_agree.Line]:
    """What a ``rank0_only`` save compares across ranks: whether the tree holds a marked state
    (see ``_PER_RANK_MARK``) and, if it does, a digest of every leaf's value."""
    found, _ = _found(tree, _marked)
    lines: list[_agree.Line] = [("a state with per-rank values beside it", found or "none")]
    if found:
        lines += [(f"leaf {p}", _value_digest(x)) for p, x in zip(paths, leaves)]
    return lines


def _found(tree: TensorTree, kind: Callable[[Any], bool]) -> tuple[str, Any]:
    """The path and value of the first node of ``tree`` that is of ``kind`` (``""``: none)."""
    accessors, nodes, _ = optree.tree_flatten_with_accessor(tree, is_leaf=kind)
    for accessor, node in zip(accessors, nodes):
        if kind(node):
            return f"{accessor.codify('') or '<root>'} ({type(node).__name__})", node
    return "", None


def _value_digest(leaf: Any) -> str:
    if not isinstance(leaf, torch.Tensor):
        return f"{type(leaf).__name__} {leaf!r}"
    raw = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
    return f"a {leaf.dtype} tensor of shape {tuple(leaf.shape)} and digest {digest}"


def _per_rank_values_error(path: str, tree: TensorTree, difference: _agree.Difference) -> Exception:
    found, _ = _found(tree, _marked)
    return UsageValueError(
        f"fddp.save({path!r}): {difference}. The tree holds {found}, beside which values are "
        "per-rank (a low-communication step's inner parameters and optimizer state between "
        "synchronizations), and rank0_only=True (the default) would write rank 0's values "
        "only, which every rank would then load. Save each rank's own file: "
        'fddp.save(f"ckpt-{fddp.rank()}", tree, rank0_only=False), each rank loading its own; '
        "or save only what is the same on every rank (the LowCommState: its params are the "
        "last synchronized ones), e.g. right after a synchronization (without fragments, when "
        "int(state.step) % step.every == 0). Nothing was written."
    )


def _holds_sharded(tree: TensorTree) -> bool:
    return bool(_found(tree, lambda x: isinstance(x, (ShardedState, ShardedParams)))[0])


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
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=lambda x: isinstance(x, (ShardedState, ShardedParams))
    )
    for accessor, leaf in zip(accessors, leaves):
        if isinstance(leaf, (ShardedState, ShardedParams)):
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


def _listing(items: list[str], sep: str = ", ") -> str:
    if not items:
        return "none"
    more = len(items) - _MAX_LISTED
    return sep.join(items[:_MAX_LISTED]) + (f"{sep}... and {more} more" if more > 0 else "")


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 5] + " ..."


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through; anything else
    (``tell``, ``fileno``, ``close``) goes to the file.

    ``torch.save`` turns an exception raised by ``write`` into its own ``RuntimeError``
    ("unexpected pos ..."), so the first ``OSError`` is kept in ``error``: see :func:`_os_errors`.
    """

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += len(view)
        try:
            return self.file.write(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


@contextlib.contextmanager
def _os_errors(writers: Iterable[_HashingWriter]) -> Iterator[None]:
    """Raise the first ``OSError`` the writers met instead of what ``torch.save`` made of it."""
    try:
        yield
    except RuntimeError:
        error = next((w.error for w in writers if w.error is not None), None)
        if error is None:
            raise
        raise error from None
    error = next((w.error for w in writers if w.error is not None), None)
    if error is not None:
        raise error


def _write_atomic(path: str, payload: dict[str, Any]) -> None:
    """Write header + ``torch.save(payload)`` to ``path`` with :func:`_replace_atomically`."""

    def write(f: BinaryIO) -> None:
        f.write(bytes(_HEADER.size))
        writer = _HashingWriter(f)
        with _os_errors([writer]):
            torch.save(payload, writer)  # it needs write and flush only
        f.seek(0)
        f.write(_HEADER.pack(_MAGIC, _VERSION, writer.sha256.digest(), writer.size))

    _replace_atomically(path, write)


def _replace_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a new temp file, fsync it and rename it onto ``path``.

    Raises:
        OSError: Of the failed write (ENOSPC, EDQUOT, EFBIG, EACCES...), naming ``path``; the
            temp file is removed and ``path`` untouched.
    """
    _remove_orphans(path)
    tmp = None
    try:
        tmp, fd = _create_temp(f"{os.path.abspath(path)}.tmp-")
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            # Renamed while still open, so still locked: no other save takes it for an orphan.
            os.replace(tmp, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))  # the rename itself
    except BaseException as e:
        if tmp is not None:
            _remove_quietly(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise _write_error(e, path) from e
        raise
    finally:
        if tmp is not None:
            with _writing_lock:
                _writing.discard(tmp)


def _write_error(error: OSError, path: str, where: str = "") -> OSError:
    """The ``OSError`` a failed save raises: ``error``'s errno, ``path``, and what is left."""
    reason = f"{error.strerror or error}{where}; the previous checkpoint, if any, is untouched"
    return OSError(error.errno, f"cannot write checkpoint: {reason}", path)


def _fsync_directory(directory: str) -> None:
    """Make the names created or renamed in ``directory`` durable (a no-op off POSIX)."""
    if os.name == "posix":
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _create_temp(prefix: str, *, directory: bool = False) -> tuple[str, int]:
    """Create and lock a new file (or directory) ``<prefix><random>``; return its name and fd.

    A unique name per save (not per process: threads share a pid, and so do processes in other
    PID namespaces) lets saves to one path run at once. It is created with mode 0o666 (0o777
    for a directory) less the umask, like any new file, so the checkpoint gets the usual
    permissions. The exclusive ``flock`` on it, held until the fd is closed, tells
    :func:`_remove_unlocked` that its writer is alive.
    """
    while True:
        tmp = prefix + secrets.token_hex(8)
        with _writing_lock:
            _writing.add(tmp)
        try:
            if directory:
                os.mkdir(tmp)
                fd = os.open(tmp, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC)
        except FileExistsError:
            with _writing_lock:
                _writing.discard(tmp)
            continue
        except BaseException:
            with _writing_lock:
                _writing.discard(tmp)
            raise
        if fcntl is not None:
            # Where locks are refused, other saves cannot take them either, nor this file.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, fd


def _remove_orphans(path: str) -> None:
    """Remove the temporary files of ``path`` left by saves that were killed (SIGKILL, OOM)."""
    directory, base = os.path.split(os.path.abspath(path))
    _remove_unlocked(directory, re.escape(base) + r"\.tmp-[0-9A-Za-z]+")


def _remove_unlocked(
    directory: str,
    pattern: str,
    keep: Callable[[str], bool] | None = None,
    *,
    finished: bool = False,
) -> None:
    """Remove the files and directories in ``directory`` named like ``pattern`` whose writer
    is gone (killed by SIGKILL or the OOM killer), unless ``keep(name)``.

    A writer holds an exclusive ``flock`` on its entry from creation until it has renamed or
    published and closed it (:func:`_create_temp`), and the lock dies with the process; a
    reader may hold a shared one. So an entry whose lock this process can take has no live
    writer or reader in any other process; ``_writing`` rules out the writers of this process
    (``flock`` does too, except on file systems that emulate it with per-process POSIX locks,
    e.g. NFS). ``keep`` is asked before and again with the lock held, when no writer can
    publish the entry any more. The one gap, an entry created but not yet locked, is empty: an
    empty entry younger than ``_FRESH_TEMP_S`` is left for a later save. Where ``flock`` is
    missing or refused, nothing is removed, unless ``finished`` says that the entries have no
    writer any more (a replaced checkpoint's data); symbolic links are never followed into.
    """
    if fcntl is None and not finished:
        return
    try:
        names = [n for n in os.listdir(directory) if re.fullmatch(pattern, n)]
    except OSError:
        return
    for name in names:
        entry = os.path.join(directory, name)
        with _writing_lock:
            if entry in _writing or (keep is not None and keep(name)):
                continue
        try:
            is_dir = stat.S_ISDIR(os.lstat(entry).st_mode)
            # Writable: NFS emulates flock with POSIX locks, and an exclusive one needs it.
            mode = os.O_RDONLY | _O_DIRECTORY if is_dir else os.O_RDWR
            fd = os.open(entry, mode | _O_CLOEXEC)
        except OSError:
            continue  # renamed or removed meanwhile, or not ours to open
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer or reader holds it
                except OSError:
                    if not finished:
                        continue  # no locks here: a live writer cannot be told apart
            info = os.fstat(fd)
            empty = not os.listdir(entry) if is_dir else info.st_size == 0
            if empty and time.time() - info.st_mtime < _FRESH_TEMP_S:
                continue
            if not os.path.samestat(info, os.stat(entry)) or (keep is not None and keep(name)):
                continue
            if is_dir:
                shutil.rmtree(entry)
            else:
                os.remove(entry)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        finally:
            os.close(fd)


def _lock_shared(fd: int) -> bool:
    """Take a shared ``flock`` on ``fd`` (a reader's: no :func:`_remove_unlocked` removes the
    entry meanwhile); False if a remover holds it now. Where locks are missing, True."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass  # no locks on this file system
    return True


def _remove_quietly(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(name)


def _sha256(f: BinaryIO) -> bytes:
    """SHA-256 of the rest of ``f``, read in chunks."""
    sha256 = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        sha256.update(chunk)
    return sha256.digest()


def _read(path: str, map_location: str | torch.device) -> dict[str, Any]:
    """Verify the header and checksum of ``path``, then unpickle its payload safely."""
    broken = f"checkpoint {path} is corrupted or truncated"
    untouched = "; the previous checkpoint, if any, is untouched (saves replace files atomically)"
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
        if header[:4] == b"PK\x03\x04":
            raise ValueError(
                f"{path} is not an fddp checkpoint but a plain torch.save file; load it with "
                "torch.load(path, weights_only=True) if you trust it."
            )
        if len(header) < _HEADER.size or not header.startswith(_MAGIC):
            raise ValueError(f"{broken} (no fddp checkpoint header){untouched}")
        _, version, digest, size = _HEADER.unpack(header)
        if version > _VERSION:
            raise ValueError(
                f"checkpoint {path} has format version {version}, this fddp reads up to "
                f"{_VERSION}; upgrade fddp to load it."
            )
        actual = os.fstat(f.fileno()).st_size - _HEADER.size
        if actual != size:
            raise ValueError(f"{broken} ({actual} payload bytes, expected {size}){untouched}")
        if _sha256(f) != digest:
            raise ValueError(f"{broken} (SHA-256 checksum mismatch){untouched}")
        f.seek(_HEADER.size)
        try:
            payload = torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"checkpoint {path} holds objects other than tensors and plain Python values; "
                f"refusing to unpickle them (weights_only=True): {_unpickler_reason(e)}"
            ) from None
    if not (isinstance(payload, dict) and payload.get("format") == "fddp.checkpoint"):
        raise ValueError(f"{path} is not an fddp checkpoint (unexpected payload)")
    return payload


def _unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The one line of torch's weights_only error that names the refused object."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip()
        return reason.splitlines()[0].split(". ")[0].strip() if reason else "no reason given"
    return text.splitlines()[0] if text else type(error).__name__
