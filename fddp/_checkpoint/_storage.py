"""DCP's file storage with fddp's file safety: hashed writes, verified reads, safe metadata."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import pickle
import warnings
from collections.abc import Generator, Iterator
from typing import Any, BinaryIO, NamedTuple, Protocol, cast

import torch

from fddp._base import _files
from fddp._base._errors import RankFailureError
from fddp._checkpoint import _format
from fddp._ranks import _agree, _runtime

__all__ = ["MetadataUnpickler", "RefusedGlobal", "Source", "dcp", "errors", "one_process_quietly"]


@contextlib.contextmanager
def errors(path: str, rank: int, *, writing: bool) -> Iterator[None]:
    """Raise the error of the lowest failing rank that ``torch.distributed.checkpoint`` (DCP)
    reports as a ``CheckpointException`` (a ``BaseException``, of multi-line tracebacks) as
    fddp's: an ``OSError`` keeps its errno, fddp's own errors are raised as they are, and a
    failure to hear from another rank as it is, for ``_runtime.peer_failures`` to translate."""
    try:
        yield
    except dcp().CheckpointException as e:
        failed, (error, _) = min(e.failures.items(), key=lambda item: item[0])
        if not isinstance(error, Exception):
            raise error from None  # KeyboardInterrupt and the like
        note = "" if failed == rank else f" (on rank {failed})"
        if isinstance(error, OSError) and error.errno is not None:
            if writing:
                raise _files.write_error(error, path, f" on rank {failed}") from None
            reason = f"cannot read checkpoint {path}: {error.strerror}{note}"
            raise OSError(error.errno, reason, error.filename or path) from None
        if isinstance(error, RuntimeError) and _runtime.is_peer_failure(error):
            raise error from None  # for the caller's _runtime.peer_failures to translate
        if isinstance(error, (ValueError, TypeError, RankFailureError)):
            raise (error if failed == rank else _agree.on_rank(error, failed)) from None
        what = (
            f"cannot write checkpoint {path}; the previous checkpoint, if any, is untouched"
            if writing
            else f"checkpoint {path} is corrupted or truncated"
        )
        first_line = (str(error).strip().splitlines() or [""])[0]
        cause = f"{type(error).__name__}: {first_line}"
        raise (RuntimeError if writing else ValueError)(f"{what} ({cause}{note})") from None


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


class Source(Protocol):
    """What the reader needs of a checkpoint opened for reading (``_source.Source``)."""

    path: str
    data: str  # the data directory
    metadata: Any  # DCP's, read safely

    @property
    def advice(self) -> str: ...

    def verify(self, name: str) -> None: ...


class RefusedGlobal(pickle.UnpicklingError):
    """A global that ``.metadata`` names and :class:`MetadataUnpickler` does not allow."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: the classes of ``_METADATA_GLOBALS`` and torch's dtypes,
    layouts and memory formats, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise RefusedGlobal(f"{module}.{name}")


class DCP(NamedTuple):
    api: Any  # torch.distributed.checkpoint
    CheckpointException: Any
    Metadata: Any
    TensorStorageMetadata: Any
    StorageInfo: Any
    Writer: Any
    Reader: Any
    Planner: Any


@functools.cache
def dcp() -> DCP:
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
            self.writers: dict[str, _files.HashingWriter] = {}

        @contextlib.contextmanager
        def create_stream(
            self, path: str | os.PathLike, mode: str
        ) -> Generator[io.IOBase, None, None]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                writer = _files.HashingWriter(cast(BinaryIO, stream))
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
            with _files.os_errors(self.hashing.writers.values()):
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            with _files.os_errors(self.hashing.writers.values()):
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

        def __init__(self, source: Source) -> None:
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
                        _format.unpickler_reason(e)
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

        def __init__(self, source: Source) -> None:
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
                    f"{_format.unpickler_reason(e)}"
                ) from None

    return DCP(
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
def one_process_quietly(n: int) -> Iterator[None]:
    """In a world of one, without the warning that dcp assumes a single process."""
    with warnings.catch_warnings():
        if n == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield
