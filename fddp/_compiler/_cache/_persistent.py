"""Compiled programs on disk, for a restarted process to run without capturing again."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import io
import os
import pickle
import platform
import secrets
import stat
import sys
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import optree
import torch
import torch.distributed as dist

from fddp._base import _files
from fddp._base._names import qualified_name
from fddp._compiler._cache import _store
from fddp._compiler._cache._fingerprint import (
    Fingerprint,
    Unfingerprintable,
    fddp_source_digest,
    fingerprint,
    locate,
)
from fddp._compiler._options import CompileOptions
from fddp._compiler._passes import _cost
from fddp._compiler._program import Compiled
from fddp._ranks import _machine, _runtime
from fddp._ranks._agree import Line
from fddp._ranks._digests import digests
from fddp._ranks._machine import Machine
from fddp._ranks._signature import Signature, TensorSpec

ENV = "FDDP_CACHE_DIR"
MAX_BYTES = 4 << 30
_UNSET = object()
_directory: Any = _UNSET
_max_bytes = MAX_BYTES
_said: set[str] = set()  # warnings already given
_KEY_BYTES = 32


def set_cache_dir(path: str | os.PathLike | None, *, max_bytes: int = MAX_BYTES) -> None:
    """Keep compiled programs in ``path`` for later processes (None: keep none).

    A restarted job with the same step code, model, argument signature, options, world size and
    versions loads its programs from there instead of capturing and scheduling the step again
    (the first call of a 32-layer transformer goes from seconds to a fraction of one). Off by
    default; the environment variable ``FDDP_CACHE_DIR`` turns it on for a whole job. The
    directory is created private to the user; one that others can write to (or below one they
    can) is not used. Beyond ``max_bytes`` (4 GiB by default) the programs least recently
    written or loaded are removed.

    The key covers what the step's code reaches through its closures, globals, defaults,
    attributes and imports, and the versions of the installed libraries among them; state the
    step reads elsewhere (a flag in another module, an environment variable the model reads) is
    not seen: clear the directory after changing such state.
    """
    global _directory, _max_bytes
    if max_bytes <= 0:
        raise ValueError(f"set_cache_dir: max_bytes must be positive, got {max_bytes}.")
    _directory = None if path is None else os.fspath(path)
    _max_bytes = max_bytes


def cache_dir() -> str | None:
    """The directory :func:`set_cache_dir` (or ``FDDP_CACHE_DIR``) named, None when off."""
    if _directory is _UNSET:
        return os.environ.get(ENV) or None
    return _directory


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a step's program on disk is kept under, beside the versions, the world and the
    donated arguments: the step (fingerprinted with everything it reaches), the call's
    signature and how the step was built (its options as the ranks compare them)."""

    step_fn: Any
    signature: Signature
    described: tuple[Line, ...]


@dataclasses.dataclass(frozen=True)
class Key:
    digest: str
    fingerprint: Fingerprint
    roots: tuple[Any, ...]
    directory: Path
    secret: bytes  # the directory's key for the files' authentication codes

    def profile_path(self) -> Path:
        return self.directory / f"{self.digest}.profile"

    def program_path(self, cap: int) -> Path:
        return self.directory / f"{self.digest}.cap{cap}.program"


def _warn_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, stacklevel=5)


def _refuse(directory: str | Path, why: str) -> None:
    _warn_once(
        f"fddp: not using the program cache {directory}: {why}; programs are run as they are "
        "read, so the cache must be the user's own. Compiling in memory."
    )


