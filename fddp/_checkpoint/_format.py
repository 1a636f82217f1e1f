"""The checkpoint file: a note for torch.load, a checksummed header, then torch.save's bytes."""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any, BinaryIO

import torch

from fddp._base import _files

__all__ = ["TORCH_LOAD_SAYS", "VERSION", "read", "unpickler_reason", "write"]

# What torch.load and pickle.load of a checkpoint file raise (a LookupError), for both
# weights_only=True and False: the file opens with a pickle program that calls
# _codecs.encode("", TORCH_LOAD_SAYS), one of the calls weights_only allows.
TORCH_LOAD_SAYS = (
    "fddp checkpoint (written by fddp.save, not torch.save): load it with "
    "fddp.load(path, like=...), or fddp.load(path) for a {leaf path: leaf} dict"
)


def _unicode(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


# The header: _MAGIC, the format version (the operand of a BININT, at bytes 8-11 as in version
# 1), the rest of the pickle program, then SHA-256 and length of torch.save's payload.
_MAGIC = pickle.SHORT_BINSTRING + b"\x04FDDP" + pickle.NONE + pickle.BININT
_NOTE = (
    pickle.GLOBAL
    + b"_codecs\nencode\n"
    + _unicode("")
    + _unicode(TORCH_LOAD_SAYS)
    + pickle.TUPLE2
    + pickle.REDUCE
    + pickle.STOP
)
VERSION = 2
_START = struct.Struct("<8sI")  # magic, format version
_END = struct.Struct("<32sQ")  # sha256(payload), len(payload)
_HEADER_SIZE = _START.size + len(_NOTE) + _END.size
_MAGIC_1 = b"FDDPCKPT"  # version 1: no note, the end of the header right after the start


def write(path: str, payload: dict[str, Any]) -> None:
    """Write the header and ``torch.save(payload)`` to ``path`` atomically."""

    def write(f: BinaryIO) -> None:
        f.write(bytes(_HEADER_SIZE))
        writer = _files.HashingWriter(f)
        with _files.os_errors([writer]):
            torch.save(payload, writer)  # it needs write and flush only
        f.seek(0)
        f.write(_START.pack(_MAGIC, VERSION) + _NOTE)
        f.write(_END.pack(writer.sha256.digest(), writer.size))

    _files.replace_atomically(path, write)


def read(path: str, map_location: str | torch.device) -> dict[str, Any]:
    """Verify the header and checksum of ``path``, then unpickle its payload safely."""
    broken = f"checkpoint {path} is corrupted or truncated"
    untouched = "; the previous checkpoint, if any, is untouched (saves replace files atomically)"
    with open(path, "rb") as f:
        start = f.read(_START.size)
        if start[:4] == b"PK\x03\x04":
            raise ValueError(
                f"{path} is not an fddp checkpoint but a plain torch.save file; load it with "
                "torch.load(path, weights_only=True) if you trust it."
            )
        magic = start[: len(_MAGIC)]
        note = f.read(len(_NOTE)) if magic == _MAGIC else _NOTE
        end = f.read(_END.size)
        if (
            len(start) < _START.size
            or magic not in (_MAGIC, _MAGIC_1)
            or note != _NOTE
            or len(end) < _END.size
        ):
            raise ValueError(f"{broken} (no fddp checkpoint header){untouched}")
        _, version = _START.unpack(start)
        if version > VERSION:
            raise ValueError(
                f"checkpoint {path} has format version {version}, this fddp reads up to "
                f"{VERSION}; upgrade fddp to load it."
            )
        digest, size = _END.unpack(end)
        offset = f.tell()
        actual = os.fstat(f.fileno()).st_size - offset
        if actual != size:
            raise ValueError(f"{broken} ({actual} payload bytes, expected {size}){untouched}")
        if _files.sha256(f) != digest:
            raise ValueError(f"{broken} (SHA-256 checksum mismatch){untouched}")
        f.seek(offset)
        try:
            payload = torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"checkpoint {path} holds objects other than tensors and plain Python values; "
                f"refusing to unpickle them (weights_only=True): {unpickler_reason(e)}"
            ) from None
    if not (isinstance(payload, dict) and payload.get("format") == "fddp.checkpoint"):
        raise ValueError(f"{path} is not an fddp checkpoint (unexpected payload)")
    return payload


def unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The one line of torch's weights_only error that names the refused object."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip()
        return reason.splitlines()[0].split(". ")[0].strip() if reason else "no reason given"
    return text.splitlines()[0] if text else type(error).__name__
