"""fddp.save_sharded / fddp.load_sharded: atomic, checksummed, pickle-safe, with clear errors.

Three groups, each started once: jobs of 2 ranks in which one rank SIGKILLs itself inside
``save_sharded`` (``_reliability_scripts/sharded_kill.py``, subprocesses: a killed rank fails
any harness run), started first so that they run while one ``run_checks`` spawn of 2 gloo
ranks runs the other multi-rank checks; then single-process checks of the on-disk layout.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import json
import os
import pickle
import signal
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _compare import assert_trees_equal
from _dist import Job, run_checks, script_env
from test_checkpoint import Malicious, _FullDisk

import fddp
import fddp.optim as optim

ROOT = Path(__file__).resolve().parents[1]
KILL_SCRIPT = ROOT / "tests" / "_reliability_scripts" / "sharded_kill.py"
JOB_TIMEOUT_S = 150.0
MANIFEST = "fddp-sharded.json"


@functools.cache
def _script():
    """The module sharded_kill.py, for its helpers."""
    sys.path.insert(0, str(KILL_SCRIPT.parent))
    try:
        import sharded_kill
    finally:
        sys.path.pop(0)
    return sharded_kill


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


# --- ranks SIGKILLed inside save_sharded ------------------------------------------------------


def _kill_job(mode: str, directory: Path) -> Job:
    """The ranks of ``sharded_kill.py MODE DIR`` (2, or 1 for ``new``), each logging apart."""
    directory.mkdir()
    argv = [str(KILL_SCRIPT), mode, str(directory)]
    if mode == "new":  # a world of one: no torchrun environment
        return Job(mode, [([sys.executable, *argv], script_env())], directory.parent, JOB_TIMEOUT_S)
    return Job.ranks(mode, directory.parent, argv, timeout=JOB_TIMEOUT_S)


def _survivor(mode: str, job: Job) -> dict:
    """What save_sharded raised on the rank that was not killed."""
    victim = {"open": 1, "write": 0}[mode]
    codes = job.returncodes()
    assert codes[victim] == -signal.SIGKILL, job.describe()
    assert codes[1 - victim] == 0, job.describe()
    lines = job.output(1 - victim).splitlines()
    outcome = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("fddp-kill: ")]
    assert len(outcome) == 1, job.describe()
    return outcome[0]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory):
    """The three kill jobs, started at once (before the spawn of the 2-rank checks);
    ``killed()`` waits for them."""
    tmp = tmp_path_factory.mktemp("killed")
    jobs = {mode: _kill_job(mode, tmp / mode) for mode in ("open", "write", "new")}

    def finished() -> dict[str, tuple[Job, Path]]:
        return {mode: (job.wait(), tmp / mode) for mode, job in jobs.items()}

    yield finished
    for job in jobs.values():
        job.stop()


# --- checks on 2 gloo ranks, one spawn ---------------------------------------------------------


def _in_step(check, tmp: str) -> None:
    """Run ``check(tmp)`` on this rank, then wait for the other (a failing check raises once
    both are done, so the next check starts together)."""
    try:
        check(tmp)
    except BaseException as e:  # DCP's CheckpointException is one: a test sees it as such
        raise AssertionError(f"{type(e).__name__}: {e}") from e
    finally:
        dist.barrier()


def _rank_tree(seed: int) -> dict:
    """Params, shard_state Adam state after one update (a different shard on each rank)."""
    opt = optim.shard_state(optim.adam(0.1))
    params = {"w": torch.arange(1000.0) + seed, "n": torch.arange(5) * seed, "v": torch.ones(7)}
    floats = {"w": params["w"], "v": params["v"]}
    init = fddp.data_parallel(lambda p: opt.init(p), trace=False)
    update = fddp.data_parallel(lambda p, g, s: opt.update(g, s, p)[1], trace=False)
    grads = {"w": torch.arange(1000.0) * (1 + dist.get_rank()), "v": torch.full((7,), seed + 0.5)}
    state = update(floats, grads, init(floats))
    return {"params": params, "opt": state, "step": seed, "note": f"seed {seed}"}


def _like() -> dict:
    return _rank_tree(0)


@contextlib.contextmanager
def _full_disk_in_dcp(ending: str, room: int):
    """DCP's files whose names end with ``ending`` fill the disk after ``room`` bytes."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            full = "w" in mode and str(path).endswith(ending)
            yield _FullDisk(stream, room) if full else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


@contextlib.contextmanager
def _full_manifest():
    """fddp's own small files (the manifest) fill the disk after 10 bytes."""
    from fddp._base import _files

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            _files,
            "open",
            lambda *a, **k: _FullDisk(open(*a, **k), 10),  # noqa: SIM115 (closed by its exit)
            raising=False,
        )
        yield


def _check_disk_full(tmp: str) -> None:
    """ENOSPC on rank 1's shard, on rank 0's .metadata, in rank 0's manifest. Before,
    the previous checkpoint was destroyed and DCP raised 'unexpected pos'; now every rank
    raises OSError(ENOSPC) naming the path, and the previous checkpoint loads as it was."""
    rank = dist.get_rank()
    path = os.path.join(tmp, "full")
    previous = _rank_tree(1)
    fddp.save_sharded(path, previous)
    listing = sorted(os.listdir(path))
    cases = [
        ("rank 1's shard file", _full_disk_in_dcp(".distcp", 100), rank == 1),
        ("rank 0's .metadata", _full_disk_in_dcp(".metadata.tmp", 10), rank == 0),
        ("rank 0's manifest", _full_manifest(), rank == 0),
    ]
    for what, fault, here in cases:
        new = _rank_tree(2)
        with pytest.raises(OSError) as info, fault if here else contextlib.nullcontext():
            fddp.save_sharded(path, new)
        error = info.value
        assert error.errno == errno.ENOSPC, (what, error)
        assert str(error.filename).startswith(path), (what, error)
        assert "No space left on device" in first_line(error), (what, error)
        assert "previous checkpoint, if any, is untouched" in first_line(error), (what, error)
        dist.barrier()
        assert sorted(os.listdir(path)) == listing, what
        assert_trees_equal(fddp.load_sharded(path, _like()), previous)


def _flip_in_shards(path: str, old: bytes, byte: int, bit: int) -> str:
    """Flip one bit of the bytes ``old`` in the shard file holding them; return its name."""
    for name in glob.glob(os.path.join(path, "**", "*.distcp"), recursive=True):
        data = bytearray(Path(name).read_bytes())
        at = data.find(old)
        if at >= 0:
            data[at + byte] ^= 1 << bit
            Path(name).write_bytes(bytes(data))
            return name
    raise AssertionError(f"{old!r} not in any shard of {path}")


def _check_bit_flip(tmp: str) -> None:
    """One bit flipped in a shard file. Before, w[500] loaded as 125.0 (saved 500.0)
    silently; now a ValueError naming the file."""
    path = os.path.join(tmp, "flip")
    tree = _rank_tree(0)
    fddp.save_sharded(path, tree)
    name = [None]
    if dist.get_rank() == 0:  # the exponent of 500.0, between 499.0 and 501.0
        name = [_flip_in_shards(path, struct.pack("<3f", 499, 500, 501), 7, 0)]
    dist.broadcast_object_list(name, src=0)
    with pytest.raises(ValueError, match="corrupted or truncated") as info:
        got = fddp.load_sharded(path, _like())
        assert got["params"]["w"][500] == 500.0, got["params"]["w"][500]
    assert name[0] in first_line(info.value)
    assert "SHA-256 checksum mismatch" in first_line(info.value)


def _dcp_save_as_before(path: str, tree) -> None:
    """What save_sharded wrote before the manifest: a plain DCP directory of fddp's keys."""
    import torch.distributed.checkpoint as dcp

    from fddp._checkpoint._dcp import entries as _entries
    from fddp._checkpoint._dcp import mesh as _mesh
    from fddp._checkpoint._dcp import part as _part

    entries = _entries(tree)
    mesh = _mesh(dist.group.WORLD, entries)
    state_dict = {k: x if piece is None else _part(x, piece, mesh) for k, x, piece in entries}
    dcp.save(state_dict, checkpoint_id=path)


