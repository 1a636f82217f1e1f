"""Tests for fddp.save / fddp.load: round trip, structure checks, atomicity, safe loading.

Public API only: fddp.save and fddp.load, observed through what they do with the files and with
torch.save (which fddp.save calls to write its payload: a spy on it shows which rank writes, a
failing one a failed write). Rank 0 waits its fixed 10 s for the other ranks to enter a save
(no public knob), so the 2-rank run starts in the background with this module's first test.
"""

from __future__ import annotations

import builtins
import enum
import functools
import io
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from _compare import assert_trees_equal
from _dist import run_checks

import fddp
from fddp import load, save

ARRIVAL_TIMEOUT_S = 10  # how long rank 0 waits for the others to enter a save


class Mode(enum.IntEnum):
    TRAIN = 0
    EVAL = 1


class AdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


def make_tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = {
        "layer": {"weight": torch.randn(4, 3, generator=g), "bias": torch.randn(4, generator=g)},
        "emb": torch.randn(5, 2, generator=g).to(torch.bfloat16),
    }
    zeros = lambda p: {k: torch.zeros_like(v) for k, v in p["layer"].items()}
    return {
        "params": params,
        "opt_state": [
            AdamState(torch.tensor(seed, dtype=torch.int64), zeros(params), zeros(params)),
            None,
        ],
        "step": 100 + seed,
        "data": {"file": f"shard-{seed}.bin", "offset": 0.5 + seed, "done": bool(seed)},
    }


def test_round_trip_nested_tree(tmp_path: Path) -> None:
    tree = make_tree(seed=1)
    path = tmp_path / "ckpt.pt"
    save(path, tree)
    restored = load(path, like=make_tree(seed=0))
    assert_trees_equal(restored, tree)
    assert isinstance(restored["opt_state"][0], AdamState)
    assert restored["opt_state"][1] is None
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_save_replaces_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    save(path, make_tree(seed=0))
    save(path, make_tree(seed=1))
    assert_trees_equal(load(path, like=make_tree(seed=0)), make_tree(seed=1))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_single_tensor_and_load_without_like(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, torch.arange(3))
    assert torch.equal(load(path, like=torch.zeros(3, dtype=torch.int64)), torch.arange(3))
    save(path, make_tree())
    flat = load(path)
    assert flat["['step']"] == 100
    assert torch.equal(
        flat["['params']['layer']['weight']"], make_tree()["params"]["layer"]["weight"]
    )
    assert "['opt_state'][0].mu['bias']" in flat


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_files_get_the_usual_permissions_less_the_umask(tmp_path: Path, umask: int) -> None:
    """A checkpoint is created like any new file (``open(path, "w")``): mode 0o666 less the
    umask, for the single file and for a sharded checkpoint's files."""
    previous = os.umask(umask)
    try:
        save(tmp_path / "ckpt.pt", make_tree())
        fddp.save_sharded(tmp_path / "sharded", make_tree())
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(previous)
    files = [tmp_path / "ckpt.pt", *(p for p in (tmp_path / "sharded").rglob("*") if p.is_file())]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    want = oct((tmp_path / "plain").stat().st_mode & 0o777)
    assert want == oct(0o666 & ~umask)
    assert modes == dict.fromkeys(modes, want)


def test_missing_and_extra_leaves_are_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree())
    like = make_tree()
    like["params"]["head"] = torch.zeros(2)
    del like["data"]["offset"]
    with pytest.raises(ValueError, match="structure of `like`") as info:
        load(path, like=like)
    msg = str(info.value)
    assert "in `like` but not in the file: ['params']['head']" in msg
    assert "in the file but not in `like`: ['data']['offset']" in msg


def test_shape_dtype_and_type_mismatches_are_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree())
    like = make_tree()
    like["params"]["layer"]["weight"] = torch.zeros(3, 4)
    like["params"]["emb"] = torch.zeros(5, 2)
    like["step"] = 1.0
    like["opt_state"][0] = like["opt_state"][0]._replace(count=7)
    with pytest.raises(ValueError, match=r"does not match `like` \(4 mismatches\)") as info:
        load(path, like=like)
    msg = str(info.value)
    assert "['params']['layer']['weight']: shape (4, 3) in the file, (3, 4) in like" in msg
    assert "['params']['emb']: dtype torch.bfloat16 in the file, torch.float32 in like" in msg
    assert "['step']: int in the file, float in like" in msg
    assert "['opt_state'][0].count: Tensor in the file, int in like" in msg


