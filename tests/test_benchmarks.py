"""Smoke test: benchmarks/compare_ddp.py runs end to end on 2 steps per workload, no timings
(the workloads at their --small sizes, the ranks forked from a server that has imported torch)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "compare_ddp.py")

pytest.importorskip("matplotlib")


def _run(*flags: str, out: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--steps", "2", "--block", "2", "--warmup", "0", "--out", out]
    cmd += ["--start-method", "forkserver"]  # ranks forked from one import of torch and fddp
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*cmd, *flags], capture_output=True, text=True, env=env, timeout=600)


def _ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.mark.timeout(660)
def test_compare_ddp_smoke(tmp_path):
    """Every workload (at its --small size) and variant in the loopback regime, with small
    batches to keep it short."""
    _ok(_run("--small", "--batch", "2", "--no-memory", "--zero", out=str(tmp_path)))
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith(".md") for f in files), files
    assert any(f.endswith("_compare.png") for f in files), files
    (json_name,) = [f for f in files if f.endswith(".json")]
    with open(tmp_path / json_name) as f:
        results = json.load(f)
    summary = results["regimes"]["loopback"]["summary"]
    assert set(summary) == {"mlp", "gpt", "cnn"}
    for s in summary.values():
        assert {"fddp", "ddp", "local", "forward", "allreduce", "fddp+zero", "ddp+zero"} <= set(
            s["rows"]
        )
        for sharded, full in (("fddp+zero", "fddp"), ("ddp+zero", "ddp")):  # AdamW over 2 ranks
            state = s["rows"][sharded]["state_bytes"], s["rows"][full]["state_bytes"]
            assert all(z < f / 2 * 1.05 for z, f in zip(*state)), (sharded, state)
        assert all(r["n"] == 2 for r in s["rows"].values())
        assert s["rows"]["fddp"]["allreduce_bytes"] and s["rows"]["ddp"]["allreduce_bytes"]
        # the same steps as DDP: all but a few Adam sign flips agree to float32 rounding
        compared = {v for v in s["parity"] if not v.endswith("(bitwise)")}
        assert set(s["parity_share"]) == compared and compared
        assert all(share < 0.01 for share in s["parity_share"].values()), s["parity_share"]


@pytest.mark.timeout(660)
def test_compare_ddp_memory_smoke(tmp_path):
    """The per-variant memory runs alone (no timing regime)."""
    flags = ("--small", "--workloads", "mlp", "--no-loopback", "--memory-steps", "1")
    _ok(_run(*flags, out=str(tmp_path)))
    (json_name,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    with open(tmp_path / json_name) as f:
        memory = json.load(f)["memory"]["mlp"]
    assert {"local", "fddp", "fddp-nodonate", "ddp"} <= set(memory)
    assert memory["fddp"]["rss_step_peak_bytes"] > 0


def test_compare_ddp_cuda_skips_without_gpus(tmp_path):
    done = _run("--device", "cuda", "--world-size", "64", out=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped" in done.stdout
    assert not os.listdir(tmp_path)