def _check_crafted_pickles(tmp: str) -> None:
    """A crafted .metadata (a pickle), in a checkpoint with a manifest whose checksums
    were updated to match, and in a plain DCP directory; and a crafted non-tensor leaf.
    Before, the pickled code ran inside load_sharded; now nothing runs and ValueError says so.
    A plain DCP directory of today's keys still loads (no checksums to verify)."""
    rank = dist.get_rank()
    tree = {"w": torch.arange(4.0), "step": 3}
    like = {"w": torch.zeros(4), "step": 0}
    marker = os.path.join(tmp, "pwned")
    crafted = pickle.dumps({"metadata": Malicious(marker)})

    def refused(where: str, match: str) -> None:
        with pytest.raises(ValueError, match=match) as info:
            fddp.load_sharded(where, like)
        assert where in first_line(info.value) and "_mark" in first_line(info.value)
        assert not os.path.exists(marker)

    legacy = os.path.join(tmp, "legacy")
    _dcp_save_as_before(legacy, tree)
    assert_trees_equal(fddp.load_sharded(legacy, like), tree)  # an older fddp's checkpoint
    if rank == 0:
        Path(legacy, ".metadata").write_bytes(crafted)
    dist.barrier()
    refused(legacy, r"its \.metadata names test_checkpoint\._mark, .*refusing to unpickle")
    leaf = os.path.join(tmp, "crafted-leaf")
    _dcp_save_as_before(leaf, {"w": torch.arange(4.0), "step": Malicious(marker)})
    refused(leaf, r"leaf \['step'\] holds objects other than plain Python values; refusing")

    path = os.path.join(tmp, "crafted")
    fddp.save_sharded(path, tree)
    if rank == 0:  # the manifest's checksums updated to match
        manifest = json.loads(Path(path, MANIFEST).read_text())
        Path(path, manifest["data"], ".metadata").write_bytes(crafted)
        digest = hashlib.sha256(crafted).hexdigest()
        manifest["files"][".metadata"] = {"bytes": len(crafted), "sha256": digest}
        del manifest["sha256"]
        body = json.dumps(manifest, sort_keys=True).encode()
        manifest["sha256"] = hashlib.sha256(body).hexdigest()
        Path(path, MANIFEST).write_text(json.dumps(manifest))
    dist.barrier()
    refused(path, "refusing to unpickle")


def _check_dtype_mismatch(tmp: str) -> None:
    """`like` of another dtype. Before, silently cast (to float64, lossy bf16,
    truncated int32); now ValueError naming each leaf and both dtypes."""
    path = os.path.join(tmp, "dtypes")
    tree = _rank_tree(1)
    fddp.save_sharded(path, tree)
    like = _like()
    like["params"] = {
        "w": like["params"]["w"].double(),
        "n": like["params"]["n"].int(),
        "v": like["params"]["v"].bfloat16(),
    }
    with pytest.raises(ValueError) as info:
        fddp.load_sharded(path, like)
    message = str(info.value)
    assert path in first_line(info.value) and "does not match `like`" in first_line(info.value)
    assert (
        "['params']['w']: dtype torch.float32 in the checkpoint, torch.float64 in like" in message
    )
    assert "['params']['n']: dtype torch.int64 in the checkpoint, torch.int32 in like" in message
    assert (
        "['params']['v']: dtype torch.float32 in the checkpoint, torch.bfloat16 in like" in message
    )


def _check_shard_state_with_fddp_save(tmp: str) -> None:
    """A shard_state state saved with fddp.save (rank 0 writes). Before, no error,
    every rank loaded rank 0's shard and the parameters drifted; now refused on every rank,
    naming save_sharded, before anything is written."""
    path = os.path.join(tmp, "replicated.pt")
    with pytest.raises(TypeError, match=r"leaf \['opt'\] is the state of fddp.optim.shard_state"):
        fddp.save(path, _rank_tree(1))
    with pytest.raises(TypeError, match=r"fddp\.save_sharded\(directory, tree\)"):
        fddp.save(path, {"opt": _rank_tree(1)["opt"]})
    assert not os.path.exists(path)
    own = os.path.join(tmp, f"own-{dist.get_rank()}.pt")  # a file per rank is fine
    fddp.save(own, _rank_tree(1), rank0_only=False)
    assert_trees_equal(fddp.load(own, like=_like()), _rank_tree(1))


