"""fddp.recoverable: ranks killed inside a step (before, during and after the all-reduce) and a
stopped rank; the survivors keep training and end where full-batch training ends. Under
python -m fddp.run (invariant mode, dropout): two kills in one regroup and their replacements,
a straggler expelled, the store's host killed, each bitwise the run without failures; and a
failure after the store was lost, ending with the error that says so. Every run starts at once,
in one module fixture: most of their time is waiting (timeouts, settle windows)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from _dist import process_tree, script_env
from _recovery_scripts import common

WORKER = Path(__file__).parent / "_recovery_scripts" / "worker.py"
TIMEOUT_S = 6.0
SETTLE_S = 2.5  # the 2-core CI machine can hold a process off the CPU for over a second
# world A, invariant mode: 4 members; member 3 dies in the forward pass of step 1, member 1 in
# the backward pass of its last micro-batch in step 3, member 0 (the store does not depend on
# it) in the optimizer update of step 5, after the reduction. World D: one process, invariant
# mode, no failure: A must end bitwise equal to it.
KILLS = "3:1:forward,1:3:backward,0:5:tail"
# world B, default mode, state donated: 3 members, 9 micro-batches (3 each; 5 and 4 once 2 are
# left: the short one pads); member 1 stops (SIGSTOP) in step 2 and is found by the collective
# timeout; member 2 dies in step 4 in the backward pass of its last micro-batch, after the
# first bucket's all-reduce was launched (the other member is inside it).
STOPS = "1:2:stop,2:4:backward"
MICRO_B = 9
# a replacement (id 3) joins world B: admitted at the boundary of step JOIN_WAIT + 2
JOIN_WAIT = 5
# Under python -m fddp.run, 3 workers each, invariant mode with dropout, against "exact": one
# process, no failure. "kills": member 1 dies in step 1, member 2 right after registering as a
# survivor (a second failure inside the regroup); two replacements join once registered (the
# members wait at step 4). "straggler": member 1 sleeps SLOW_S in step 2's forward pass.
# "host": the launcher (the store's host) is SIGKILLed while the members wait before step 3.
# "lost" (2 members started here): the test drops its store while they wait before step 3;
# member 1 dies in step 4.
EXACT = {"FDDP_TEST_INVARIANT": "1", "FDDP_TEST_DROPOUT": "1"}
SLOW_S = TIMEOUT_S + 3 * SETTLE_S  # the straggler registers 3 x settle after the others
LAUNCHED = {
    "kills": (
        ["--max-replacements", "2"],
        {
            "FDDP_TEST_KILL": "1:1:forward",
            "FDDP_TEST_KILL_IN_REGROUP": "2",
            "FDDP_TEST_WAIT_JOIN_AT": "4",
            "FDDP_TEST_WAIT_JOINS": "2",
        },
    ),
    "straggler": (
        [],
        {
            "FDDP_TEST_KILL": "1:2:slow",
            "FDDP_TEST_SLOW_S": str(SLOW_S),
        },
    ),
    "host": ([], {"FDDP_TEST_PAUSE_AT": "3"}),
}


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip


def _start(
    ids: range, world: int, kill: str, store: dist.TCPStore, out: Path, **env: str
) -> list[subprocess.Popen]:
    environ = script_env(
        FDDP_TEST_KILL=kill,
        FDDP_TEST_TIMEOUT=str(TIMEOUT_S),
        FDDP_TEST_SETTLE=str(SETTLE_S),
        **env,
    )
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                str(world),
                str(store.port),
                str(out / f"{r}.pt"),
            ],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in ids
    ]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _finish(
    procs: list[subprocess.Popen], deadline: float, meanwhile: Callable[[], None]
) -> list[int | None]:
    """Wait for every member to exit or stop (calling ``meanwhile``); kill the stopped ones;
    their exit codes."""
    while time.monotonic() < deadline:
        running = [p for p in procs if p.poll() is None]
        if all(_stopped(p.pid) for p in running):
            break
        meanwhile()
        time.sleep(0.1)
    codes = []
    for p in procs:
        if p.poll() is None and not _stopped(p.pid):
            p.send_signal(signal.SIGUSR1)  # the worker prints every thread's stack
            time.sleep(0.5)
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)  # stopped (or hung: the assertions on its output fail)
        else:
            codes.append(p.returncode)
    return codes


def _env(**extra: str) -> dict[str, str]:
    timing = {"FDDP_TEST_TIMEOUT": str(TIMEOUT_S), "FDDP_TEST_SETTLE": str(SETTLE_S)}
    return script_env(**{**timing, **extra})


def _logged(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _steps(directory: Path, ids: range) -> list[int]:
    files = [directory / f"{u}.step" for u in ids]
    return [int(f.read_text() or 0) for f in files if f.exists()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


class Launches:
    """The fddp.run scenarios, the exact reference and the "lost" pair: started at once, moved
    on by :meth:`poke` (kill the host, drop the store) while the test waits for anything."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs = {name: root / name for name in (*LAUNCHED, "exact", "lost")}
        for d in self.dirs.values():
            d.mkdir()
        exact = [sys.executable, str(WORKER), str(self.dirs["exact"])]
        self.procs = {"exact": _logged(exact, _env(**EXACT), root / "exact.log")}
        for name, (options, env) in LAUNCHED.items():
            command = [sys.executable, "-m", "fddp.run", "--standalone", "--nproc-per-node", "3"]
            command += [*options, str(WORKER), str(self.dirs[name])]
            self.procs[name] = _logged(command, _env(**EXACT, **env), root / f"{name}.log")
        self.store: dist.TCPStore | None = _store()
        port, lost = str(self.store.port), self.dirs["lost"]
        self.lost = [
            _logged(
                [sys.executable, str(WORKER), str(u), "2", port, str(lost / f"{u}.pt")],
                _env(FDDP_TEST_KILL="1:4:forward", FDDP_TEST_PAUSE_AT="3"),
                root / f"lost{u}.log",
            )
            for u in range(2)
        ]
        self.orphans: list[int] = []  # the host's workers, once their launcher is killed

    def poke(self) -> None:
        host = self.procs["host"]
        if host.poll() is None and _steps(self.dirs["host"], range(3)) == [3, 3, 3]:
            self.orphans = process_tree(host.pid)[1:]
            host.kill()
            (self.dirs["host"] / "go").touch()
        if self.store is not None and _steps(self.dirs["lost"], range(2)) == [3, 3]:
            self.store = None
            gc.collect()  # the last reference to the master store: its server stops
            (self.dirs["lost"] / "go").touch()

    def finish(self, deadline: float) -> tuple[dict, dict, dict]:
        """Wait for every process (the host's orphaned workers too), kill what is left; the
        exit codes, the logs' tails and what each worker wrote."""
        everything = [*self.procs.values(), *self.lost]
        try:
            while time.monotonic() < deadline:
                self.poke()
                if all(p.poll() is not None for p in everything) and not any(
                    _alive(pid) for pid in self.orphans
                ):
                    break
                time.sleep(0.1)
        finally:
            for pid in [pid for p in everything for pid in process_tree(p.pid)] + self.orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        codes = {name: p.wait() for name, p in self.procs.items()}
        codes["lost"] = [p.wait() for p in self.lost]
        logs = {
            name: (self.root / f"{name}.log").read_text(errors="replace") for name in self.procs
        }
        logs["lost"] = "".join(
            (self.root / f"lost{u}.log").read_text(errors="replace") for u in (0, 1)
        )
        results = {
            name: {int(f.stem): torch.load(f, weights_only=False) for f in d.glob("*.pt")}
            for name, d in self.dirs.items()
        }
        return codes, {name: log[-4000:] for name, log in logs.items()}, results


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("launch"))