def test_unsupported_leaf_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"leaf \['fn'\] of type object: checkpoint leaves must be"):
        save(tmp_path / "ckpt.pt", {"w": torch.ones(1), "fn": object()})
    with pytest.raises(TypeError, match=r"leaf \['mode'\] of type Mode"):
        save(tmp_path / "ckpt.pt", {"mode": Mode.EVAL})
    assert os.listdir(tmp_path) == []


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match=r"nope\.pt"):
        load(path, like=make_tree())


@pytest.mark.parametrize("exc", [OSError("No space left on device"), KeyboardInterrupt()])
def test_interrupted_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree(seed=0))
    before = path.read_bytes()
    real_save = torch.save

    def half_then_fail(obj, f, *args, **kwargs):
        import io

        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise exc

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(type(exc)):
        save(path, make_tree(seed=1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert_trees_equal(load(path, like=make_tree()), make_tree(seed=0))


@pytest.mark.parametrize("keep", [0, 20, 60, 0.5, -1])
def test_truncated_file_gives_clear_error(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree())
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"is corrupted or truncated .*previous checkpoint"):
        load(path, like=make_tree())


def test_flipped_byte_fails_checksum(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"corrupted or truncated \(SHA-256 checksum mismatch\)"):
        load(path, like=make_tree())


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save(path, make_tree())
    data = bytearray(path.read_bytes())
    data[8:12] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"format version 99.*upgrade fddp"):
        load(path, like=make_tree())


def _mark(marker: str) -> None:
    Path(marker).write_text("code from the checkpoint ran")


class Malicious:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_mark, (self.marker,))


def test_weights_only_refuses_pickled_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    marker = tmp_path / "pwned"
    real_save = torch.save

    def with_code(payload, f, *args, **kwargs):  # what fddp.save hands torch.save, poisoned
        real_save({**payload, "leaves": [Malicious(str(marker))]}, f, *args, **kwargs)

    # A well-formed, correctly checksummed file whose payload carries a code-running object.
    monkeypatch.setattr(torch, "save", with_code)
    save(path, torch.zeros(1))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"refusing to unpickle .*weights_only=True.*_mark"):
        load(path, like=torch.zeros(1))
    assert not marker.exists()

    # The payload is really malicious: a trusting unpickler runs it.
    data = path.read_bytes()
    payload = io.BytesIO(data[data.index(b"PK\x03\x04") :])  # torch.save's zip, after the header
    torch.load(payload, weights_only=False)
    assert marker.exists()


def test_plain_torch_save_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    marker = tmp_path / "pwned"
    torch.save({"w": Malicious(str(marker))}, path)
    with pytest.raises(ValueError, match=r"not an fddp checkpoint but a plain torch\.save file"):
        load(path, like={"w": torch.zeros(1)})
    assert not marker.exists()


def _pickle_load(path: Path) -> object:
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize(
    "reader",
    [
        torch.load,  # weights_only=True, torch's default
        functools.partial(torch.load, weights_only=True),
        functools.partial(torch.load, weights_only=False),
        _pickle_load,
    ],
    ids=["torch.load", "weights_only=True", "weights_only=False", "pickle.load"],
)
def test_torch_load_of_a_checkpoint_names_fddp_load(tmp_path: Path, reader) -> None:
    path = tmp_path / "ckpt.pt"
    marker = tmp_path / "pwned"
    save(path, {"w": torch.ones(2), "note": str(marker)})
    with pytest.raises(LookupError) as info:
        reader(path)
    message = str(info.value)
    assert "fddp checkpoint (written by fddp.save, not torch.save)" in message, message
    assert "load it with fddp.load(path, like=...)" in message, message
    assert not marker.exists()
    assert_trees_equal(
        load(path, like={"w": torch.zeros(2), "note": ""}),
        {
            "w": torch.ones(2),
            "note": str(marker),
        },
    )


