"""The persistent program cache's files: a key file others could read (and forge programs with)
or that is not a key, a directory below one another user controls, a read-only directory and a
full disk each leave the step compiling in memory with one warning, computing what it computes
without the cache; the directory is kept under its size cap, least recently used first.

The tests run as root here, where the OS lets every read and write through: they check fddp's own
checks of modes and owners, and simulate failing writes by patching the writer.
"""

from __future__ import annotations

import errno
import os
import tempfile
import warnings
from pathlib import Path

import pytest
from _compare import assert_trees_equal, detached
from _models import mlp_step, regression_batch

import fddp
import fddp.optim as optim
from fddp._compiler._cache import _store

SIZES = (8, 16, 4)
LOADED = "loaded from cache"
cache_module = fddp._compiler._cache._persistent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "programs"
    monkeypatch.setattr(cache_module, "_directory", str(directory))
    for name in ("_said", "_refused"):  # each test sees its own first warning
        monkeypatch.setattr(cache_module, name, set(), raising=False)
    return directory


def _train(rows: int = 8):
    """Two SGD steps of a new step object (as in a restarted process): outputs, and how its
    program was made."""
    opt = optim.sgd(0.1)
    step, params = mlp_step(opt, SIZES)
    pstep = fddp.data_parallel(step)
    state = opt.init(params)
    for i in range(2):
        params, state, loss = pstep(params, state, regression_batch(i, rows, SIZES[0], SIZES[-1]))
    how = pstep.schedule(params, state, regression_batch(0, rows, SIZES[0], SIZES[-1]))
    return detached((params, state, loss)), how.captured_with


def _reference(monkeypatch, rows: int = 8):
    with monkeypatch.context() as m:
        m.setattr(cache_module, "_directory", None)
        return _train(rows)[0]


def _programs(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))


def _no_warning_from_fddp(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    assert [str(w.message) for w in caught if "fddp" in str(w.message)] == []
    return result


@pytest.mark.parametrize("mode", [0o644, 0o620])
def test_a_key_file_others_can_read_or_write_is_refused(cache, monkeypatch, mode):
    expected = _reference(monkeypatch)
    _train()
    key = cache / f"fddp-v{_store.FORMAT}" / ".key"
    os.chmod(key, mode)
    with pytest.warns(UserWarning, match=r"key file .* read or written by others"):
        out, how = _train()
    assert how == "make_fx"
    assert_trees_equal(out, expected)


def test_an_emptied_key_file_is_refused(cache, monkeypatch):
    expected = _reference(monkeypatch, rows=6)
    _train()
    key = cache / f"fddp-v{_store.FORMAT}" / ".key"
    key.write_bytes(b"")
    before = _programs(cache)
    with pytest.warns(UserWarning, match=r"key file .* holds 0 bytes, not 32"):
        out, how = _train(rows=6)
    assert how == "make_fx"
    assert_trees_equal(out, expected)
    assert key.read_bytes() == b""
    assert _programs(cache) == before  # nothing signed with an empty key


@pytest.mark.parametrize("why", ["others can write to", "belongs to another user"])
def test_a_cache_below_a_directory_another_user_controls_is_refused(
    tmp_path, monkeypatch, cache, why
):
    expected = _reference(monkeypatch)
    parent = tmp_path / "shared"
    parent.mkdir()
    if why == "others can write to":
        os.chmod(parent, 0o777)  # another user can rename the cache away and put theirs there
    else:
        os.chown(parent, 4321, -1)
    monkeypatch.setattr(cache_module, "_directory", str(parent / "programs"))
    with pytest.warns(UserWarning, match="not using the program cache") as record:
        out, how = _train()
    assert any(why in str(w.message) and f"{parent} " in str(w.message) for w in record)
    assert how == "make_fx"
    assert_trees_equal(out, expected)
    assert list(parent.iterdir()) == []


def test_a_read_only_directory_compiles_in_memory_with_one_warning(cache, monkeypatch):
    expected = {rows: _reference(monkeypatch, rows) for rows in (6, 5)}
    _train()  # a program written before the directory became read-only
    real_mkstemp = tempfile.mkstemp

    def read_only(*args, **kwargs):
        if str(kwargs.get("dir", "")).startswith(str(cache)):
            raise PermissionError(errno.EACCES, "Permission denied", kwargs["dir"])
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.warns(UserWarning, match="could not write to the program cache"):
        out, how = _train(rows=6)
    assert how == "make_fx"
    assert_trees_equal(out, expected[6])
    out, how = _no_warning_from_fddp(_train, 5)
    assert how == "make_fx"
    assert_trees_equal(out, expected[5])
    assert _train()[1].endswith(LOADED)  # what the directory holds is still read


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.mark.parametrize("written_before", [False, True])
def test_a_full_disk_compiles_in_memory_with_one_warning(cache, monkeypatch, written_before):
    expected = {rows: _reference(monkeypatch, rows) for rows in (6, 5)}
    if written_before:
        _train()
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(cache)) and "w" in args[0]:
            return _FullDisk(file)
        return file

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.warns(UserWarning, match="No space left on device"):
        out, how = _train(rows=6)
    assert how == "make_fx"
    assert_trees_equal(out, expected[6])
    out, how = _no_warning_from_fddp(_train, 5)
    assert how == "make_fx"
    assert_trees_equal(out, expected[5])
    assert list(cache.rglob(".writing-*")) == []


def test_the_directory_is_kept_under_its_size_cap_least_recently_used_first(cache, monkeypatch):
    monkeypatch.setattr(cache_module, "_max_bytes", cache_module.MAX_BYTES, raising=False)
    expected = {rows: _reference(monkeypatch, rows) for rows in (4, 5, 6)}
    fddp.set_cache_dir(cache, max_bytes=1 << 30)
    _train(rows=4)
    entry = sum(p.stat().st_size for p in _programs(cache))
    limit = int(2.5 * entry)
    fddp.set_cache_dir(cache, max_bytes=limit)
    _train(rows=5)
    assert _train(rows=4)[1].endswith(LOADED)  # now used more recently than rows=5's
    _train(rows=6)  # a third program: rows=5's, the least recently used, makes room
    assert sum(p.stat().st_size for p in _programs(cache)) <= limit
    for rows in (4, 6):
        out, how = _train(rows)
        assert how.endswith(LOADED)
        assert_trees_equal(out, expected[rows])
    out, how = _train(rows=5)
    assert how == "make_fx"
    assert_trees_equal(out, expected[5])
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        fddp.set_cache_dir(cache, max_bytes=0)
