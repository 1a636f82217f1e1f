"""TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 FDDP_CRASH_AT_STEP=13 torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/elastic.py

Fault-tolerant training: checkpoint every few steps, resume from the latest checkpoint on start.

Every ``--every`` steps rank 0 writes ``<dir>/checkpoint.pt`` (atomically, with ``fddp.save``):
the parameters, the optimizer state, the step, every rank's RNG state and the data position.
A (re)started job loads it and continues as if nothing had happened: the final parameters are
bitwise those of an uninterrupted run. With ``FDDP_CRASH_AT_STEP=s`` rank 1 crashes once at step
``s`` (a marker file in ``<dir>`` keeps it from crashing again); ``torchrun --max-restarts=1``
then restarts both ranks, which redo the steps since the last checkpoint. At the end rank 0
writes the parameters to ``<dir>/final.pt`` and every rank prints their SHA-256.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every restart a fresh rendezvous store: with
torch 2.13's default, the restarted ranks share the first attempt's store and may read its
stale gloo addresses, and then fail to connect or hang at ``fddp.init``. Resuming needs the
same world size: the checkpoint holds one RNG state per rank, and ``fddp.load`` refuses a
checkpoint whose shapes do not match.
"""  # noqa: E501

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.optim as optim

SAMPLES = 256
FEATURES = 16
NOISE = 0.01


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    parser.add_argument("--batch", type=int, default=8, help="examples per rank per step")
    parser.add_argument("--dir", type=Path, default=Path("elastic-checkpoints"))
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    parser.add_argument("--no-donate", action="store_true", help="do not donate params/state")
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="every rank SIGKILLs itself at this step (a job killed between checkpoints)",
    )
    return parser.parse_args()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression dataset, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x @ torch.randn(FEATURES, 1, generator=g) / FEATURES**0.5)
    return x, y


def epoch_order(epoch: int) -> torch.Tensor:
    """The sample order of ``epoch``: a permutation seeded by the epoch, as DistributedSampler."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))


def make_step(apply, opt: optim.GradientTransformation):
    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, {}, x), y)

    def step(params, opt_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step


def digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def maybe_crash(step: int, directory: Path) -> None:
    """Rank 1 crashes at ``FDDP_CRASH_AT_STEP``, once: the marker file survives the restart."""
    crash_at = os.environ.get("FDDP_CRASH_AT_STEP")
    marker = directory / "crashed-once"
    if crash_at is None or step != int(crash_at) or fddp.rank() != 1 or marker.exists():
        return
    marker.touch()
    raise RuntimeError(f"FDDP_CRASH_AT_STEP: rank 1 crashes at step {step}")


def main() -> None:
    args = parse_args()
    fddp.init(timeout=args.timeout)
    rank, world = fddp.rank(), fddp.world_size()
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.dir / "checkpoint.pt"

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    apply = fddp.functional(model)
    opt = optim.adamw(lr=1e-2)
    params = fddp.replicate(fddp.state(model)[0])
    torch.manual_seed(100 + rank)  # per-rank randomness: the input noise below
    state: dict[str, Any] = {
        "params": params,
        "opt_state": opt.init(params),
        "step": 0,
        "rng": torch.stack([torch.get_rng_state()] * world),
        "epoch": 0,
        "cursor": 0,
    }
    if checkpoint.exists():
        state = fddp.load(checkpoint, like=state)
        torch.set_rng_state(state["rng"][rank].clone())
        print(f"rank {rank}: resumed from {checkpoint} at step {state['step']}", flush=True)

    donate = () if args.no_donate else (0, 1)
    pstep = fddp.data_parallel(make_step(apply, opt), donate_argnums=donate)
    x_all, y_all = make_data()
    global_batch = args.batch * world
    params, opt_state = state["params"], state["opt_state"]
    epoch, cursor = state["epoch"], state["cursor"]
    order = epoch_order(epoch)
    for step in range(state["step"], args.steps):
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        maybe_crash(step, args.dir)
        if cursor + global_batch > SAMPLES:  # drop the last partial batch: shapes never change
            epoch, cursor = epoch + 1, 0
            order = epoch_order(epoch)
        index = fddp.shard(order[cursor : cursor + global_batch])
        cursor += global_batch
        x = x_all[index] + NOISE * torch.randn(len(index), FEATURES)
        params, opt_state, loss = pstep(params, opt_state, x, y_all[index])
        done = step + 1
        if done % args.every == 0 or done == args.steps:
            if rank == 0:
                print(f"step {done}: loss {loss.item():.6f}", flush=True)
            rng = fddp.all_gather(torch.get_rng_state())
            state = {
                "params": params,
                "opt_state": opt_state,
                "step": done,
                "rng": rng,
                "epoch": epoch,
                "cursor": cursor,
            }
            fddp.save(checkpoint, state)
    fddp.save(args.dir / "final.pt", params)
    print(f"rank {rank}: final params sha256 {digest(params)}", flush=True)


if __name__ == "__main__":
    main()