def _make_private(path: Path) -> None:
    """Create ``path`` and the directories missing above it, each private to the user."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank made it first
            directory.mkdir(mode=0o700)


def _unsafe(path: Path, own: bool = True) -> str | None:
    """Why another user could replace ``path`` or a directory above it, or None: each must be
    the user's (``path`` itself only the user's if ``own``, the others the user's or root's)
    and writable by nobody else unless sticky (like /tmp)."""
    user = os.getuid() if hasattr(os, "getuid") else None
    for i, directory in enumerate((path, *path.parents)):
        status = os.lstat(directory)
        if not stat.S_ISDIR(status.st_mode):
            return f"{directory} is not a directory"
        if user is not None and status.st_uid not in ((user,) if i == 0 and own else (user, 0)):
            return f"{directory} belongs to another user"
        if status.st_mode & 0o022 and not (i > 0 and status.st_mode & stat.S_ISVTX):
            return f"others can write to {directory} (chmod go-w, or choose another directory)"
    return None


def _usable(directory: str) -> Path | None:
    """``directory``, created private if missing; None (warned once) if it is not safe."""
    path = Path(directory).expanduser().absolute() / f"fddp-v{_store.FORMAT}"
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        why = _unsafe(existing.resolve(), own=existing == path)  # before creating below it
        if why is None:
            _make_private(path)
            path = path.resolve()  # what was checked is what is used: no link swapped later
            why = _unsafe(path)
    except OSError as e:
        why = f"it cannot be created ({e})"
    if why is not None:
        _refuse(directory, why)
        return None
    return path


def _signature_text(signature: Signature) -> list[str]:
    texts = [str(signature.tree)]
    for i, leaf in enumerate(signature.leaves):
        texts.append(leaf.portable(i) + (f" {leaf.device}" if type(leaf) is TensorSpec else ""))
    return texts


def key_for(
    identity: Identity, leaves: list[Any], donated: set[int], group: dist.ProcessGroup | None
) -> Key | None:
    """The cache key of compiling ``identity``'s step for its signature (``leaves``: the
    call's); None (warned once) when the cache is off, its directory or key file is not safe,
    or the step reaches what cannot be fingerprinted."""
    directory = cache_dir()
    if directory is None:
        return None
    path = _usable(directory)
    secret = None if path is None else _secret(path)
    if path is None or secret is None:
        return None
    roots = (identity.step_fn, tuple(x for x in leaves if not isinstance(x, torch.Tensor)))
    try:
        found = fingerprint(*roots)
    except Unfingerprintable as e:
        name = qualified_name(identity.step_fn, module=False)
        _warn_once(f"fddp: not keeping {name}'s program in the program cache: {e}.")
        return None
    world = _runtime.world_size(group)
    parts = [
        _store.FORMAT,
        fddp_source_digest(),
        torch.__version__,
        optree.__version__,
        sys.version,
        platform.machine(),
        found.digest,
        _signature_text(identity.signature),
        list(identity.described),
        sorted(donated),
        world,
        _runtime.rank(group),
        _group_text(group) if world > 1 else "",
    ]
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()
    return Key(digest, found, roots, path, secret)


def _group_text(group: dist.ProcessGroup | None) -> str:
    chosen = group or dist.group.WORLD
    return f"{dist.get_backend(chosen)} {getattr(chosen, 'group_name', '')}"


def _digest(t: torch.Tensor) -> list[int]:
    return [int(x) for x in digests([t])[0]]


def save(key: Key, compiled: Compiled) -> None:
    """Write ``compiled`` (after its first run) and its profile under ``key``; a program this
    format cannot write is left out, with a log line."""
    try:
        stored = _store.encode(compiled.program, compiled.captured)
    except _store.NotStorable as e:
        _runtime.log_rank0("data_parallel: not caching the program: %s", e)
        return
    located, tensors = {}, {}
    for name, tensor in stored.constants.items():
        path = key.fingerprint.tensors.get(id(tensor))
        if path is None:
            tensors[name] = tensor.detach().cpu()
        else:
            located[name] = (path, tuple(tensor.shape), str(tensor.dtype), _digest(tensor))
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    program = {
        "stored": dataclasses.replace(stored, constants={}),
        "tensors": buffer.getvalue(),
        "located": located,
    }
    profile = {"profile": compiled.program.profile, "cap": compiled.program.cap}
    try:
        program_data, profile_data = (pickle.dumps(p, protocol=4) for p in (program, profile))
    except Exception as e:  # an output tree of a class pickle cannot name, say
        _runtime.log_rank0("data_parallel: not caching the program: %s: %s", type(e).__name__, e)
        return
    program_path = key.program_path(compiled.program.cap)
    for file, data in ((program_path, program_data), (key.profile_path(), profile_data)):
        mac = hmac.new(key.secret, data, hashlib.sha256).digest()
        try:
            _write_atomically(file, mac + data)
        except OSError as e:
            _warn_once(
                f"fddp: could not write to the program cache {key.directory} ({e}); programs "
                "are compiled in memory until it can be written (free space, or make it "
                "writable)."
            )
            return
    try:
        _evict(key.directory, _max_bytes, keep=key.digest)
    except OSError as e:
        _warn_once(f"fddp: could not remove old programs from {key.directory} ({e}).")


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by this user only, with the checkpoints' durable
    atomic write (a temporary file, removed if anything fails, fsynced and renamed)."""

    def write(f: BinaryIO) -> None:
        f.write(data)
        f.flush()
        _touch(f.fileno())  # before the rename: no other process sees it used earlier

    _files.replace_atomically(str(path), write, prefix=".writing-", private=True, what=None)


