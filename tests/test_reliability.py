"""Reliability: mismatches raise instead of hanging, NaN steps, dead ranks, resume, restarts.

Most of it runs in subprocesses, which cost seconds each (every process imports torch and traces
its step), so the ``jobs`` fixture starts them all at once, in the background, and the tests
collect their results: jobs that only wait (a stuck rank's timeout, a torchrun restart) overlap
with the ones that compute. Each job has a deadline after which its whole process tree is
killed, and the 2-rank spawn has one too: no test can hang.

- 2 gloo ranks (``run_ranks``): a rank-dependent collective, a batch width, a batch dtype and a
  parameter tree that differ across ranks, each an error on every rank; a NaN in one rank's
  batch skipped on both by ``apply_if_finite``.
- ``_reliability_scripts/stall.py`` with ``fddp.init(timeout=STALL_TIMEOUT_S)``: rank 1 dies,
  hangs, or alone changes its batch shape mid-training; rank 0 must fail, not hang.
- ``examples/elastic.py``: an uninterrupted run is the reference; a run killed after a
  checkpoint and resumed by new processes, a ``torchrun --max-restarts=1`` run whose rank 1
  crashes once, and a run on two torchrun "nodes" must all end with its parameters, bitwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import optree
import pytest
import torch
from _dist import free_port, run_ranks, torchrun_env

import fddp
import fddp.optim as optim

ROOT = Path(__file__).resolve().parent.parent
STALL_SCRIPT = Path(__file__).resolve().parent / "_reliability_scripts" / "stall.py"
ELASTIC = ROOT / "examples" / "elastic.py"
STALL_TIMEOUT_S = 10.0
JOB_TIMEOUT_S = 150.0
SPAWN_TIMEOUT_S = 150.0
OUTPUT_TAIL_CHARS = 5000
# examples/elastic.py: 24 steps cross an epoch (16 steps of 16 samples); checkpoints every 4.
STEPS, EVERY, STOP_AT, RESUMED_FROM = 24, 4, 14, 12
ELASTIC_ARGS = ["--steps", str(STEPS), "--every", str(EVERY), "--timeout", "60"]


# --- subprocess jobs ------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, taken together before any job binds one."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _base_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


class Job:
    """Processes started together (the ranks or torchrun nodes of one job), with one deadline.

    Each process writes stdout and stderr to its own file. :meth:`wait` returns once the chosen
    processes have exited, or at the deadline; :meth:`stop` kills every process tree left.
    """

    def __init__(self, name: str, commands: list[tuple[list[str], dict[str, str]]], tmp: Path):
        self.name = name
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.logs = [tmp / f"{name}.{i}.log" for i in range(len(commands))]
        self.procs: list[subprocess.Popen] = []
        self.ended_at: list[float | None] = [None] * len(commands)
        for (argv, env), log in zip(commands, self.logs):
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

    def wait(self, which: list[int] | None = None) -> Job:
        which = list(range(len(self.procs))) if which is None else which
        while time.monotonic() < self.deadline:
            for i in which:
                if self.ended_at[i] is None and self.procs[i].poll() is not None:
                    self.ended_at[i] = time.time()
            if all(self.ended_at[i] is not None for i in which):
                break
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for pid in _process_tree(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def returncodes(self) -> list[int | None]:
        return [p.returncode if t is not None else None for p, t in zip(self.procs, self.ended_at)]

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def describe(self) -> str:
        parts = [f"job {self.name}: return codes {self.returncodes()} (None: killed or running)"]
        for i in range(len(self.procs)):
            parts.append(
                f"--- process {i} output (tail) ---\n{self.output(i)[-OUTPUT_TAIL_CHARS:]}"
            )
        return "\n".join(parts)

    def assert_succeeded(self) -> None:
        self.wait()
        assert self.returncodes() == [0] * len(self.procs), self.describe()


def _ranks_job(name: str, tmp: Path, args: list[str], port: int, world: int = 2) -> Job:
    commands = [
        ([sys.executable, *args], {**_base_env(), **torchrun_env(r, world, port)})
        for r in range(world)
    ]
    return Job(name, commands, tmp)


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options]


class Jobs:
    """Every subprocess job of this module, started at once; the resumed job when it can be."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.all: list[Job] = []
        self._ports = iter(_free_ports(7))
        self.die = self._add(self._stall_job("die"))
        self.stuck = self._add(self._stall_job("stuck"))
        self.retrace = self._add(self._stall_job("retrace"))
        self.reference = self._add(self._elastic_job("reference", "reference", ["--no-donate"]))
        self.killed = self._add(self._elastic_job("killed", "resume", ["--kill-at", str(STOP_AT)]))
        env = {**_base_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env["FDDP_CRASH_AT_STEP"] = str(STOP_AT)
        restart = _torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1")
        restart += [str(ELASTIC), "--dir", str(tmp / "restarted"), *ELASTIC_ARGS]
        self.restarted = self._add(Job("restarted", [(restart, env)], tmp))
        self.two_nodes = self._add(Job("two_nodes", self._two_node_commands(), tmp))
        self._resumed: Job | None = None
        self._stopping = False
        self._resume_starter = threading.Thread(target=self._start_resumed, daemon=True)
        self._resume_starter.start()

    def _add(self, job: Job) -> Job:
        self.all.append(job)
        return job

    def _stall_job(self, mode: str) -> Job:
        ready = self.tmp / f"{mode}-ready"
        ready.mkdir()
        args = [str(STALL_SCRIPT), mode, str(STALL_TIMEOUT_S), str(ready)]
        return _ranks_job(mode, self.tmp, args, next(self._ports))

    def _elastic_job(self, name: str, directory: str, extra: list[str]) -> Job:
        args = [str(ELASTIC), "--dir", str(self.tmp / directory), *ELASTIC_ARGS, *extra]
        return _ranks_job(name, self.tmp, args, next(self._ports))

    def _two_node_commands(self) -> list[tuple[list[str], dict[str, str]]]:
        port = next(self._ports)
        common = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
        common += [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=fddp-two-nodes"]
        script = [str(ELASTIC), "--dir", str(self.tmp / "two_nodes"), *ELASTIC_ARGS]
        return [(_torchrun(*common, f"--node_rank={n}", *script), _base_env()) for n in (0, 1)]

    def _start_resumed(self) -> None:
        """As soon as the killed job has ended: new processes resume from its checkpoint."""
        self.killed.wait()
        if not self._stopping:
            self._resumed = self._add(self._elastic_job("resumed", "resume", []))

    def resumed(self) -> Job:
        self._resume_starter.join()
        assert self._resumed is not None
        return self._resumed

    def stop(self) -> None:
        self._stopping = True
        for job in self.all:
            job.stop()
        self._resume_starter.join()
        for job in self.all:
            job.stop()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    started = Jobs(tmp_path_factory.mktemp("reliability"))
    try:
        yield started
    finally:
        started.stop()


# --- 2 ranks in one spawn: mismatches and the NaN policy -----------------------------------


def _flat(tree) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in optree.tree_leaves(tree)])


