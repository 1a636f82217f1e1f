"""Durable atomic writes: a locked temporary file, hashed, fsynced and renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # Windows: no flock, so no removal of orphaned temporary files
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "HashingWriter",
    "create_temp",
    "done",
    "fsync_directory",
    "lock_shared",
    "os_errors",
    "remove_unlocked",
    "replace_atomically",
    "sha256",
    "write_error",
]

# An unlocked temporary file (or directory) this young and still empty may be a writer's,
# created but not yet locked (see remove_unlocked).
FRESH_TEMP_S = 60.0
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CHUNK = 1 << 20
_RANDOM = r"[0-9A-Za-z_]+"  # the random part of a temporary name (ours and tempfile's)

_writing: set[str] = set()  # temporary files this process is writing now
_writing_lock = threading.Lock()


class HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through; anything else
    (``tell``, ``fileno``, ``close``) goes to the file.

    ``torch.save`` turns an exception raised by ``write`` into its own ``RuntimeError``
    ("unexpected pos ..."), so the first ``OSError`` is kept in ``error``: see :func:`os_errors`.
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
def os_errors(writers: Iterable[HashingWriter]) -> Iterator[None]:
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


def replace_atomically(
    path: str,
    write: Callable[[BinaryIO], None],
    *,
    prefix: str | None = None,
    private: bool = False,
    exclusive: bool = False,
    what: str | None = "checkpoint",
) -> None:
    """Call ``write`` on a new temporary file beside ``path``, fsync it and rename it onto
    ``path``, then fsync the directory: ``path`` holds the old bytes or all the new ones.

    The temporary file is ``<prefix><random>`` (default prefix ``<path>.tmp-``); temporary
    files of that prefix left by killed writers are removed first. ``private``: the file is
    readable by its owner only (``tempfile.mkstemp``), else it gets the usual permissions
    (0o666 less the umask). ``exclusive``: link instead of rename, so that a file already at
    ``path`` stays and ``FileExistsError`` is raised.

    Raises:
        OSError: Of the failed write (ENOSPC, EDQUOT, EFBIG, EACCES...), with its errno,
            naming ``path`` and ``what`` it holds (None: the error as the system raised it);
            the temporary file is removed and ``path`` untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = os.path.join(directory, prefix or f"{os.path.basename(path)}.tmp-")
    remove_unlocked(directory, re.escape(os.path.basename(prefix)) + _RANDOM)
    tmp, published = None, False
    try:
        tmp, f = _open_temp(prefix, private)
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            # Renamed while still open, so still locked: no other writer takes it for an orphan.
            if exclusive:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
            published = True
        if exclusive:
            os.remove(tmp)
        fsync_directory(directory)  # the rename itself
    except BaseException as e:
        if tmp is not None and (exclusive or not published):  # a link's source goes too
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if (
            isinstance(e, OSError)
            and not isinstance(e, FileExistsError)
            and e.errno is not None
            and what is not None
        ):
            raise write_error(e, path, what=what) from e
        raise
    finally:
        if tmp is not None:
            done(tmp)


def _open_temp(prefix: str, private: bool) -> tuple[str, BinaryIO]:
    """A new temporary file ``<prefix><random>``, locked (see :func:`create_temp`), open to
    write."""
    if not private:
        tmp, fd = create_temp(prefix)
        return tmp, open(fd, "wb")  # the caller closes it
    directory, base = os.path.split(prefix)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=base)
    with _writing_lock:
        _writing.add(tmp)
    _lock(fd)
    return tmp, os.fdopen(fd, "wb")


def write_error(error: OSError, path: str, where: str = "", what: str = "checkpoint") -> OSError:
    """The ``OSError`` a failed write raises: ``error``'s errno, ``path``, and what is left."""
    reason = f"{error.strerror or error}{where}; the previous {what}, if any, is untouched"
    return OSError(error.errno, f"cannot write {what}: {reason}", path)


def fsync_directory(directory: str) -> None:
    """Make the names created or renamed in ``directory`` durable (a no-op off POSIX)."""
    if os.name == "posix":
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def create_temp(prefix: str, *, directory: bool = False) -> tuple[str, int]:
    """Create and lock a new file (or directory) ``<prefix><random>``; return its name and fd.

    A unique name per write (not per process: threads share a pid, and so do processes in
    other PID namespaces) lets writes to one path run at once. It is created with mode 0o666
    (0o777 for a directory) less the umask, like any new file. The exclusive ``flock`` on it,
    held until the fd is closed, tells :func:`remove_unlocked` that its writer is alive; the
    caller removes the name from ``_writing`` with :func:`done` once it is published or gone.
    """
    while True:
        tmp = prefix + secrets.token_hex(8)
        with _writing_lock:
            _writing.add(tmp)
        try:
            if directory:
                os.mkdir(tmp)
                fd = os.open(tmp, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o666)
        except FileExistsError:
            done(tmp)
            continue
        except BaseException:
            done(tmp)
            raise
        _lock(fd)
        return tmp, fd


def done(tmp: str) -> None:
    """Forget temporary entry ``tmp``, published or removed: :func:`remove_unlocked` may take
    an entry of that name for an orphan again."""
    with _writing_lock:
        _writing.discard(tmp)


def _lock(fd: int) -> None:
    """Lock a new entry, waiting while a remover holds it: it takes an empty new entry for a
    writer's, so it lets go at once without removing it."""
    if fcntl is not None:
        # Where locks are refused, other writers cannot take them either, nor this file.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)


def remove_unlocked(
    directory: str,
    pattern: str,
    keep: Callable[[str], bool] | None = None,
    *,
    finished: bool = False,
) -> None:
    """Remove the files and directories in ``directory`` named like ``pattern`` whose writer
    is gone (killed by SIGKILL or the OOM killer), unless ``keep(name)``.

    A writer holds an exclusive ``flock`` on its entry from creation until it has renamed or
    published and closed it (:func:`create_temp`), and the lock dies with the process; a
    reader may hold a shared one. So an entry whose lock this process can take has no live
    writer or reader in any other process; ``_writing`` rules out the writers of this process
    (``flock`` does too, except on file systems that emulate it with per-process POSIX locks,
    e.g. NFS). ``keep`` is asked before and again with the lock held, when no writer can
    publish the entry any more. The one gap, an entry created but not yet locked, is empty: an
    empty entry younger than ``FRESH_TEMP_S`` is left for a later write. Where ``flock`` is
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
            mode = os.O_RDONLY | O_DIRECTORY if is_dir else os.O_RDWR
            fd = os.open(entry, mode | O_CLOEXEC)
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
            if empty and time.time() - info.st_mtime < FRESH_TEMP_S:
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


def lock_shared(fd: int) -> bool:
    """Take a shared ``flock`` on ``fd`` (a reader's: no :func:`remove_unlocked` removes the
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


def sha256(f: BinaryIO) -> bytes:
    """SHA-256 of the rest of ``f``, read in chunks."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.digest()
