"""Scripts that call fddp.init() exit cleanly on every rank, every time, with their own status.

One launcher process (tests/_exit_script.py --forked-launches) imports torch once and forks the
two ranks of every launch from it: RUNS launches that end normally, and one launch per other
ending (an exception after training, ``sys.exit(3)``, an exception before the last collective).
Each forked rank runs the script's main() and exits through the interpreter's normal shutdown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import script_env

SCRIPT = Path(__file__).with_name("_exit_script.py")
RUNS = 20
PARALLEL_LAUNCHES = 2
LAUNCH_TIMEOUT_S = 120.0
ENDINGS = ("raise", "exit3", "raise_early")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forks ranks and counts threads in /proc"
)


@pytest.fixture(scope="module")
def launches() -> dict[str, list[list[dict]]]:
    """``launches[end][i][rank]``: the status and output of each rank of each launch."""
    ends = ["plain"] * RUNS + list(ENDINGS)
    args = ["--forked-launches", str(PARALLEL_LAUNCHES), str(LAUNCH_TIMEOUT_S), *ends]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=len(ends) * LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.splitlines()[-1])
    assert len(ranks) == 2 * len(ends)
    by_launch: dict[int, list[dict]] = {}
    for r in sorted(ranks, key=lambda r: (r["launch"], r["rank"])):
        by_launch.setdefault(r["launch"], []).append(r)
    out: dict[str, list[list[dict]]] = {}
    for launch in by_launch.values():
        out.setdefault(launch[0]["end"], []).append(launch)
    return out


def _describe(r: dict) -> str:
    return (
        f"launch {r['launch']} ({r['end']}) rank {r['rank']}: exit status {r['status']}\n"
        f"stdout:\n{r['stdout'][-2000:]}\nstderr:\n{r['stderr'][-3000:]}"
    )


def test_training_script_exits_zero_every_time(launches):
    ranks = [r for launch in launches["plain"] for r in launch]
    assert len(ranks) == 2 * RUNS
    failed = [r for r in ranks if r["status"] != 0]
    assert not failed, f"{len(failed)} of {2 * RUNS} rank exits failed:\n" + "\n".join(
        _describe(r) for r in failed[:3]
    )
    for r in ranks:
        assert f"rank {r['rank']} trained" in r["stdout"], _describe(r)
        # The root cause: gloo worker threads outliving the exit handler (see _shutdown.py).
        assert "gloo workers after exit handlers: 0" in r["stdout"], _describe(r)


def test_exit_status_is_preserved(launches):
    ((raised,), (exited,), (early,)) = (launches[end] for end in ENDINGS)
    for rank, r in enumerate(raised):
        assert r["status"] == 1, _describe(r)
        assert "Traceback (most recent call last)" in r["stderr"]
        assert f"RuntimeError: rank {rank} fails after training" in r["stderr"]
    for rank, r in enumerate(exited):
        assert r["status"] == 3, _describe(r)
        assert f"rank {rank} trained" in r["stdout"]
    # Rank 0 dies before a collective that rank 1 waits in: both must exit non-zero, not hang.
    assert early[0]["status"] == 1, _describe(early[0])
    assert "RuntimeError: rank 0 fails before the last collective" in early[0]["stderr"]
    assert early[1]["status"] not in (0, None), _describe(early[1])
    assert "killed after" not in early[1]["stderr"], _describe(early[1])
