"""A sharded checkpoint opened for reading: the save rank 0 chose, locked, verified file by file."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import re
import time
from typing import Any, BinaryIO

import torch

from fddp._base import _files
from fddp._checkpoint import _dcp, _like, _manifest, _storage

__all__ = ["METADATA", "Source", "parse_metadata"]

METADATA = ".metadata"
_OPEN_ATTEMPTS = 5


@dataclasses.dataclass
class Source:
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
    def open(cls, path: str) -> Source:
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
    def chosen(cls, path: str, manifest: dict[str, Any] | None) -> Source:
        """The save that rank 0 opened, whose verified ``manifest`` it sent (None: a plain DCP
        directory), opened on this rank: it holds it locked, so it is there until all read."""
        source = None
        with contextlib.suppress(FileNotFoundError):
            source = cls(path, path, None) if manifest is None else cls._named(path, manifest)
        if source is None:
            assert manifest is not None
            seen = _manifest.published(path) or "none"
            raise ValueError(
                f"checkpoint {path}: rank 0 loads the save in {manifest['data']}, which this "
                f"rank cannot open (here {_manifest.MANIFEST} names {seen}): it was removed "
                "meanwhile (by something that ignores the loading ranks' locks), or the path is "
                "not on one file system that every rank shares. Load it again, from a shared path."
            )
        return cls._with_metadata(source)

    @classmethod
    def _with_metadata(cls, source: Source) -> Source:
        try:
            source.metadata = source._read_metadata()
        except BaseException:
            source.close()
            raise
        return source

    @classmethod
    def _named(cls, path: str, manifest: dict[str, Any]) -> Source | None:
        """The data directory ``manifest`` names, locked; None if it was replaced or a
        remover holds it. Raises FileNotFoundError if it is missing."""
        data = os.path.join(path, manifest["data"])
        fd = os.open(data, os.O_RDONLY | _files.O_DIRECTORY | _files.O_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            if _files.lock_shared(fd) and os.path.samestat(os.fstat(fd), os.stat(data)):
                files = manifest["files"]
                return cls(path, data, files, fd, manifest.get("machine"), manifest)
        os.close(fd)
        return None

    @classmethod
    def _locked(cls, path: str) -> Source:
        """The data directory the manifest names, locked: a save that publishes another one
        meanwhile may remove it before this lock is taken, then read the manifest again."""
        gone = None
        for attempt in range(_OPEN_ATTEMPTS):
            time.sleep(0.01 * attempt)  # let a save that replaces it finish
            manifest = _manifest.read(path)
            if manifest is None:
                if not os.path.exists(os.path.join(path, METADATA)):
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"no sharded checkpoint in this directory: it has no {_manifest.MANIFEST} "
                        "(save_sharded writes it last, so a save that was interrupted before "
                        f"it completed leaves none) and no {METADATA} of a plain "
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
                        f"{manifest['data']} is missing{_manifest.BROKEN_ADVICE}"
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
        return _manifest.BROKEN_ADVICE

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _read_metadata(self) -> Any:
        """DCP's metadata, checksum verified and unpickled through the allowlist."""
        with self._verified(METADATA) as f:
            return parse_metadata(f.read(), self.path, self.files, self.advice)

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
                raise ValueError(
                    f"{broken} ({_manifest.MANIFEST} does not list {name}){self.advice}"
                )
            size = os.fstat(f.fileno()).st_size
            if size != expected.get("bytes"):
                raise ValueError(
                    f"{broken} ({file}: {size} bytes, expected {expected.get('bytes')})"
                    f"{self.advice}"
                )
            if _files.sha256(f).hex() != expected.get("sha256"):
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

    def check(self, entries: list[_dcp.Entry], like_advice: str) -> None:
        """Compare the saved keys, shapes and dtypes with ``like``'s, before reading any."""
        saved = self.metadata.state_dict_metadata
        _like.check_structure(
            self.path, [k for k, _, _ in entries], list(saved), "checkpoint", like_advice
        )
        problems = []
        for key, leaf, piece in entries:
            meta = saved[key]
            if isinstance(meta, _storage.dcp().TensorStorageMetadata):
                got: Any = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
            else:
                got = _like.NotATensor()
            want = leaf
            if piece is not None:  # a bucket is saved whole
                want = torch.empty(piece[3], dtype=leaf.dtype, device="meta")
            problems += _like.leaf_problems(key, got, want, "checkpoint")
        _like.check_leaves(self.path, problems, like_advice)


def parse_metadata(
    raw: bytes, path: str, files: dict[str, dict[str, Any]] | None, advice: str
) -> Any:
    """DCP's metadata from the bytes of checkpoint ``path``'s metadata file, unpickled through
    the allowlist; every file it places data in must be one of ``files`` (any name of the
    checkpoint's file pattern when ``files`` is None: a plain DCP directory)."""
    try:
        metadata = _storage.MetadataUnpickler(io.BytesIO(raw)).load()
    except _storage.RefusedGlobal as e:
        raise ValueError(
            f"checkpoint {path}: its {METADATA} names {e}, which is not one of "
            "torch.distributed.checkpoint's metadata classes; refusing to unpickle it (no code "
            "from a checkpoint runs)."
        ) from None
    except Exception as e:
        raise ValueError(
            f"checkpoint {path} is corrupted or truncated ({METADATA} cannot be unpickled: "
            f"{type(e).__name__}: {e}){advice}"
        ) from None
    dcp = _storage.dcp()
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, dcp.Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(storage, dict)
        and all(isinstance(info, dcp.StorageInfo) for info in storage.values())
    ):
        raise ValueError(f"checkpoint {path}: {METADATA} is not DCP's metadata")
    for info in storage.values():
        name = info.relative_path
        listed = name in files if files is not None else True
        if not (isinstance(name, str) and re.fullmatch(_manifest.FILE, name) and listed):
            raise ValueError(
                f"checkpoint {path} is corrupted ({METADATA} refers to file {name!r}, which is "
                f"not a file of its data directory){advice}"
            )
    return metadata
