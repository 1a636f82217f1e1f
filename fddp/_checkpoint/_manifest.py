"""A sharded checkpoint's manifest: the published data directory, its files' sizes and SHA-256."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, BinaryIO

from fddp._base import _files

__all__ = ["MANIFEST", "publish", "published", "read", "remove_unpublished"]

# A checkpoint directory: the manifest names the one data directory that holds the checkpoint
# (a torch.distributed.checkpoint directory) and the size and SHA-256 of each of its files.
MANIFEST = "fddp-sharded.json"
_FORMAT = "fddp.sharded_checkpoint"
_VERSION = 1
DATA_PREFIX = "shards-"
_DATA = r"shards-[0-9a-f]+"
FILE = r"(?!\.\.?$)[^/\\]+"  # a file of the data directory: a plain name
BROKEN_ADVICE = (
    "; save_sharded publishes a checkpoint only after every rank has written and checksummed "
    "its files, so this one was damaged afterwards (disk, copy, edit): load an older one"
)


def publish(
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

    _files.replace_atomically(os.path.join(path, MANIFEST), write)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read(path: str) -> dict[str, Any] | None:
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
        raise ValueError(f"{broken} is not JSON){BROKEN_ADVICE}") from None
    if not (isinstance(body, dict) and body.get("format") == _FORMAT):
        raise ValueError(f"{manifest} is not the manifest of an fddp sharded checkpoint")
    if not isinstance(body.get("version"), int) or body["version"] > _VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {body.get('version')}, this fddp reads up "
            f"to {_VERSION}; upgrade fddp to load it."
        )
    if body.pop("sha256", None) != _digest(body):
        raise ValueError(f"{broken}: SHA-256 checksum mismatch){BROKEN_ADVICE}")
    files = body.get("files")
    if not (
        isinstance(body.get("data"), str)
        and re.fullmatch(_DATA, body["data"])
        and isinstance(files, dict)
        and all(re.fullmatch(FILE, f) for f in files)
    ):
        raise ValueError(f"{broken} does not name a data directory and its files)")
    return body


def published(path: str) -> str | None:
    """The data directory the manifest of ``path`` names; None if none or unreadable."""
    try:
        manifest = read(path)
    except (OSError, ValueError):
        return None
    return None if manifest is None else manifest["data"]


def remove_unpublished(path: str, replaced: str | None = None) -> None:
    """Remove the data directories in ``path`` that the manifest does not name and no live
    save or load holds: those of killed saves, and ``replaced``, the one the last save
    replaced, which has no writer (so it goes where locks are missing too)."""

    def keep(name: str) -> bool:
        try:
            manifest = read(path)
        except (OSError, ValueError):
            return True  # which one is published is unknown: keep them all
        return manifest is not None and manifest["data"] == name

    _files.remove_unlocked(path, _DATA, keep)
    if replaced is not None:
        _files.remove_unlocked(path, re.escape(replaced), keep, finished=True)
