"""Two ranks train under data_parallel until rank 1 dies, hangs or changes its batch shape.

``python stall.py MODE TIMEOUT READY_DIR`` as one rank of 2 (torchrun environment);
test_reliability.py launches it. Once both ranks have imported torch (each touches a file in
``READY_DIR`` and waits for the other's: on a busy machine imports may take longer than the
timeout), they call ``fddp.init(timeout=TIMEOUT)`` and train a small MLP. At step
``STOP_STEP`` rank 1 does what ``MODE`` says: ``die`` (``os._exit``, as a killed process),
``stuck`` (sleeps forever) or ``retrace`` (passes a batch with one row fewer, so that it alone
traces the step again). Before that it prints ``fddp-stall: rank 1 stops at <unix time>``; a
rank whose step raises prints ``fddp-stall: rank R error at <unix time> (a RuntimeError):
<type>: <message>`` (``not a RuntimeError`` for other exceptions) and re-raises.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import fddp
import fddp.optim as optim

STOP_STEP = 3
STEPS = 1000
READY_WAIT_S = 120.0


def wait_for_peers(ready_dir: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (ready_dir / f"ready.{rank}").touch()
    deadline = time.monotonic() + READY_WAIT_S
    while not all((ready_dir / f"ready.{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks did not start within {READY_WAIT_S:g} s")
        time.sleep(0.01)


def main(mode: str, timeout: float, ready_dir: Path) -> None:
    wait_for_peers(ready_dir)
    fddp.init(timeout=timeout)
    rank = fddp.rank()
    torch.manual_seed(0)
    params = {"w": torch.randn(8, 16) * 0.3, "b": torch.zeros(16), "v": torch.randn(16, 1) * 0.3}
    opt = optim.sgd(lr=0.01)

    def loss_fn(params, x, y):
        return ((torch.tanh(x @ params["w"] + params["b"]) @ params["v"] - y) ** 2).mean()

    @fddp.data_parallel
    def step(params, opt_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    opt_state = opt.init(params)
    x, y = torch.randn(4, 8) + rank, torch.randn(4, 1)
    for i in range(STEPS):
        if i == STOP_STEP and rank == 1:
            print(f"fddp-stall: rank 1 stops at {time.time():.3f}", flush=True)
            if mode == "die":
                os._exit(1)
            if mode == "stuck":
                time.sleep(3600)
            x, y = x[1:], y[1:]
        try:
            params, opt_state, _ = step(params, opt_state, x, y)
        except Exception as e:
            message = f"{type(e).__name__}: {e}".replace("\n", " ")
            kind = "a RuntimeError" if isinstance(e, RuntimeError) else "not a RuntimeError"
            print(f"fddp-stall: rank {rank} error at {time.time():.3f} ({kind}): {message}")
            sys.stdout.flush()
            raise


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]))
