"""Reliability: mismatches raise instead of hanging, NaN steps, dead ranks, resume, restarts.

Most of it runs in subprocesses (tests/_dist.py's ``Job``), which cost seconds each, so the
``jobs`` fixture starts them all at once, in the background, and the tests collect their
results: jobs that only wait (a stuck rank's timeout, a torchrun restart) overlap with the ones
that compute. The scripts' ranks fork from the fork server, which has imported torch and fddp
already; torchrun starts its own workers. Each job has a deadline after which its whole process
tree is killed, and the 2-rank run has one too: no test can hang.

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

import math
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import optree
import pytest
import torch
from _compare import assert_ranks_equal, assert_trees_equal, detached
from _dist import ROOT, Job, Raised, free_ports, run_checks, script_env, torchrun

import fddp
import fddp.optim as optim

STALL_SCRIPT = Path(__file__).resolve().parent / "_reliability_scripts" / "stall.py"
ELASTIC = ROOT / "examples" / "elastic.py"
STALL_TIMEOUT_S = 10.0
JOB_TIMEOUT_S = 150.0
SPAWN_TIMEOUT_S = 150.0
# examples/elastic.py: 24 steps cross an epoch (16 steps of 16 samples); checkpoints every 4.
STEPS, EVERY, STOP_AT, RESUMED_FROM = 24, 4, 14, 12
ELASTIC_ARGS = ["--steps", str(STEPS), "--every", str(EVERY), "--timeout", "60"]


# --- subprocess jobs (tests/_dist.py's Job), all started at once ------------------------------


class Jobs:
    """Every subprocess job of this module, started at once; the resumed job when it can be."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.all: list[Job] = []
        self._ports = iter(free_ports(6))
        self.die = self._add(self._stall_job("die"))
        self.stuck = self._add(self._stall_job("stuck"))
        self.retrace = self._add(self._stall_job("retrace"))
        reference = self._elastic_job("reference", "reference", ["--no-donate"], next(self._ports))
        self.reference = self._add(reference)
        kill_at = ["--kill-at", str(STOP_AT)]
        killed = self._elastic_job("killed", "resume", kill_at, next(self._ports))
        self.killed = self._add(killed)
        env = script_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", FDDP_CRASH_AT_STEP=str(STOP_AT))
        restart = torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1")
        restart += [str(ELASTIC), "--dir", str(tmp / "restarted"), *ELASTIC_ARGS]
        self.restarted = self._add(Job("restarted", [(restart, env)], tmp, JOB_TIMEOUT_S))
        self.two_nodes = self._add(Job("two_nodes", self._two_node_commands(), tmp, JOB_TIMEOUT_S))
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
        return Job.ranks(
            mode, self.tmp, args, port=next(self._ports), timeout=JOB_TIMEOUT_S, forked=True
        )

    def _elastic_job(self, name: str, directory: str, extra: list[str], port: int | None) -> Job:
        args = [str(ELASTIC), "--dir", str(self.tmp / directory), *ELASTIC_ARGS, *extra]
        return Job.ranks(name, self.tmp, args, port=port, timeout=JOB_TIMEOUT_S, forked=True)

    def _two_node_commands(self) -> list[tuple[list[str], dict[str, str]]]:
        port = next(self._ports)
        common = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
        common += [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=fddp-two-nodes"]
        script = [str(ELASTIC), "--dir", str(self.tmp / "two_nodes"), *ELASTIC_ARGS]
        return [(torchrun(*common, f"--node_rank={n}", *script), script_env()) for n in (0, 1)]

    def _start_resumed(self) -> None:
        """As soon as the killed job has ended: new processes resume from its checkpoint."""
        self.killed.wait()
        if not self._stopping:
            # a port free now, not one taken with the others seconds ago
            self._resumed = self._add(self._elastic_job("resumed", "resume", [], None))

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
    history = [{"params": detached(params)}]
    for i in range(4):
        x = torch.randn(2, 4, generator=g)
        if i == NAN_STEP and fddp.rank() == 1:
            x[0, 0] = math.nan
        params, opt_state, loss = step(params, opt_state, x)
        history.append(
            {
                "params": detached(params),
                "loss": float(loss),
                "notfinite_count": int(opt_state.notfinite_count),
                "total_notfinite": int(opt_state.total_notfinite),
                "adam_count": int(opt_state.inner_state[0].count),
            }
        )
    return history


# Run in this order on both ranks, in one spawn.
CHECKS: dict[str, Callable] = {
    "rank_branch": _rank_branch,
    "batch_width": _batch_width,
    "batch_dtype": _batch_dtype,
    "tree_unchecked": _tree_unchecked,
    "nan_policy": _nan_policy,
    "tree_checked": _tree_checked,
}


@pytest.fixture(scope="module")
def checks(jobs: Jobs):
    """The named outcomes of CHECKS on each rank.

    Asks for ``jobs`` only to start the subprocess jobs first: they run while this spawn does.
    """
    return run_checks(CHECKS, 2, timeout=SPAWN_TIMEOUT_S)


def _errors(checks, name: str, error: str) -> list[str]:
    """The messages, after asserting every rank raised ``error``.

    The kind of error is the proof that no rank waited for a timeout: a rank stuck in a
    collective ends with the process group's error, or the spawn's timeout, never ``error``.
    How long raising took is not asserted: it includes the first compile, which a loaded
    machine can stretch to minutes.
    """
    outcomes = checks.outcomes(name)
    for r, o in enumerate(outcomes):
        assert isinstance(o, Raised) and o.error == error, f"rank {r}: expected {error}, got {o}"
    return [o.message for o in outcomes]


def test_rank_dependent_collective_raises_on_every_rank(checks):
    for message in _errors(checks, "rank_branch", "ScheduleMismatchError"):
        assert "rank 1" in message
        assert re.search(r"collective #\d+ is all_reduce\w*\(1, torch.float32", message), message
        assert "<none> on rank 0" in message


def test_batch_width_that_changes_a_collective_raises_on_every_rank(checks):
    for message in _errors(checks, "batch_width", "ScheduleMismatchError"):
        assert "rank 1" in message
        in_collective = "(5, torch.float32" in message and "(4, torch.float32" in message
        in_arguments = "[2, 5]" in message and "[2, 4]" in message
        assert in_collective or in_arguments, message


def test_batch_dtype_that_changes_a_collective_raises_on_every_rank(checks):
    for message in _errors(checks, "batch_dtype", "ScheduleMismatchError"):
        assert "rank 1" in message and "torch.float64" in message, message


def test_parameter_tree_mismatch_raises_on_every_rank_without_replica_check(checks):
    for message in _errors(checks, "tree_unchecked", "ScheduleMismatchError"):
        assert "rank 1" in message


def test_parameter_tree_mismatch_raises_on_every_rank_with_replica_check(checks):
    for message in _errors(checks, "tree_checked", "ReplicaMismatchError"):
        assert "['v']" in message


def test_nan_on_one_rank_skips_the_update_on_every_rank(checks):
    histories = checks["nan_policy"]
    for r, history in enumerate(histories):
        before, skipped, after = history[NAN_STEP], history[NAN_STEP + 1], history[NAN_STEP + 2]
        assert math.isnan(skipped["loss"])
        assert_trees_equal(skipped["params"], before["params"], f"rank {r} applied the update")
        assert (skipped["notfinite_count"], skipped["total_notfinite"]) == (1, 1)
        assert skipped["adam_count"] == before["adam_count"] == 1
        moved = optree.tree_map(torch.equal, after["params"], skipped["params"])
        assert not all(optree.tree_leaves(moved)), f"rank {r} stopped training"
        assert (after["notfinite_count"], after["total_notfinite"], after["adam_count"]) == (
            0,
            1,
            2,
        )
        assert all(torch.isfinite(p).all() for p in history[-1]["params"].values())
    assert_ranks_equal([[step["params"] for step in h] for h in histories], "params by step")


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
    assert error.startswith("(a RuntimeError)"), error  # gloo's wording is not ours to pin


def test_stuck_rank_makes_the_other_raise_after_the_timeout(jobs):
    job = jobs.stuck.wait([0])
    job.stop()
    assert job.returncodes()[0] == 1, job.describe()
    to_error, to_exit, error = _stall_times(job, 0)
    assert STALL_TIMEOUT_S / 2 < to_error < STALL_TIMEOUT_S + 15, job.describe()
    assert to_exit < STALL_TIMEOUT_S + 60, job.describe()
    assert error.startswith("(a RuntimeError)"), error  # after the timeout, not at once


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
    digests = re.findall(r"rank (\d): final params sha256 ([0-9a-f]{64})", output)
    assert sorted(r for r, _ in digests) == ["0", "1"], job.describe()
    assert len({d for _, d in digests}) == 1, f"ranks ended with different parameters: {digests}"
    return fddp.load(directory / "final.pt")


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
    assert_trees_equal(params, reference_params, "final params")


def test_torchrun_restart_after_a_crash_ends_like_an_uninterrupted_run(jobs, reference_params):
    job = jobs.restarted
    params = _final_params(job, jobs.tmp / "restarted")
    output = job.output(0)
    assert f"FDDP_CRASH_AT_STEP: rank 1 crashes at step {STOP_AT}" in output, job.describe()
    assert output.count(f"resumed from {jobs.tmp / 'restarted'}") == 2, job.describe()
    assert_trees_equal(params, reference_params, "final params")


def test_two_torchrun_nodes_train_like_one(jobs, reference_params):
    params = _final_params(jobs.two_nodes, jobs.tmp / "two_nodes")
    assert_trees_equal(params, reference_params, "final params")
