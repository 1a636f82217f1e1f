"""python examples/train_recover.py --ranks 3 --steps 30 --kill-at 10

Training that survives a dead rank without a restart: ``fddp.recoverable``.

This script is its own launcher: it hosts the ``TCPStore`` the ranks form their groups from
(the store must outlive every rank, so it cannot live in rank 0) and starts ``--ranks`` worker
processes of itself. At step ``--kill-at`` the last rank SIGKILLs itself in the middle of the
run (as the OOM killer would); the others discard that step, agree on who is left, form a new
group without it and redo the step over the same global batch, each taking over a share of the
dead rank's micro-batches, then keep training. Each survivor prints what happened and the
SHA-256 of its final parameters (equal on all survivors).

torchrun cannot run this: its agent stops every worker as soon as one fails (and restarts all
of them with ``--max-restarts``, the checkpoint path of examples/elastic.py). A launcher for
in-job recovery must leave the survivors running, as this one does.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fddp

FEATURES = 16
MICRO_BATCHES = 12  # divisible by 3, 2 and 1 ranks: no padding after a loss
MICRO_ROWS = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="step at which the last rank dies")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
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


def worker(args: argparse.Namespace) -> None:
    rank = args.worker
    store = dist.TCPStore(
        "127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))
    apply = fddp.functional(model)
    opt = fddp.optim.adamw(1e-2)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(apply(params, {}, x), y)

    rstep = fddp.recoverable(
        loss_fn,
        opt,
        store=store,
        rank=rank,
        world_size=args.ranks,
        micro_batches=MICRO_BATCHES,
        timeout=args.timeout,
    )
    params = fddp.state(model)[0]
    opt_state = opt.init(params)
    for step in range(args.steps):
        if step == args.kill_at and rank == args.ranks - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        params, opt_state, loss = rstep(params, opt_state, global_batch(step))
        if rstep.members[0] == rank and (step + 1) % 5 == 0:
            print(f"step {step + 1}: loss {loss.item():.5f} on {len(rstep.members)} ranks")
    for r in rstep.recoveries:
        print(
            f"rank {rank}: lost {r.lost} at step {r.step}, generation {r.generation} with "
            f"members {r.members}, regrouped in {r.seconds:.2f} s"
        )
    print(f"rank {rank}: final params sha256 {digest(params)}", flush=True)
    rstep.close()


def launch(args: argparse.Namespace) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    command = [sys.executable, __file__, "--ranks", str(args.ranks), "--steps", str(args.steps)]
    command += ["--kill-at", str(args.kill_at), "--timeout", str(args.timeout)]
    command += ["--port", str(store.port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*command, "--worker", str(r)], env=env) for r in range(args.ranks)]
    codes = [p.wait() for p in procs]
    print(f"exit codes: {codes}")
    survivors = [c for c in codes if c == 0]
    if len(survivors) != args.ranks - (0 <= args.kill_at < args.steps):
        sys.exit(1)


def main() -> None:
    args = parse_args()
    if args.worker is None:
        launch(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