def test_a_file_of_the_previous_format_still_loads(tmp_path: Path) -> None:
    """Format 1 (fddp 0.1.0): the header (b"FDDPCKPT", version, SHA-256 and length of the
    payload) at the start of the file, then torch.save's bytes of the payload."""
    import hashlib
    import struct

    tree = make_tree(seed=3)
    paths = ["['layer']['weight']", "['layer']['bias']", "['emb']"]
    leaves = [tree["params"]["layer"]["weight"], tree["params"]["layer"]["bias"]]
    leaves.append(tree["params"]["emb"])
    payload = io.BytesIO()
    torch.save(
        {
            "format": "fddp.checkpoint",
            "version": 1,
            "structure": "PyTreeSpec(...)",
            "paths": paths,
            "leaves": leaves,
            "machine": [],
        },
        payload,
    )
    data = payload.getvalue()
    header = struct.pack("<8sI32sQ", b"FDDPCKPT", 1, hashlib.sha256(data).digest(), len(data))
    path = tmp_path / "old.pt"
    path.write_bytes(header + data)
    assert_trees_equal(load(path, like=make_tree()["params"]), tree["params"])
    assert_trees_equal(load(path), dict(zip(paths, leaves)))
    path.write_bytes(header + data[:-1])
    with pytest.raises(ValueError, match=r"corrupted or truncated \(\d+ payload bytes"):
        load(path, like=make_tree()["params"])


def _spy_on_torch_save(writers: list[int], fail: bool = False) -> None:
    """Record this rank in ``writers`` whenever fddp.save writes (calls torch.save); with
    ``fail``, fail instead, as a full disk would."""
    real = getattr(torch.save, "real", torch.save)

    def spy(obj, f, *args, **kwargs):
        if fail:
            raise OSError("No space left on device")
        writers.append(dist.get_rank())
        real(obj, f, *args, **kwargs)

    spy.real = real
    torch.save = spy


def _check_only_rank0_writes(tmpdir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    writers: list[int] = []
    _spy_on_torch_save(writers)
    path = os.path.join(tmpdir, "ckpt.pt")
    # Rank-dependent values reveal whose copy the file holds.
    tree = {"w": torch.full((3,), float(rank)), "step": 5}
    save(path, tree)
    restored = load(path, like=tree)  # no extra barrier: save returned, the file is there
    assert torch.equal(restored["w"], torch.zeros(3)), restored
    assert restored["step"] == 5
    all_writers = [None] * world
    dist.all_gather_object(all_writers, writers)
    assert all_writers == [[0], []], all_writers

    # A failure on rank 0 is raised on every rank instead of leaving rank 1 waiting.
    _spy_on_torch_save(writers, fail=rank == 0)
    expected = (OSError, "No space") if rank == 0 else (RuntimeError, "rank 0 failed")
    with pytest.raises(expected[0], match=expected[1]):
        save(path, {"w": torch.ones(3), "step": 6})
    assert load(path, like=tree)["step"] == 5

    # rank0_only=False: every rank writes its own file.
    torch.save = torch.save.real
    own = os.path.join(tmpdir, f"rank{rank}.pt")
    save(own, tree, rank0_only=False)
    assert torch.equal(load(own, like=tree)["w"], tree["w"])
    dist.barrier()


def _check_save_on_rank0_only(tmpdir: str) -> None:
    """`if rank == 0: fddp.save(...)` fails fast on rank 0, and the group stays usable."""
    rank = dist.get_rank()
    path = os.path.join(tmpdir, "misuse.pt")
    tree = {"w": torch.ones(3), "step": 1}
    if rank == 0:
        within = rf"rank 1 did not call fddp\.save within {ARRIVAL_TIMEOUT_S} s"
        with pytest.raises(ValueError, match=within) as info:
            save(path, tree)
        assert isinstance(info.value, fddp.RankFailureError)
        assert "every rank calls fddp.save" in str(info.value)
        assert "rank0_only=False" in str(info.value)
        assert not os.path.exists(path)
    # Rank 1 went on to its next collective; rank 0, having caught the error, meets it there.
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2
    # A rank that comes to the save after rank 0 gave up is told so at once.
    if rank == 1:
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank 0 stopped waiting before this rank came"):
            save(path, tree)
        assert time.monotonic() - start < 30  # not the collective timeout (300 s)
    dist.barrier()
    # Both ranks agree on the next save again.
    save(path, tree)
    assert load(path, like=tree)["step"] == 1


def _check_save_after_a_peer_timed_out(tmpdir: str) -> None:
    """After a collective timed out, save raises RankFailureError, every time, on every rank.
    Last: it breaks the group."""
    rank = dist.get_rank()
    fddp.init(timeout=1)  # applied to the existing group
    timed_out = Path(tmpdir) / "timed-out"
    if rank == 0:
        with pytest.raises(RuntimeError):  # gloo's own words differ by where it timed out
            dist.all_reduce(torch.ones(1))  # rank 1 is stuck
        timed_out.touch()
    else:
        while not timed_out.exists():
            time.sleep(0.01)
        with pytest.raises(RuntimeError):  # rank 0 gave up on the group: its links closed
            dist.all_reduce(torch.ones(1))
    path = os.path.join(tmpdir, "after-timeout.pt")
    for attempt in range(2):
        with pytest.raises(fddp.RankFailureError, match=r"fddp\.save: a collective failed") as info:
            save(path, {"w": torch.ones(3)})
        cause = info.value.__cause__  # the backend's own error, whatever its words
        assert isinstance(cause, RuntimeError) and not isinstance(cause, fddp.RankFailureError)
        print(f"rank {rank}: save {attempt}: {str(info.value).splitlines()[0]}")
    assert not os.path.exists(path)


@pytest.fixture(scope="module", autouse=True)
def _two_ranks_in_background(tmp_path_factory: pytest.TempPathFactory):
    """Start the 2-rank run (mostly a wait: rank 0's arrival timeout) before the first test."""
    tmp = str(tmp_path_factory.mktemp("two-ranks"))
    checks = {
        "only_rank0_writes": functools.partial(_check_only_rank0_writes, tmp),
        "save_on_rank0_only": functools.partial(_check_save_on_rank0_only, tmp),
        "after_a_timeout": functools.partial(_check_save_after_a_peer_timed_out, tmp),
    }
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run_checks, checks, 2, timeout=180), Path(tmp)


