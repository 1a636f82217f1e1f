"""python -m fddp.run --standalone --nproc-per-node=3 --max-replacements=1 examples/train_recover.py

Training that survives a dead rank without a restart: ``fddp.recoverable`` under ``fddp.run``.

``python -m fddp.run`` takes torchrun's flags, starts the workers and hosts the store they agree
through; unlike torchrun, it leaves the others running when a worker dies, and with
``--max-replacements`` it starts a new worker in the dead one's place. At step ``--kill-at`` the
last rank SIGKILLs itself (as the OOM killer would); the others discard that step, agree on who
is left, form a new group without it and redo the step over the same global batch, each taking
over a share of the dead rank's micro-batches, then keep training. The replacement is admitted
at a step boundary and receives the parameters, the optimizer state and the random generators.
Kill any worker yourself as well (``kill -9 PID``; each prints its pid): the job still finishes,
and the launcher exits 0.

The step runs in invariant mode, dropout included, so every worker prints the same SHA-256 of
its final parameters, and ``python examples/train_recover.py`` (one process, no failure) prints
it too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

import fddp

FEATURES = 16
MICRO_BATCHES = 12  # divisible by 3, 2 and 1 ranks: whole micro-batches after any loss
MICRO_ROWS = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=10, help="step at which the last rank dies")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    return parser.parse_args()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(MICRO_BATCHES * MICRO_ROWS, FEATURES, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 1),
    )  # fmt: skip
    apply = fddp.functional(model)
    opt = fddp.optim.adamw(1e-3)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(apply(params, {}, x), y)

    # store, rank and world size come from fddp.run (plain python: a world of one)
    rstep = fddp.recoverable(
        loss_fn,
        opt,
        micro_batches=MICRO_BATCHES,
        timeout=args.timeout,
        invariant=True,
        admit_every=2,
    )
    rank, first_world = rstep.uid, len(rstep.members)
    print(f"rank {rank}: pid {os.getpid()}, starting at step {rstep.step}", flush=True)
    params = fddp.state(model)[0]
    opt_state = opt.init(params)
    for step in range(rstep.step, args.steps):
        if step == args.kill_at and first_world > 1 and rank == first_world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        params, opt_state, loss = rstep(params, opt_state, global_batch(step))
        if rstep.members[0] == rank and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.5f} on {len(rstep.members)} ranks")
    for r in rstep.recoveries:
        print(
            f"rank {rank}: lost {r.lost} at step {r.step}, generation {r.generation} with "
            f"members {r.members}, regrouped in {r.seconds:.2f} s"
        )
    print(f"rank {rank}: final params sha256 {digest(params)}", flush=True)
    rstep.close()


if __name__ == "__main__":
    main()