def _check_clear_errors(tmp: str) -> None:
    """Each broken checkpoint or mismatch raises one fddp error (an OSError or
    ValueError, so `except Exception` catches it) whose first line names the path or leaf and
    the cause. Before: CheckpointException (a BaseException) and 10-25 lines of traceback."""
    rank = dist.get_rank()
    path = os.path.join(tmp, "clear")
    tree = _rank_tree(1)
    fddp.save_sharded(path, tree)
    like = _like()

    def expect(kind, where, words, like=like, first=True):
        try:
            fddp.load_sharded(where, like)
        except Exception as e:
            assert isinstance(e, kind), (where, words, repr(e))
            text = first_line(e) if first else str(e)
            assert where in first_line(e), (where, words, str(e))
            for word in words:
                assert word in text, (where, word, str(e))
            return
        raise AssertionError(f"load_sharded({where}) did not raise")

    expect(FileNotFoundError, os.path.join(tmp, "missing"), ["no such directory"])
    file = os.path.join(tmp, "file.pt")
    fddp.save(file, {"w": torch.ones(1)})
    expect(ValueError, file, ["is a file, not a sharded checkpoint"])
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty, exist_ok=True)
    expect(FileNotFoundError, empty, ["no sharded checkpoint"])

    shape = {**like, "params": {**like["params"], "v": torch.ones(8)}}
    expect(ValueError, path, ["does not match `like`"], like=shape)
    expect(ValueError, path, ["['params']['v']: shape (7,) in the checkpoint, (8,)"], shape, False)
    extra = {**like, "more": torch.ones(1)}
    expect(ValueError, path, ["does not have the structure of `like`"], like=extra)
    expect(ValueError, path, ["in `like` but not in the checkpoint: ['more']"], extra, False)
    fewer = {k: v for k, v in like.items() if k != "note"}
    expect(ValueError, path, ["in the checkpoint but not in `like`: ['note']"], fewer, False)

    # Plain DCP directories (an older fddp's): a crash mid-save (no .metadata yet), a
    # truncated shard, a shard and a .metadata that are no such files; a truncated shard.
    partial, truncated, alien, unpickled = (
        os.path.join(tmp, name) for name in ("partial", "truncated", "alien", "unpickled")
    )
    for legacy in (partial, truncated, alien, unpickled):
        _dcp_save_as_before(legacy, tree)
    if rank == 0:
        os.remove(os.path.join(partial, ".metadata"))
        for shard in (os.path.join(truncated, "__1_0.distcp"), *glob.glob(f"{path}/*/__1_0*")):
            with open(shard, "r+b") as f:
                f.truncate(os.path.getsize(shard) // 2)
        shard = os.path.join(alien, "__1_0.distcp")
        Path(shard).write_bytes(b"x" * os.path.getsize(shard))
        Path(unpickled, ".metadata").write_bytes(b"not a pickle")
    dist.barrier()
    expect(FileNotFoundError, partial, ["no sharded checkpoint"])
    expect(ValueError, path, ["corrupted or truncated", "__1_0.distcp", "bytes, expected"])
    expect(ValueError, truncated, ["corrupted or truncated", "__1_0.distcp"])
    expect(ValueError, alien, ["corrupted or truncated", "__1_0.distcp"])
    expect(ValueError, unpickled, ["corrupted or truncated", ".metadata cannot be unpickled"])


TWO_RANK_CHECKS = {
    "disk_full": _check_disk_full,
    "bit_flip": _check_bit_flip,
    "crafted_pickles": _check_crafted_pickles,
    "dtype_mismatch": _check_dtype_mismatch,
    "shard_state_with_fddp_save": _check_shard_state_with_fddp_save,
    "clear_errors": _check_clear_errors,
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, killed):
    """Rows 3-8 on 2 gloo ranks, one spawn (the kill jobs run meanwhile)."""
    tmp = str(tmp_path_factory.mktemp("two_ranks"))
    checks = {name: functools.partial(_in_step, c, tmp) for name, c in TWO_RANK_CHECKS.items()}
    return run_checks(checks, 2, timeout=240)


def test_a_full_disk_raises_enospc_naming_the_path_and_keeps_the_previous_checkpoint(two_ranks):
    assert two_ranks["disk_full"] == [None, None]


def test_a_flipped_bit_in_a_shard_file_is_a_checksum_error_naming_the_file(two_ranks):
    assert two_ranks["bit_flip"] == [None, None]


def test_crafted_pickles_are_refused_and_nothing_in_them_runs(two_ranks):
    assert two_ranks["crafted_pickles"] == [None, None]


def test_a_like_of_other_dtypes_is_refused_naming_each_leaf_and_both_dtypes(two_ranks):
    assert two_ranks["dtype_mismatch"] == [None, None]


def test_fddp_save_of_shard_state_state_is_refused_naming_save_sharded(two_ranks):
    assert two_ranks["shard_state_with_fddp_save"] == [None, None]


def test_each_broken_checkpoint_raises_one_error_naming_the_path_and_the_cause(two_ranks):
    assert two_ranks["clear_errors"] == [None, None]


# --- the kill jobs' results --------------------------------------------------------------


def _kill_like():
    """The tree sharded_kill.py saves, laid out for this process (a world of one)."""
    params = _script().params()
    return {"params": params, "opt": _script().optimizer().init(params), "step": 0}


def _assert_previous_intact(directory: Path) -> None:
    ckpt, reference = directory / "ckpt", directory / "reference"
    like = _kill_like()
    got = fddp.load_sharded(ckpt, like)
    assert_trees_equal(got, fddp.load_sharded(reference, like))
    assert got["step"] == 3


def test_kill_as_a_rank_opens_its_shard_file_keeps_the_previous_checkpoint(killed) -> None:
    """Rank 1 SIGKILLed as it opens its shard file; rank 0 wrote its own. Before, the
    load returned a mix (moments half from each save); now the previous checkpoint loads as
    it was, and the surviving rank 0 removed the unpublished directory."""
    job, directory = killed()["open"]
    _survivor("open", job)
    _assert_previous_intact(directory)
    ckpt = directory / "ckpt"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert sorted(os.listdir(ckpt)) == sorted([MANIFEST, manifest["data"]])


def test_kill_mid_write_keeps_the_previous_checkpoint(killed) -> None:
    """Rank 0 SIGKILLed after writing part of its shard file. Before, the previous
    checkpoint was destroyed (old .metadata, truncated shard); now it is intact, and the next
    save removes the directory the dead save left."""
    job, directory = killed()["write"]
    _survivor("write", job)
    _assert_previous_intact(directory)
    ckpt = directory / "ckpt"
    tree = {"w": torch.ones(3)}
    fddp.save_sharded(ckpt, tree)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert sorted(os.listdir(ckpt)) == sorted([MANIFEST, manifest["data"]])
    assert_trees_equal(fddp.load_sharded(ckpt, {"w": torch.zeros(3)}), tree)


def test_kill_mid_save_to_a_new_path_leaves_a_clear_error(killed) -> None:
    """A process SIGKILLed mid-save to a new path. Before, loading
    it raised DCP's CheckpointException (a BaseException) with a traceback; now
    FileNotFoundError, whose first line names the path and the cause. The next save removes
    what the dead one left."""
    job, directory = killed()["new"]
    assert job.returncodes() == [-signal.SIGKILL], job.describe()
    new = directory / "new"
    with pytest.raises(FileNotFoundError) as info:
        fddp.load_sharded(new, {"params": _kill_like()["params"], "step": 0})
    assert str(new) in first_line(info.value)
    assert "no sharded checkpoint" in first_line(info.value)
    assert "interrupted" in str(info.value)
    [orphan] = os.listdir(new)
    tree = {"w": torch.ones(3)}
    fddp.save_sharded(new, tree)
    manifest = json.loads((new / MANIFEST).read_text())
    assert sorted(os.listdir(new)) == sorted([MANIFEST, manifest["data"]])
    assert orphan != manifest["data"]
    assert_trees_equal(fddp.load_sharded(new, {"w": torch.zeros(3)}), tree)


@pytest.mark.parametrize("mode", ["open", "write"])
def test_the_surviving_rank_raises_rank_failure_error(killed, mode: str) -> None:
    """The rank whose peer was killed inside save_sharded. Before, gloo's raw
    RuntimeError: Connection closed by peer; now fddp.RankFailureError."""
    outcome = _survivor(mode, killed()[mode][0])
    assert outcome["type"] == "RankFailureError", outcome
    assert outcome["rank_failure"]
    assert outcome["message"].startswith("fddp.save_sharded: a collective failed on rank")


# --- one process: the directory layout ------------------------------------------------------


def _data_dirs(path: Path) -> list[str]:
    import re

    return sorted(n for n in os.listdir(path) if re.fullmatch("shards-[0-9a-f]{16}", n))


def test_one_published_directory_and_orphans_removed(tmp_path: Path) -> None:
    """A save leaves the manifest and one data directory. A dead save's directory (unlocked,
    not published) goes at the next save; a locked one (a live save elsewhere), an empty new
    one (maybe not locked yet) and the directory a load holds stay until a later save."""
    import fcntl

    path = tmp_path / "ckpt"
    fddp.save_sharded(path, {"w": torch.zeros(3)})
    first = _data_dirs(path)
    fddp.save_sharded(path, {"w": torch.ones(3)})
    second = _data_dirs(path)
    assert len(first) == len(second) == 1 and first != second
    assert sorted(os.listdir(path)) == sorted([MANIFEST, *second])

    dead, live, fresh = (path / f"shards-{c * 16}" for c in "abc")
    for d in (dead, live):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    fresh.mkdir()
    others = [path / "shards-notes", path / "mine.txt"]  # not names save_sharded makes
    others[0].mkdir()
    others[1].write_text("keep")
    live_fd = os.open(live, os.O_RDONLY)
    fcntl.flock(live_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held = os.open(path / second[0], os.O_RDONLY)  # as a load in progress does
    fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
    try:
        fddp.save_sharded(path, {"w": torch.full((3,), 2.0)})
        left = set(os.listdir(path))
        assert dead.name not in left
        assert {live.name, fresh.name, second[0], *(o.name for o in others)} <= left
    finally:
        os.close(live_fd)
        os.close(held)
    assert_trees_equal(fddp.load_sharded(path, {"w": torch.zeros(3)}), {"w": torch.full((3,), 2.0)})
    old = time.time() - 3600
    os.utime(fresh, (old, old))
    fddp.save_sharded(path, {"w": torch.full((3,), 3.0)})
    assert sorted(os.listdir(path)) == sorted(
        [MANIFEST, *_data_dirs(path), "shards-notes", "mine.txt"]
    )
    assert len(_data_dirs(path)) == 1
    assert_trees_equal(fddp.load_sharded(path, {"w": torch.zeros(3)}), {"w": torch.full((3,), 3.0)})


def test_checkpoint_of_an_older_fddp_loads_and_is_replaced(tmp_path: Path) -> None:
    """A plain DCP directory (what save_sharded wrote before the manifest) loads through the
    same safe reader; the first save to it replaces it and removes its files."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "old"
    tree = {"w": torch.arange(3.0), "step": 4}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"['w']": tree["w"], "['step']": 4}, checkpoint_id=path, no_dist=True)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    assert_trees_equal(fddp.load_sharded(path, {"w": torch.zeros(3), "step": 0}), tree)
    fddp.save_sharded(path, {"w": torch.ones(3), "step": 5})
    assert sorted(os.listdir(path)) == sorted([MANIFEST, *_data_dirs(path)])
    got = fddp.load_sharded(path, {"w": torch.zeros(3), "step": 0})
    assert_trees_equal(got, {"w": torch.ones(3), "step": 5})


def test_broken_manifest_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    fddp.save_sharded(path, {"w": torch.ones(3)})
    manifest = path / MANIFEST
    good = manifest.read_text()
    like = {"w": torch.zeros(3)}
    manifest.write_text(good.replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(ValueError, match=r"corrupted or truncated \(fddp-sharded.json: SHA-256"):
        fddp.load_sharded(path, like)
    manifest.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"corrupted or truncated \(fddp-sharded.json is not JSON"):
        fddp.load_sharded(path, like)
    body = json.loads(good)
    body["version"] = 99
    manifest.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="format version 99, this fddp reads up to 1; upgrade"):
        fddp.load_sharded(path, like)


def test_without_locks_the_replaced_directory_still_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where flock is refused (as on some network file systems), a killed save's directory
    cannot be told from a live save's and stays, but the directory a save replaced, which has
    no writer, is removed: the checkpoint does not grow with every save."""
    import fcntl

    def refused(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refused)
    path = tmp_path / "ckpt"
    fddp.save_sharded(path, {"w": torch.zeros(3)})
    dead = path / ("shards-" + "d" * 16)
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"partial")
    for value in (1.0, 2.0):
        fddp.save_sharded(path, {"w": torch.full((3,), value)})
        assert sorted(os.listdir(path)) == sorted([MANIFEST, *_data_dirs(path)])
        assert len(_data_dirs(path)) == 2 and dead.name in _data_dirs(path)
    got = fddp.load_sharded(path, {"w": torch.zeros(3)})
    assert_trees_equal(got, {"w": torch.full((3,), 2.0)})