@pytest.fixture
def two_ranks(_two_ranks_in_background):
    future, tmp = _two_ranks_in_background
    return future.result(), tmp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_places_tensors_on_like_devices(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    tree = {"a": torch.arange(3.0), "b": torch.arange(2.0, device="cuda"), "step": 1}
    save(path, tree)
    cuda_like = {"a": torch.zeros(3, device="cuda"), "b": torch.zeros(2, device="cuda"), "step": 0}
    on_cuda = load(path, like=cuda_like)
    assert on_cuda["a"].is_cuda and on_cuda["b"].is_cuda
    mixed = load(path, like={"a": torch.zeros(3, device="cuda"), "b": torch.zeros(2), "step": 0})
    assert mixed["a"].is_cuda and not mixed["b"].is_cuda
    assert torch.equal(mixed["b"], torch.arange(2.0))


# --- Soundness under concurrency, crashes, full disks and misuse ---


def _big_tree(seed: int) -> dict:
    return {"w": torch.full((256, 1024), float(seed)), "step": seed}  # 1 MiB


def test_concurrent_saves_to_one_path(tmp_path: Path) -> None:
    """Two threads (one pid, as a checkpoint thread beside the training loop) save to one path
    again and again while a reader loads it: every save returns, every load finds a complete
    checkpoint, and no temporary file is left."""
    import threading

    path = tmp_path / "ckpt.pt"
    save(path, _big_tree(0))
    errors: list[BaseException] = []
    loaded: list[int] = []

    def saver(first: int) -> None:
        try:
            for seed in range(first, first + 4):
                save(path, _big_tree(seed))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(first,)) for first in (100, 200)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        try:
            tree = load(path, like=_big_tree(0))
        except BaseException as e:
            errors.append(e)
            break
        assert torch.equal(tree["w"], torch.full((256, 1024), float(tree["step"])))
        loaded.append(tree["step"])
    for t in threads:
        t.join()
    assert not errors, errors
    assert load(path, like=_big_tree(0))["step"] in (103, 203)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


