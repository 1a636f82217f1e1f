"""Checkpoints: atomic, checksummed `save` and pickle-free, structure-checked `load`."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from typing import Any, BinaryIO

import optree
import torch
import torch.distributed as dist

from fddp.typing import TensorTree

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

PathLike = str | os.PathLike[str]


def save(path: PathLike, tree: TensorTree, *, rank0_only: bool = True) -> None:
    """Write ``tree`` to ``path`` atomically.

    The tree is any optree pytree (None is an empty subtree) whose leaves are tensors or plain
    ``bool``/``int``/``float``/``str`` values, e.g. ``{"params": ..., "opt": ..., "step": 7}``.
    The file holds the leaves, their paths and a checksum; the structure comes back from the
    ``like`` tree given to :func:`load`. Tensors are saved on their own device and dtype.

    The bytes go to ``<path>.tmp-<pid>`` in the same directory, are flushed and fsynced, and
    replace ``path`` with one ``os.replace``: a crash or an error during the save leaves the
    previous checkpoint at ``path`` untouched and removes the temporary file.

    Under ``torch.distributed`` with more than one rank and ``rank0_only=True`` (replicated
    state), only rank 0 writes, and every rank returns only once the file is in place, so any
    rank may load it right after; an error on rank 0 is raised on every rank. With
    ``rank0_only=False`` every rank writes its own file (pass a different ``path`` per rank)
    and no rank waits for the others.

    Note:
        This writes one file from one process. For states too large for that (sharded
        parameters, hundreds of GiB), use ``torch.distributed.checkpoint`` directly:
        ``dcp.save(state_dict, checkpoint_id=dir)`` and ``dcp.load(state_dict, checkpoint_id=dir)``
        on a flat ``{path: tensor}`` dict, e.g. built with ``optree.tree_flatten_with_path``.

    Args:
        path: File to write; its directory must exist.
        tree: The pytree to save.
        rank0_only: Whether only rank 0 writes (state replicated on every rank).

    Raises:
        TypeError: If a leaf is neither a tensor nor a bool, int, float or str.

    Example:
        >>> import os, tempfile, torch
        >>> tree = {"w": torch.ones(2, 3), "step": 7}
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save(os.path.join(d, "ckpt.pt"), tree)
        ...     os.listdir(d)
        ['ckpt.pt']
    """
    path = os.fspath(path)
    paths, leaves, treespec = _flatten(tree)
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
    }
    distributed = rank0_only and dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_world_size() == 1:
        _write_atomic(path, payload)
        return

    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            _write_atomic(path, payload)
        except BaseException as e:  # reported to the other ranks, then re-raised
            error = e
    # The broadcast doubles as the barrier: no rank returns before rank 0 has finished.
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"rank 0 failed to save checkpoint {path}: {status[0]}")


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
        ValueError: If the file is corrupted, truncated, not an fddp checkpoint, holds
            objects other than tensors and plain values, or does not match ``like``; the
            message names the mismatching leaves.

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
    saved = dict(zip(payload["paths"], payload["leaves"]))

    missing = [p for p in like_paths if p not in saved]
    like_set = set(like_paths)
    extra = [p for p in payload["paths"] if p not in like_set]
    if missing or extra:
        raise ValueError(
            f"checkpoint {path} does not have the structure of `like`:\n"
            f"  leaves in `like` but not in the file: {_listing(missing)}\n"
            f"  leaves in the file but not in `like`: {_listing(extra)}\n"
            f"  saved structure: {_shorten(payload['structure'])}\n"
            "Build `like` the way the saved tree was built (same model config, same optimizer), "
            "or call load(path) without `like` to get the saved {path: leaf} dict and migrate it."
        )

    leaves = []
    problems = []
    for leaf_path, want in zip(like_paths, like_leaves):
        got = saved[leaf_path]
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                problems.append(f"{leaf_path}: {type(got).__name__} in the file, Tensor in like")
                continue
            if got.shape != want.shape:
                shapes = f"{tuple(got.shape)} in the file, {tuple(want.shape)} in like"
                problems.append(f"{leaf_path}: shape {shapes}")
            if got.dtype != want.dtype:
                problems.append(f"{leaf_path}: dtype {got.dtype} in the file, {want.dtype} in like")
            got = got.to(want.device)
        elif type(got) is not type(want):
            types = f"{type(got).__name__} in the file, {type(want).__name__} in like"
            problems.append(f"{leaf_path}: {types}")
        leaves.append(got)
    if problems:
        raise ValueError(
            f"checkpoint {path} does not match `like` ({len(problems)} mismatches):\n  "
            + _listing(problems, sep="\n  ")
            + "\nBuild `like` with the shapes and dtypes of the saved run (same model config and "
            "dtype), or call load(path) without `like` and convert the leaves yourself."
        )
    return optree.tree_unflatten(treespec, leaves)


def _flatten(tree: TensorTree) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into (readable leaf paths such as ``['opt'].mu['w']``, leaves, spec)."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") or "<root>" for accessor in accessors], leaves, treespec


def _listing(items: list[str], sep: str = ", ") -> str:
    if not items:
        return "none"
    more = len(items) - _MAX_LISTED
    return sep.join(items[:_MAX_LISTED]) + (f"{sep}... and {more} more" if more > 0 else "")


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 5] + " ..."


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += len(view)
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def _write_atomic(path: str, payload: dict[str, Any]) -> None:
    """Write header + ``torch.save(payload)`` to a temp file, fsync it, rename it onto ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(bytes(_HEADER.size))
            writer = _HashingWriter(f)
            torch.save(payload, writer)
            f.seek(0)
            f.write(_HEADER.pack(_MAGIC, _VERSION, writer.sha256.digest(), writer.size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if os.name == "posix":  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
        sha256 = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
        if sha256.digest() != digest:
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
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". ")[0].strip()
    return str(error).splitlines()[0] if str(error) else type(error).__name__
