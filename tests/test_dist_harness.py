"""The multi-rank test harness: results, a raising rank's traceback, hung ranks within a timeout,
named checks whose failures hide no other check, and subprocess jobs with a deadline."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from _dist import Job, Raised, free_ports, run_checks, run_ranks

# Ranks fork from a server that has imported torch (tests/_dist.py), so they start in well under
# a second; the margin is for a loaded machine. The two runs that must time out start in the
# background when this module's tests start: their waiting overlaps the other tests.
HANG_TIMEOUT_S = 10.0


def _rank_size_sum() -> tuple[int, int, float]:
    x = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), float(x[0])


def _scaled_rank(scale: int) -> int:
    return scale * dist.get_rank()


def _env_value(name: str) -> str:
    import os

    return os.environ[name]


def test_returns_values_in_rank_order_two_ranks():
    assert run_ranks(_rank_size_sum, 2) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_returns_values_three_ranks_with_args_and_env():
    checks = {
        "sums": _rank_size_sum,
        "scaled": functools.partial(_scaled_rank, 10),
        "probe": functools.partial(_env_value, "FDDP_HARNESS_PROBE"),
        "omp": functools.partial(_env_value, "OMP_NUM_THREADS"),
    }
    runs = run_checks(checks, 3, env={"FDDP_HARNESS_PROBE": "yes"})
    assert list(runs) == ["sums", "scaled", "probe", "omp"]
    assert runs["sums"] == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]
    assert runs["scaled"] == [0, 10, 20]
    assert runs["probe"] == ["yes"] * 3
    assert runs["omp"] == ["1"] * 3


def _raise_on_every_rank() -> None:
    raise ValueError(f"check broke on rank {dist.get_rank()}")


def _exit_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(7)  # as a killed process: no result, no traceback
    return dist.get_rank()


def test_a_failing_check_hides_no_other_check():
    checks = {
        "before": _rank_size_sum,
        "raises": _raise_on_every_rank,
        "after": functools.partial(_scaled_rank, 2),
        "dies": _exit_rank_one,
        "never": _rank_size_sum,
    }
    runs = run_checks(checks, 2, timeout=120.0)
    assert runs["before"] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert runs["after"] == [0, 2]  # the check before it raised; this one ran
    raised = runs.outcomes("raises")
    assert all(isinstance(r, Raised) and r.error == "ValueError" for r in raised), raised
    assert [r.message for r in raised] == ["check broke on rank 0", "check broke on rank 1"]
    assert "_raise_on_every_rank" in raised[1].traceback
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'raises' raised on rank\(s\) \[0, 1\]"):
        runs["raises"]
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)'dies' did not finish on rank\(s\) \[1\]"
    ):
        runs.outcomes("dies")  # rank 0 reported; rank 1 died before it could
    with pytest.raises(pytest.fail.Exception, match=r"(?s)'never' did not finish.*status 7"):
        runs["never"]
    with pytest.raises(KeyError, match="no check named 'typo'"):
        runs["typo"]


def _explode_on_rank_one() -> None:
    print("rank", dist.get_rank(), "about to check", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("rank one broke on purpose")
    dist.barrier()  # rank 0 waits on rank 1, which never comes: the harness must not wait


def test_raising_rank_fails_with_its_traceback_before_the_timeout():
    with pytest.raises(AssertionError) as info:
        run_ranks(_explode_on_rank_one, 2, timeout=120.0)
    message = str(info.value)
    assert "timeout" not in message
    # Rank 0 may report too: its barrier fails once rank 1's process is gone.
    assert "] raised" in message and "1]" in message.splitlines()[0]
    rank1 = message.split("--- rank 1 traceback ---")[1]
    assert "Traceback (most recent call last)" in rank1
    assert "_explode_on_rank_one" in rank1
    assert "ValueError: rank one broke on purpose" in rank1
    assert "rank 1 about to check" in rank1


def _sleep_forever_on_rank_one() -> int:
    if dist.get_rank() == 1:
        print("rank 1 going to sleep", flush=True)
        time.sleep(3600)
    return dist.get_rank()


def _collective_rank_zero_never_joins() -> None:
    if dist.get_rank() == 0:
        threading.Event().wait()
    dist.all_reduce(torch.ones(1))


def _timed_out(fn) -> tuple[str, float]:
    """The failure message of a run of ``fn`` that must time out, and its seconds."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(fn, 2, timeout=HANG_TIMEOUT_S)
    return str(info.value), time.monotonic() - start


@pytest.fixture(scope="module", autouse=True)
def _hung_runs_in_background():
    """Start both runs that must time out, in threads, before this module's first test."""
    fns = {"sleeping": _sleep_forever_on_rank_one, "collective": _collective_rank_zero_never_joins}
    with ThreadPoolExecutor(len(fns)) as pool:
        yield {name: pool.submit(_timed_out, fn) for name, fn in fns.items()}


@pytest.fixture
def hung_runs(_hung_runs_in_background) -> dict[str, tuple[str, float]]:
    return {name: future.result() for name, future in _hung_runs_in_background.items()}


def test_sleeping_rank_times_out_and_is_named(hung_runs):
    message, seconds = hung_runs["sleeping"]
    assert "rank(s) [1] did not return" in message
    assert "finished: [0]" in message
    assert "rank 1 going to sleep" in message
    assert "_sleep_forever_on_rank_one" in message  # the stack dumped before the kill
    assert seconds < HANG_TIMEOUT_S + 15.0


def test_rank_stuck_in_collective_times_out(hung_runs):
    message, seconds = hung_runs["collective"]
    assert "rank(s) [0, 1] did not return" in message
    assert "all_reduce" in message
    assert seconds < HANG_TIMEOUT_S + 15.0


def _slow_check() -> int:
    time.sleep(4.0)
    return dist.get_rank()


def test_checks_that_each_finish_in_time_are_not_cut_off_by_their_sum():
    """The time limit is on progress: two checks of 4 s each finish under a 6 s limit (a
    whole-spawn budget ran out under load with its last check unfinished)."""
    runs = run_checks({"first": _slow_check, "second": _slow_check}, 2, timeout=6.0)
    assert (runs["first"], runs["second"]) == ([0, 1], [0, 1]), runs.spawn_error


def test_local_function_is_rejected_before_spawning():
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(local, 2)


def test_jobs_report_exit_status_and_output_and_are_killed_at_the_deadline(tmp_path):
    quick = Job.ranks("quick", tmp_path, ["-c", "import os; print('rank', os.environ['RANK'])"])
    code = "import os, sys, time; print('started', flush=True); time.sleep(600)"
    stuck = Job("stuck", [([sys.executable, "-c", code], os.environ.copy())], tmp_path, timeout=3)
    quick.assert_succeeded()
    assert [quick.output(r).strip() for r in (0, 1)] == ["rank 0", "rank 1"]
    start = time.monotonic()
    assert stuck.wait().returncodes() == [None]  # still running at its deadline
    stuck.stop()
    assert time.monotonic() - start < 10
    assert stuck.procs[0].poll() is not None and "started" in stuck.describe()
    assert len(set(free_ports(5))) == 5