def _loss(params, x):
    return sum((torch.tanh(x @ w) ** 2).mean() for w in params.values())


def _sgd_step(params, x):
    loss, grads = fddp.value_and_grad(_loss)(params, x)
    grads = fddp.pmean(grads)
    return {k: params[k] - 0.1 * grads[k] for k in params}, fddp.pmean(loss)


def _params(extra_on_rank1: bool = False) -> dict[str, torch.Tensor]:
    params = {"w": torch.ones(4, 3)}
    if extra_on_rank1 and fddp.rank() == 1:
        params["v"] = torch.ones(4, 3)
    return params


def _rank_branch():
    def step(params, x):
        params, loss = _sgd_step(params, x)
        if fddp.rank() == 1:  # resolved when the step is traced: rank 1 has one more collective
            loss = loss + fddp.psum(x.sum())
        return params, loss

    return fddp.data_parallel(step)(_params(), torch.ones(2, 4))


def _batch_width():
    def step(params, x):
        params, loss = _sgd_step(params, x[:, :4])
        return params, loss, fddp.psum(x.mean(0))

    return fddp.data_parallel(step)(_params(), torch.ones(2, 4 + fddp.rank()))


def _batch_dtype():
    dtype = torch.float64 if fddp.rank() == 1 else torch.float32
    return fddp.data_parallel(_sgd_step)(_params(), torch.ones(2, 4, dtype=dtype))