def _touch(path: Path | str | int) -> None:
    """Mark ``path`` used now, by the precise clock (a write's time is the kernel's coarse one,
    so a program loaded just after another was written could seem used first)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _evict(directory: Path, limit: int, keep: str) -> None:
    """Remove the programs (with their profiles) least recently written or loaded until the
    directory's files take at most ``limit`` bytes; never the ones under ``keep``."""
    entries: dict[str, list[tuple[Path, os.stat_result]]] = {}
    for path in directory.iterdir():
        if path.name.startswith("."):  # the key, and other processes' files being written
            continue
        with contextlib.suppress(FileNotFoundError):  # another process evicted it
            entries.setdefault(path.name.partition(".")[0], []).append((path, path.stat()))
    total = sum(status.st_size for files in entries.values() for _, status in files)
    by_age = sorted(entries, key=lambda d: max(status.st_mtime_ns for _, status in entries[d]))
    for digest in by_age:
        if total <= limit:
            return
        if digest == keep:
            continue
        for path, status in entries[digest]:
            path.unlink(missing_ok=True)
            total -= status.st_size


def _secret(directory: Path) -> bytes | None:
    """This directory's key for the files' authentication codes, created on first use; None
    (warned once) when it cannot be made or is not safe: others could read it (and forge a
    program) or it is not a key this cache made."""
    path = directory / ".key"
    try:
        if not path.exists():
            secret = secrets.token_bytes(_KEY_BYTES)

            def write(f: BinaryIO) -> None:
                f.write(secret)

            with contextlib.suppress(FileExistsError):  # another process made it first
                _files.replace_atomically(
                    str(path), write, prefix=".writing-", private=True, exclusive=True, what=None
                )
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(f.fileno())
            secret = f.read(_KEY_BYTES + 1)
    except OSError as e:
        _refuse(directory, f"its key file {path} cannot be made or read ({e})")
        return None
    why = _unsafe_key(status, len(secret))
    if why is not None:
        _refuse(directory, f"its key file {path} {why}")
        return None
    return secret


def _unsafe_key(status: os.stat_result, size: int) -> str | None:
    if not stat.S_ISREG(status.st_mode):
        return "is not a plain file"
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        return "belongs to another user"
    if status.st_mode & 0o077:
        return "can be read or written by others (chmod 600 it, or delete it and the programs)"
    if size != _KEY_BYTES:
        return f"holds {size} bytes, not {_KEY_BYTES} (delete it and the programs)"
    return None


