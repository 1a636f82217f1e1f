"""Each example runs a few steps with tiny sizes and prints its summary lines; train_gpt,
train_cnn and per_example_clipping must also learn (loss down, accuracy well above chance)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tqdm")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240.0
OUTPUT_TAIL_CHARS = 4000


def run_example(script: str, *args: str, ranks: int = 1) -> str:
    """Run ``examples/<script>`` (under torchrun when ``ranks > 1``); its combined output."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*launcher, str(EXAMPLES / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{script} exited with {proc.returncode}:\n{output[-OUTPUT_TAIL_CHARS:]}"
    )
    return output


def number(pattern: str, output: str) -> float:
    match = re.search(pattern, output)
    assert match, f"no line matching {pattern!r} in:\n{output[-OUTPUT_TAIL_CHARS:]}"
    return float(match.group(1))


def test_train_gpt_two_ranks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "gpt.pt"
    output = run_example(
        "train_gpt.py",
        *("--steps", "3", "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "32"),
        *("--batch", "4", "--eval-every", "2", "--sample-chars", "20", "--out", str(checkpoint)),
        ranks=2,
    )
    assert "2 rank(s) x batch 4 x 32" in output
    assert "compiled schedule (rank 0):" in output
    before = number(r"step 0: train loss ([\d.]+)", output)
    after = number(r"step 3: train loss ([\d.]+)", output)
    assert after < before
    assert f"saved checkpoint {checkpoint}" in output and checkpoint.exists()
    assert "sample (temperature 0.8, from the reloaded checkpoint):" in output


def test_train_cnn_two_ranks() -> None:
    output = run_example(
        *("train_cnn.py", "--steps", "40", "--width", "8", "--batch", "8", "--eval-every", "20"),
        ranks=2,
    )
    assert "2 rank(s) x batch 8" in output
    assert re.search(r"step 20: train loss [\d.]+, test loss [\d.]+, test accuracy", output)
    first = number(r"test loss: ([\d.]+) -> [\d.]+;", output)
    last = number(r"test loss: [\d.]+ -> ([\d.]+);", output)
    assert last < 0.5 * first  # 2.32 -> 0.76 with these settings
    assert number(r"final test accuracy ([\d.]+)%", output) >= 50  # 10 classes; it reaches 77.5


def test_torch_compile_one_rank() -> None:
    output = run_example("torch_compile.py", "--steps", "3", "--hidden", "16")
    assert number(r"fx vs inductor, over 3 steps: ([\d.e+-]+)", output) < 1e-4
    assert number(r"largest parameter difference ([\d.e+-]+)", output) < 1e-5


def test_per_example_clipping_two_ranks() -> None:
    output = run_example("per_example_clipping.py", "--steps", "30", "--batch", "8", ranks=2)
    first = number(r"step    0  loss ([\d.]+)", output)
    last = number(r"final loss ([\d.]+)", output)
    assert 0 < last < first  # 2.29 -> 2.05 with these settings
    assert number(r"train accuracy ([\d.]+)", output) >= 0.4  # 10 classes; it reaches 0.61


def test_ensemble_one_process() -> None:
    output = run_example("ensemble.py", "--steps", "3", "--members", "3", "--hidden", "16")
    assert re.search(r"step    2  member losses \[[\d., ]+\]", output)
    for m in range(3):
        number(rf"member {m}: test accuracy ([\d.]+)%", output)
    assert number(r"ensemble of 3 \(mean logits\): test accuracy ([\d.]+)%", output) > 0