def _reference(micro_batches: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch each step, torch.optim.AdamW."""
    params = {k: v.clone().requires_grad_() for k, v in common.initial_params().items()}
    opt = torch.optim.AdamW(params.values(), lr=common.LR, weight_decay=common.WEIGHT_DECAY)
    for step in range(common.STEPS):
        batch = common.global_batch(step, micro_batches)
        h = torch.tanh(batch["x"] @ params["w1"] + params["b1"])
        loss = F.mse_loss(h @ params["w2"] + params["b2"], batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, launches: Launches):
    a, b = tmp_path_factory.mktemp("kills"), tmp_path_factory.mktemp("stop")
    store_a, store_b = _store(), _store()
    d = tmp_path_factory.mktemp("reference")
    store_d = _store()
    procs_a = _start(range(4), 4, KILLS, store_a, a, FDDP_TEST_INVARIANT="1")
    procs_d = _start(range(1), 1, "", store_d, d, FDDP_TEST_INVARIANT="1")
    e, store_e = tmp_path_factory.mktemp("options"), _store()  # built with another admit_every
    procs_e = _start(range(1), 2, "", store_e, e, FDDP_TEST_ADMIT_EVERY="1")
    procs_e += _start(range(1, 2), 2, "", store_e, e, FDDP_TEST_ADMIT_EVERY="2")
    env_b = {
        "FDDP_TEST_MICRO": str(MICRO_B),
        "FDDP_TEST_WAIT_JOIN_AT": str(JOIN_WAIT),
        "FDDP_TEST_DONATE": "1",  # a failed step may have written into the state: restored
    }
    procs_b = _start(range(3), 3, STOPS, store_b, b, **env_b)
    deadline = time.monotonic() + 240
    # the replacement starts once the survivors of the stop have agreed (it then registers
    # while they train; they wait for it at step JOIN_WAIT and admit it at JOIN_WAIT + 2)
    while time.monotonic() < deadline and not store_b.check(["fddp-recoverable/g0/roster"]):
        launches.poke()
        time.sleep(0.1)
    procs_b += _start(range(3, 4), 3, "", store_b, b, FDDP_TEST_JOIN="1", **env_b)
    started = {"a": procs_a, "b": procs_b, "d": procs_d, "e": procs_e}
    codes = {name: _finish(procs, deadline, launches.poke) for name, procs in started.items()}
    logs = {
        name: [p.stdout.read().decode(errors="replace")[-3000:] for p in procs]
        for name, procs in started.items()
    }
    del store_a, store_b, store_d, store_e
    out = {}
    for name, directory, world in (("a", a, 4), ("b", b, 4), ("d", d, 1)):
        out[name] = {
            r: torch.load(directory / f"{r}.pt", weights_only=False)
            for r in range(world)
            if (directory / f"{r}.pt").exists()
        }
    return codes, logs, out


def test_kills_before_during_and_after_the_all_reduce(runs):
    codes, logs, out = runs
    assert codes["a"] == [-9, -9, 0, -9], logs["a"]
    (survivor,) = out["a"].values()
    assert survivor["recovered_steps"] == (1, 3, 6)  # the tail kill: step 5 had committed
    assert survivor["lost"] == [(3,), (1,), (0,)]
    assert (survivor["generation"], survivor["members"]) == (3, (2,))
    assert codes["d"] == [0], logs["d"]
    uninterrupted = out["d"][0]
    assert uninterrupted["recovered_steps"] == ()
    # invariant mode: three failures change no bit of the parameters or the optimizer state
    assert_trees_equal(
        (survivor["params"], survivor["opt_state"]),
        (uninterrupted["params"], uninterrupted["opt_state"]),
    )
    assert_trees_close(survivor["params"], _reference(common.MICRO_BATCHES), rtol=1e-5, atol=1e-6)


def test_stopped_and_killed_ranks_are_dropped_and_a_replacement_joins(runs):
    codes, logs, out = runs
    assert codes["b"] == [0, None, -9, 0], logs["b"]
    assert sorted(out["b"]) == [0, 3]
    first, replacement = out["b"][0], out["b"][3]
    assert first["recovered_steps"] == (2, 4)
    assert first["lost"] == [(1,), (2,)]
    assert (replacement["recovered_steps"], replacement["lost"]) == ((), [])
    for result in (first, replacement):
        assert (result["generation"], result["members"]) == (3, (0, 3))
    assert_trees_close(first["params"], _reference(MICRO_B), rtol=1e-5, atol=1e-6)
    # the survivor and the replacement stay replicas: bitwise the same state
    assert_trees_equal(
        (replacement["params"], replacement["opt_state"]), (first["params"], first["opt_state"])
    )


def test_unrecoverable_state_is_refused_with_the_alternative(runs):
    _, logs, out = runs
    refused = out["b"][0]["refused"]
    assert set(refused) == {"shard_state", "diloco"}, logs["b"]
    assert "fddp.optim.shard_state" in refused["shard_state"]
    assert "save_sharded" in refused["shard_state"]
    assert "fddp.diloco" in refused["diloco"]


def test_members_built_with_other_options_refuse_the_first_step(runs):
    codes, logs, _ = runs
    assert codes["e"] == [1, 1], logs["e"]
    for log in logs["e"]:
        assert "ScheduleMismatchError" in log and "recoverable admit_every" in log, log


@pytest.fixture
def no_default_group():
    """No default group while the test runs (recoverable forms its own); an earlier test's
    ``fddp.init()`` group is replaced by a fresh one afterwards, for the tests that follow."""
    had = dist.is_initialized()
    if had:
        dist.destroy_process_group()
    yield
    if had and not dist.is_initialized():
        import fddp

        fddp.init()


def test_rejects_bad_options_before_forming_a_group(no_default_group):
    import fddp

    opt = fddp.optim.sgd(0.1)
    store = dist.HashStore()
    with pytest.raises(ValueError, match="micro_batches=2 must be an int >= world_size"):
        fddp.recoverable(lambda p, b: p, opt, store=store, rank=0, world_size=3, micro_batches=2)
    with pytest.raises(ValueError, match="rank=3 is not in range"):
        fddp.recoverable(lambda p, b: p, opt, store=store, rank=3, world_size=3, micro_batches=3)
    with pytest.raises(ValueError, match="admit_every=0 must be an int >= 1"):
        fddp.recoverable(
            lambda p, b: p, opt, store=store, rank=0, world_size=1, micro_batches=1, admit_every=0
        )
    with pytest.raises(ValueError, match="invariant= with compile=True"):
        fddp.recoverable(
            lambda p, b: p,
            opt,
            store=store,
            rank=0,
            world_size=1,
            micro_batches=1,
            invariant=True,
            compile=True,
        )
    # invariant mode on 3 members that may shrink to 2 or 1: 9 micro-batches do not split over 2
    shrinks = r"micro_batches=9 does not split evenly over 2 members.*any of 3, 2 or 1 members"
    with pytest.raises(ValueError, match=shrinks):
        fddp.recoverable(
            lambda p, b: p, opt, store=store, rank=0, world_size=3, micro_batches=9, invariant=True
        )
    with pytest.raises(ValueError, match="min_world_size=4 must be an int in"):
        fddp.recoverable(
            lambda p, b: p,
            opt,
            store=store,
            rank=0,
            world_size=3,
            micro_batches=9,
            min_world_size=4,
        )
    assert not dist.is_initialized()


def test_refuses_torchrun_and_names_the_launcher(no_default_group, monkeypatch):
    import fddp

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # what torchrun's agent sets
    monkeypatch.delenv("FDDP_RUN", raising=False)
    with pytest.raises(ValueError, match=r"python -m fddp\.run"):
        fddp.recoverable(lambda p, b: p, fddp.optim.sgd(0.1), micro_batches=1)
    with pytest.raises(SystemExit):  # fddp.run replaces workers; it does not restart them
        fddp.run.main(["--max-restarts", "1", "train.py"])
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def launched(runs, launches: Launches):
    return launches.finish(time.monotonic() + 120)


def _assert_like_exact(results, name: str, members: tuple[int, ...]) -> None:
    (exact,) = results["exact"].values()
    assert exact["recovered_steps"] == ()
    for u in members:
        done = results[name][u]
        assert done["members"] == members, done
        # invariant mode, dropout keyed by micro-batch, the generators put back after a failed
        # attempt and handed to replacements: no bit of the parameters, the optimizer state or
        # the generator differs from the run without failures
        assert_trees_equal(
            (done["params"], done["opt_state"], done["rng"]),
            (exact["params"], exact["opt_state"], exact["rng"]),
        )


def test_launched_two_kills_in_one_regroup_then_two_replacements(launched):
    codes, logs, results = launched
    assert codes["kills"] == 0, logs["kills"]
    assert sorted(results["kills"]) == [0, 3, 4], logs["kills"]
    first = results["kills"][0]
    assert (first["recovered_steps"], first["lost"]) == ((1,), [(1, 2)]), logs["kills"]
    # the regroup without 1, again without 2, then one admission of both replacements or one
    # each, as their registrations fall on the same admission poll or on two
    assert first["generation"] in (3, 4)
    assert set(first["members"]) == {0, 3, 4}
    _assert_like_exact(results, "kills", first["members"])


def test_launched_straggler_is_expelled_and_the_others_go_on(launched):
    codes, logs, results = launched
    assert codes["straggler"] == 0, logs["straggler"]
    assert "was expelled" in results["straggler"][1]["error"], logs["straggler"]
    first = results["straggler"][0]
    assert (first["recovered_steps"], first["lost"]) == ((2,), [(1,)]), logs["straggler"]
    _assert_like_exact(results, "straggler", (0, 2))


def test_launched_killing_the_store_host_does_not_stop_a_healthy_job(launched):
    codes, logs, results = launched
    assert codes["host"] == -signal.SIGKILL
    assert sorted(results["host"]) == [0, 1, 2], logs["host"]
    assert {(r["generation"], r["recovered_steps"]) for r in results["host"].values()} == {(0, ())}
    _assert_like_exact(results, "host", (0, 1, 2))


def test_a_failure_after_the_store_was_lost_says_so(launched):
    codes, logs, results = launched
    assert codes["lost"] == [1, -signal.SIGKILL], logs["lost"]
    assert "the store was lost" in results["lost"][0]["error"], logs["lost"]