def _read(key: Key, path: Path) -> dict | None:
    """The payload at ``path`` if this cache wrote it and it is intact, else None."""
    try:
        if hasattr(os, "getuid") and path.stat().st_uid != os.getuid():
            return None
        raw = path.read_bytes()
    except OSError:  # gone (evicted), or unreadable: compiled afresh
        return None
    mac, data = raw[:32], raw[32:]
    expected = hmac.new(key.secret, data, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        _runtime.log_rank0("data_parallel: ignoring cache file %s: not written by this cache", path)
        return None
    try:
        payload = pickle.loads(data)
    except Exception as e:  # a class the program names is gone from the code
        _runtime.log_rank0("data_parallel: ignoring cache file %s: %s", path, e)
        return None
    return payload if isinstance(payload, dict) else None


def _profile(key: Key) -> tuple[_cost.Profile, int] | None:
    entry = _read(key, key.profile_path())
    if entry is None or not isinstance(entry.get("profile"), _cost.Profile):
        return None
    return entry["profile"], entry["cap"]


def agreed_cap(
    key: Key | None,
    options: CompileOptions,
    machine: Machine | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> int | None:
    """Where the cost model chooses the cap on several ranks (``machine`` measured), the cap
    every rank takes: the one rank 0 proposes from its persistent cache (:func:`proposal`), by
    a broadcast at each compile, whether or not a rank has the cache on; None where rank 0 has
    no cached program for the step."""
    if machine is None:
        return None
    proposed = -1
    if _runtime.rank(group) == 0:
        proposed = proposal(key, options, machine, _machine.restored(group, device))
    cap = torch.tensor([proposed], dtype=torch.int64, device=device)
    dist.broadcast(cap, group=group, group_src=0)
    return None if int(cap) < 0 else int(cap)


def proposal(key: Key | None, options: CompileOptions, machine: Machine, restored: bool) -> int:
    """The cap rank 0 proposes for every rank's programs, -1 for none: the cap of the programs
    cached under ``key``, so that noise in the measured link does not choose another one;
    with figures restored from a checkpoint, the cap they choose (as the saved run did)."""
    found = _profile(key) if key is not None else None
    if found is None:
        return -1
    profile, cached_cap = found
    return _cost.choose_cap(profile, options.cap, machine).cap if restored else cached_cap


def load(
    key: Key,
    options: CompileOptions,
    machine: Machine | None,
    device: torch.device,
    agreed_cap: int | None = None,
) -> Compiled | None:
    """The program stored under ``key`` for the ``agreed_cap`` (else the cap this run would
    choose), or None."""
    start = time.perf_counter()
    found = _profile(key)
    if found is None:
        return None
    profile, _ = found
    choice = _cost.choose_cap(profile, options.cap, machine, agreed_cap)
    payload = _read(key, key.program_path(choice.cap))
    if payload is None:
        return None
    for file in (key.profile_path(), key.program_path(choice.cap)):
        with contextlib.suppress(OSError):  # a read-only directory
            _touch(file)  # recently used: the last to be evicted
    constants = torch.load(io.BytesIO(payload["tensors"]), weights_only=True)
    constants = {name: t.to(device) for name, t in constants.items()}
    for name, (path, shape, dtype, digest) in payload["located"].items():
        tensor = _find(key.roots, path)
        if tensor is None or (tuple(tensor.shape), str(tensor.dtype)) != (tuple(shape), dtype):
            return None
        if _digest(tensor) != list(digest):
            return None  # a constant the step reads changed: its values are in the graph
        constants[name] = tensor
    stored = dataclasses.replace(payload["stored"], constants=constants)
    try:
        program, captured = _store.decode(stored, options.backend, profile)
    except _store.NotStorable as e:
        _runtime.log_rank0("data_parallel: ignoring a cached program: %s", e)
        return None
    plan = dataclasses.replace(
        program.schedule,
        bucket_cap=str(choice) if profile.reductions else "",
        capture_seconds=time.perf_counter() - start,
    )
    program = dataclasses.replace(program, schedule=plan)
    return Compiled(program, captured, None, from_cache=True)


def _find(roots: tuple[Any, ...], path: Any) -> torch.Tensor | None:
    try:
        found = locate(roots, tuple(tuple(step) for step in path))
    except LookupError:
        return None
    return found if isinstance(found, torch.Tensor) else None
