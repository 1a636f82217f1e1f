"""torchrun --standalone --nproc_per_node=2 examples/torch_compile.py

fddp with torch.compile, two ways, on an MLP classifying scikit-learn's digits:
1. ``fddp.data_parallel(step, compile=True)``: Inductor compiles the scheduled step graph (forward,
   backward, bucketed all-reduces where the schedule put them, optimizer); it trains step for
   step like the uncompiled FX schedule (same losses, to float rounding).
2. ``fddp.value_and_grad`` inside a function the user compiles with ``torch.compile``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fddp
import fddp.optim as optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="images per rank per step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, 10),
    )


def train(step, params, opt_state, batches) -> tuple[list[float], float]:
    """Run ``step`` over ``batches``; the losses and the mean time of a step after the first."""
    losses, start = [], 0.0
    for i, (x, y) in enumerate(batches):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss.item())
        if i == 0:
            start = time.perf_counter()  # the first call traces (and compiles)
    return losses, (time.perf_counter() - start) / max(len(batches) - 1, 1)


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    log = print if rank == 0 else lambda *a, **k: None

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    batches = []
    for _ in range(args.steps):
        rows = torch.randint(len(labels), (world * args.batch,), generator=gen)
        batches.append(fddp.shard((images[rows], labels[rows])))

    torch.manual_seed(args.seed)
    model = mlp(args.hidden)
    apply = fddp.functional(model)
    params, _ = fddp.state(model)
    params = fddp.replicate(params)
    opt = optim.adamw(lr=args.lr, weight_decay=0.01)

    def loss_fn(params, x, y):
        return F.cross_entropy(apply(params, {}, x), y)

    def train_step(params, opt_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    # 1. The same step, run as the scheduled FX graph and compiled by Inductor.
    results = {}
    for name, compile in (("fx", False), ("inductor", True)):
        step = fddp.data_parallel(train_step, compile=compile)
        start = {k: v.clone() for k, v in params.items()}  # each run starts from the same state
        t = time.perf_counter()
        losses, per_step = train(step, start, opt.init(start), batches)
        results[name] = losses
        log(
            f"{name:>8}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps; "
            f"first call (trace{', compile' if compile else ''}) "
            f"{time.perf_counter() - t - per_step * (len(losses) - 1):.1f} s, "
            f"then {per_step * 1e3:.1f} ms/step"
        )
    diff = max(abs(a - b) for a, b in zip(results["fx"], results["inductor"]))
    log(f"largest loss difference, fx vs inductor, over {args.steps} steps: {diff:.2e}")

    # 2. fddp's transforms inside the user's own torch.compile (no collectives: a local function).
    @torch.compile(fullgraph=True)
    def sgd_update(params, x, y, lr: float):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        return {k: p - lr * grads[k] for k, p in params.items()}, loss

    x, y = batches[0]
    t = time.perf_counter()
    compiled_params, compiled_loss = sgd_update(params, x, y, 0.1)
    seconds = time.perf_counter() - t
    loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
    gap = max(
        (compiled_params[k] - (p - 0.1 * grads[k])).abs().max().item() for k, p in params.items()
    )
    log(
        f"torch.compile(fddp.value_and_grad): loss {compiled_loss.item():.4f} "
        f"(eager {loss.item():.4f}), largest parameter difference {gap:.2e}; "
        f"first call (compile) {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
