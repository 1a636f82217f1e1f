"""The multi-rank test harness: results, a raising rank's traceback, hung ranks within a timeout."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_checks, run_ranks

HANG_TIMEOUT_S = 12.0  # spawn and import take 2-4 s of it on a 2-core machine


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
    checks = [
        _rank_size_sum,
        functools.partial(_scaled_rank, 10),
        functools.partial(_env_value, "FDDP_HARNESS_PROBE"),
        functools.partial(_env_value, "OMP_NUM_THREADS"),
    ]
    sums, scaled, probe, omp = run_checks(checks, 3, env={"FDDP_HARNESS_PROBE": "yes"})
    assert sums == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]
    assert scaled == [0, 10, 20]
    assert probe == ["yes"] * 3
    assert omp == ["1"] * 3


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


def test_sleeping_rank_times_out_and_is_named():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_sleep_forever_on_rank_one, 2, timeout=HANG_TIMEOUT_S)
    message = str(info.value)
    assert "rank(s) [1] did not return" in message
    assert "finished: [0]" in message
    assert "rank 1 going to sleep" in message
    assert "_sleep_forever_on_rank_one" in message  # the stack dumped before the kill
    assert time.monotonic() - start < HANG_TIMEOUT_S + 15.0


def _collective_rank_zero_never_joins() -> None:
    if dist.get_rank() == 0:
        threading.Event().wait()
    dist.all_reduce(torch.ones(1))


def test_rank_stuck_in_collective_times_out():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_collective_rank_zero_never_joins, 2, timeout=HANG_TIMEOUT_S)
    message = str(info.value)
    assert "rank(s) [0, 1] did not return" in message
    assert "all_reduce" in message
    assert time.monotonic() - start < HANG_TIMEOUT_S + 15.0


def test_local_function_is_rejected_before_spawning():
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(local, 2)
