"""Scripts that call fddp.init() exit cleanly on every rank, every time, with their own status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _dist import free_port, torchrun_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_exit_script.py")
RUNS = 20
PARALLEL_LAUNCHES = 2
LAUNCH_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forks ranks and counts threads in /proc"
)


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def _launch(end: str) -> list[tuple[int | None, str, str]]:
    """Run the exit script as 2 fresh processes; (status, stdout, stderr) per rank."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env=_env(**torchrun_env(rank, 2, port), FDDP_EXIT_SCRIPT_END=end),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\n[killed after {LAUNCH_TIMEOUT_S:g} s]"
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _describe(rank: int, result: tuple[int | None, str, str]) -> str:
    code, out, err = result
    return f"rank {rank}: exit status {code}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"


def test_training_script_exits_zero_every_time():
    # Each rank is forked from a process that has imported torch and fddp (not Dynamo), runs
    # the script's main() and exits through the interpreter's normal shutdown.
    args = ["--forked-launches", str(RUNS), str(PARALLEL_LAUNCHES), str(LAUNCH_TIMEOUT_S)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=RUNS * LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.splitlines()[-1])
    assert len(ranks) == 2 * RUNS
    failed = [r for r in ranks if r["status"] != 0]
    assert not failed, f"{len(failed)} of {2 * RUNS} rank exits failed:\n" + "\n".join(
        f"launch {r['launch']} rank {r['rank']}: status {r['status']}\n{r['output']}"
        for r in failed[:3]
    )
    for r in ranks:
        assert f"rank {r['rank']} trained" in r["output"], r["output"]
        # The root cause: gloo worker threads outliving the exit handler (see _shutdown.py).
        assert "gloo workers after exit handlers: 0" in r["output"], r["output"]


def test_exit_status_is_preserved():
    with ThreadPoolExecutor(3) as pool:
        raised, exited, early = pool.map(_launch, ["raise", "exit3", "raise_early"])
    for rank, (code, _, err) in enumerate(raised):
        assert code == 1, _describe(rank, raised[rank])
        assert "Traceback (most recent call last)" in err
        assert f"RuntimeError: rank {rank} fails after training" in err
    for rank, (code, out, _) in enumerate(exited):
        assert code == 3, _describe(rank, exited[rank])
        assert f"rank {rank} trained" in out
    # Rank 0 dies before a collective that rank 1 waits in: both must exit non-zero, not hang.
    assert early[0][0] == 1, _describe(0, early[0])
    assert "RuntimeError: rank 0 fails before the last collective" in early[0][2]
    assert early[1][0] not in (0, None), _describe(1, early[1])
    assert "killed after" not in early[1][2], _describe(1, early[1])