_CHILD_WRITER = """
import errno, resource, signal, sys, time, torch
import fddp

# A write error from the kernel inside torch.save (which torch reports as 'unexpected pos'):
# past a file-size limit, with SIGXFSZ ignored, writes fail with EFBIG, as with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.RLIM_INFINITY))
try:
    fddp.save(sys.argv[1], {"w": torch.ones(10000)})
except OSError as e:
    print(errno.errorcode[e.errno], e.filename, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

def half_then_hang(obj, f, *args, **kwargs):
    f.write(b"x" * 4096)
    f.flush()
    print("writing", flush=True)
    time.sleep(600)

torch.save = half_then_hang
fddp.save(sys.argv[1], {"w": torch.ones(3), "step": 1})
"""


def test_write_error_and_kill_in_another_process(tmp_path: Path) -> None:
    """In a real process: a write refused by the kernel raises OSError(errno, path); a save
    killed mid-write (SIGKILL, the OOM killer) leaves its temporary file, which the next save
    to the path removes, but never the temporary file of a save still running."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "ckpt.pt"
    save(path, make_tree(seed=0))
    before = path.read_bytes()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == f"EFBIG {path}\n"
        assert child.stdout.readline() == "writing\n"
        assert path.read_bytes() == before
        running = [n for n in os.listdir(tmp_path) if n != "ckpt.pt"]
        assert len(running) == 1 and running[0].startswith("ckpt.pt.tmp-"), running
        save(path, make_tree(seed=1))  # the child is alive: its file stays
        assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", *running])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert_trees_equal(load(path, like=make_tree()), make_tree(seed=1))
    save(path, make_tree(seed=2))  # the writer is dead: its file goes
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert_trees_equal(load(path, like=make_tree()), make_tree(seed=2))


def test_orphan_removal_spares_other_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    stale = tmp_path / "ckpt.pt.tmp-12345"  # the name an older fddp used, its writer gone
    stale.write_bytes(b"partial")
    empty = tmp_path / "ckpt.pt.tmp-0123abcd"  # maybe created by a writer not yet locked
    empty.touch()
    others = ["other.pt.tmp-12345", "ckpt.pt.tmp-notes.txt", "ckpt.pt.bak"]
    for name in others:
        (tmp_path / name).write_bytes(b"keep")
    save(path, make_tree())
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", empty.name, *others])
    old = empty.stat().st_mtime - 24 * 3600  # a day old: whatever the freshness window
    os.utime(empty, (old, old))
    save(path, make_tree())
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", *others])


class _FullDisk:
    """A file that accepts ``room`` bytes, then fails like a full disk."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.mark.parametrize("room", [0, 100, 2000, 10**9])
def test_disk_full_is_an_oserror_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """ENOSPC during torch.save's writes (which torch turns into 'unexpected pos'), or during
    the final flush (room=10**9 is never used up: the fsync fails), is raised as that OSError."""
    import errno

    path = tmp_path / "ckpt.pt"
    save(path, make_tree(seed=0))
    before = path.read_bytes()
    real_open = builtins.open

    def full_disk_open(*args, **kwargs) -> _FullDisk:
        return _FullDisk(real_open(*args, **kwargs), room)

    monkeypatch.setattr(builtins, "open", full_disk_open)  # the file fddp.save writes to
    if room == 10**9:

        def fsync_fails(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="No space left on device") as info:
        save(path, make_tree(seed=1))
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(path)
    assert "previous checkpoint" in str(info.value)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


# --- the 2-rank run's results, last: the other tests ran while it did ---


def test_two_ranks_only_rank0_writes(two_ranks) -> None:
    results, tmp = two_ranks
    assert results["only_rank0_writes"] == [None, None]
    like = {"w": torch.zeros(3), "step": 0}
    assert torch.equal(load(tmp / "rank1.pt", like=like)["w"], torch.ones(3))


def test_two_ranks_save_under_if_rank_0_fails_fast_and_the_group_stays_usable(two_ranks) -> None:
    results, _ = two_ranks
    assert results["save_on_rank0_only"] == [None, None]


def test_two_ranks_save_after_a_collective_timed_out_raises_every_time(two_ranks) -> None:
    results, tmp = two_ranks
    assert results["after_a_timeout"] == [None, None]
    assert sorted(os.listdir(tmp)) == ["ckpt.pt", "misuse.pt", "rank0.pt", "rank1.pt", "timed-out"]