def _tree_unchecked():
    step = fddp.data_parallel(_sgd_step, check_replicas=False)
    return step(_params(extra_on_rank1=True), torch.ones(2, 4))


def _tree_checked():
    return fddp.data_parallel(_sgd_step)(_params(extra_on_rank1=True), torch.ones(2, 4))


NAN_STEP = 1


def _nan_policy() -> list[dict]:
    """4 steps of AdamW under apply_if_finite; at step NAN_STEP rank 1's batch holds a NaN."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    opt = optim.apply_if_finite(optim.adamw(lr=0.1), max_consecutive_errors=2)

    def loss_fn(params, x):
        return (torch.tanh(x @ params["w"] + params["b"]) ** 2).mean()

    @fddp.data_parallel
    def step(params, opt_state, x):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    opt_state = opt.init(params)
    g = torch.Generator().manual_seed(1 + fddp.rank())
    history = [{"params": _flat(params)}]
    for i in range(4):
        x = torch.randn(2, 4, generator=g)
        if i == NAN_STEP and fddp.rank() == 1:
            x[0, 0] = math.nan
        params, opt_state, loss = step(params, opt_state, x)
        history.append(
            {
                "params": _flat(params),
                "loss": float(loss),
                "notfinite_count": int(opt_state.notfinite_count),
                "total_notfinite": int(opt_state.total_notfinite),
                "adam_count": int(opt_state.inner_state[0].count),
            }
        )
    return history


# Run in this order on both ranks.
CHECKS: list[tuple[str, Callable]] = [
    ("rank_branch", _rank_branch),
    ("batch_width", _batch_width),
    ("batch_dtype", _batch_dtype),
    ("tree_unchecked", _tree_unchecked),
    ("nan_policy", _nan_policy),
    ("tree_checked", _tree_checked),
]


def _checks_worker(out_dir: str) -> None:
    """Run CHECKS; each rank pickles each outcome to a file at once, so a crash loses none."""
    for name, check in CHECKS:
        start = time.monotonic()
        try:
            outcome = {"value": check()}
        except Exception as e:
            outcome = {"error": type(e).__name__, "message": str(e)}
            outcome["traceback"] = traceback.format_exc()
        outcome["seconds"] = time.monotonic() - start
        if "value" in outcome and name != "nan_policy":
            outcome["value"] = None
        with open(Path(out_dir) / f"{name}.{fddp.rank()}.pkl", "wb") as f:
            pickle.dump(outcome, f)


@pytest.fixture(scope="module")
def checks(jobs: Jobs, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """``checks(name)``: the outcome of check ``name`` on each rank.

    Asks for ``jobs`` only to start the subprocess jobs first: they run while this spawn does.
    """
    out_dir = tmp_path_factory.mktemp("checks")
    try:
        run_ranks(_checks_worker, 2, str(out_dir), timeout=SPAWN_TIMEOUT_S)
        spawn_error = None
    except AssertionError as e:
        spawn_error = str(e)

    def outcome(name: str) -> list[dict]:
        files = [out_dir / f"{name}.{r}.pkl" for r in range(2)]
        if not all(f.exists() for f in files):
            pytest.fail(f"check {name} left no outcome on some rank:\n{spawn_error}", pytrace=False)
        return [pickle.loads(f.read_bytes()) for f in files]

    return outcome


def _errors(outcomes: list[dict], error: str) -> list[str]:
    """The messages, after asserting every rank raised ``error`` well before any timeout."""
    for r, o in enumerate(outcomes):
        assert o.get("error") == error, f"rank {r}: expected {error}, got {o}"
        assert o["seconds"] < 60, f"rank {r} took {o['seconds']:.1f} s to raise"
    return [o["message"] for o in outcomes]


def test_rank_dependent_collective_raises_on_every_rank(checks):
    for message in _errors(checks("rank_branch"), "ScheduleMismatchError"):
        assert "rank 1" in message
        assert re.search(r"collective #\d+ is all_reduce\w*\(1, torch.float32", message), message
        assert "<none> on rank 0" in message


def test_batch_width_that_changes_a_collective_raises_on_every_rank(checks):
    for message in _errors(checks("batch_width"), "ScheduleMismatchError"):
        assert "rank 1" in message
        in_collective = "(5, torch.float32" in message and "(4, torch.float32" in message
        in_arguments = "[2, 5]" in message and "[2, 4]" in message
        assert in_collective or in_arguments, message


def test_batch_dtype_that_changes_a_collective_raises_on_every_rank(checks):
    for message in _errors(checks("batch_dtype"), "ScheduleMismatchError"):
        assert "rank 1" in message and "torch.float64" in message, message


def test_parameter_tree_mismatch_raises_on_every_rank_without_replica_check(checks):
    for message in _errors(checks("tree_unchecked"), "ScheduleMismatchError"):
        assert "rank 1" in message


def test_parameter_tree_mismatch_raises_on_every_rank_with_replica_check(checks):
    for message in _errors(checks("tree_checked"), "ReplicaMismatchError"):
        assert "['v']" in message


def test_nan_on_one_rank_skips_the_update_on_every_rank(checks):
    histories = [o["value"] for o in checks("nan_policy")]
    for r, history in enumerate(histories):
        before, skipped, after = history[NAN_STEP], history[NAN_STEP + 1], history[NAN_STEP + 2]
        assert math.isnan(skipped["loss"])
        assert torch.equal(skipped["params"], before["params"]), f"rank {r} applied the update"
        assert (skipped["notfinite_count"], skipped["total_notfinite"]) == (1, 1)
        assert skipped["adam_count"] == before["adam_count"] == 1
        assert not torch.equal(after["params"], skipped["params"]), f"rank {r} stopped training"
        assert (after["notfinite_count"], after["total_notfinite"], after["adam_count"]) == (
            0,
            1,
            2,
        )
        assert torch.isfinite(history[-1]["params"]).all()
    for i, (a, b) in enumerate(zip(*histories)):
        assert torch.equal(a["params"], b["params"]), f"ranks differ after step {i}"


# --- apply_if_finite in one process ---------------------------------------------------------


def test_apply_if_finite_skips_nan_and_inf_and_keeps_the_inner_state():
    inner = optim.adam(lr=0.1)
    opt = optim.apply_if_finite(inner, max_consecutive_errors=5)
    params = {"w": torch.tensor([1.0, -2.0])}
    state = opt.init(params)
    updates, state = opt.update({"w": torch.tensor([0.5, 0.5])}, state, params)
    params = optim.apply_updates(params, updates)
    kept = (params, state.inner_state)
    for bad in (math.nan, math.inf, -math.inf):
        updates, state = opt.update({"w": torch.tensor([bad, 0.5])}, state, params)
        assert torch.equal(optim.apply_updates(params, updates)["w"], params["w"])
        assert not state.last_finite
    assert int(state.notfinite_count) == int(state.total_notfinite) == 3
    assert optree.tree_all(optree.tree_map(torch.equal, state.inner_state, kept[1]))
    updates, state = opt.update({"w": torch.tensor([0.5, 0.5])}, state, params)
    assert int(state.inner_state[1].count) == 2 and bool(state.last_finite)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (0, 3)


def test_apply_if_finite_applies_after_max_consecutive_errors():
    opt = optim.apply_if_finite(optim.sgd(lr=1.0), max_consecutive_errors=1)
    params = [torch.tensor(1.0)]
    state = opt.init(params)
    nan = [torch.tensor(math.nan)]
    first, state = opt.update(nan, state, params)
    second, state = opt.update(nan, state, params)
    assert first[0].item() == 0.0
    assert math.isnan(second[0])


def test_apply_if_finite_rejects_negative_max_consecutive_errors():
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        optim.apply_if_finite(optim.sgd(lr=1.0), max_consecutive_errors=-1)


# --- a dead, a stuck and a diverging rank ---------------------------------------------------


def _stall_times(job: Job, rank: int) -> tuple[float, float, str]:
    """(seconds from rank 1 stopping to ``rank``'s error, to its exit; the error line)."""
    stop = re.search(r"fddp-stall: rank 1 stops at ([\d.]+)", job.output(1))
    error = re.search(rf"fddp-stall: rank {rank} error at ([\d.]+) (.*)", job.output(rank))
    assert stop and error, job.describe()
    stopped = float(stop.group(1))
    to_error = float(error.group(1)) - stopped
    to_exit = job.ended_at[rank] - stopped if job.ended_at[rank] is not None else math.inf
    print(f"{job.name}: rank {rank} raised {to_error:.2f} s, exited {to_exit:.2f} s after the stop")
    return to_error, to_exit, error.group(2)


def test_dead_rank_makes_the_survivor_raise_within_the_timeout(jobs):
    job = jobs.die.wait()
    assert job.returncodes() == [1, 1], job.describe()
    to_error, to_exit, error = _stall_times(job, 0)
    assert to_error < STALL_TIMEOUT_S, job.describe()
    assert to_exit < STALL_TIMEOUT_S + 60, job.describe()
    assert error.startswith("(a RuntimeError)") and "Connection" in error, error


def test_stuck_rank_makes_the_other_raise_after_the_timeout(jobs):
    job = jobs.stuck.wait([0])
    job.stop()
    assert job.returncodes()[0] == 1, job.describe()
    to_error, to_exit, error = _stall_times(job, 0)
    assert STALL_TIMEOUT_S / 2 < to_error < STALL_TIMEOUT_S + 15, job.describe()
    assert to_exit < STALL_TIMEOUT_S + 60, job.describe()
    assert error.startswith("(a RuntimeError)") and "Timed out" in error, error


def test_batch_shape_change_on_one_rank_raises_at_once(jobs):
    job = jobs.retrace.wait()
    for rank in (0, 1):
        to_error, _, error = _stall_times(job, rank)
        assert to_error < STALL_TIMEOUT_S / 2, f"rank {rank}: {to_error:.1f} s: {error}"
        assert "rank 1" in error, error


# --- checkpoints: exact resume, elastic restart, two nodes ----------------------------------


def _final_params(job: Job, directory: Path) -> dict[str, torch.Tensor]:
    """The parameters a job's rank 0 saved at the end; every rank must print the same digest."""
    job.assert_succeeded()
    output = "".join(job.output(i) for i in range(len(job.procs)))
    digests = re.findall(r"rank (\d): final params sha256 (\w+)", output)
    assert sorted(r for r, _ in digests) == ["0", "1"], job.describe()
    assert len({d for _, d in digests}) == 1, f"ranks ended with different parameters: {digests}"
    return fddp.load(directory / "final.pt")


def _assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs"


@pytest.fixture(scope="module")
def reference_params(jobs: Jobs) -> dict[str, torch.Tensor]:
    return _final_params(jobs.reference, jobs.tmp / "reference")


def test_resume_after_kill_is_bitwise_exact(jobs, reference_params):
    killed = jobs.killed.wait()
    assert killed.returncodes() == [-signal.SIGKILL] * 2, killed.describe()
    resumed = jobs.resumed()
    params = _final_params(resumed, jobs.tmp / "resume")
    for rank in (0, 1):
        assert f"rank {rank}: resumed from" in resumed.output(rank), resumed.describe()
        assert f"at step {RESUMED_FROM}" in resumed.output(rank), resumed.describe()
    _assert_bitwise_equal(params, reference_params)


def test_torchrun_restart_after_a_crash_ends_like_an_uninterrupted_run(jobs, reference_params):
    job = jobs.restarted
    params = _final_params(job, jobs.tmp / "restarted")
    output = job.output(0)
    assert f"FDDP_CRASH_AT_STEP: rank 1 crashes at step {STOP_AT}" in output, job.describe()
    assert output.count(f"resumed from {jobs.tmp / 'restarted'}") == 2, job.describe()
    _assert_bitwise_equal(params, reference_params)


def test_two_torchrun_nodes_train_like_one(jobs, reference_params):
    params = _final_params(jobs.two_nodes, jobs.tmp / "two_nodes")
    _assert_bitwise_equal(params, reference_params)
