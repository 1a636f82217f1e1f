"""benchmarks/gpu_check.py skips cleanly where there is no CUDA device (as in CI)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the real check on a GPU machine")
def test_gpu_check_prints_skipped_without_cuda():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "skipped: no CUDA device"
