"""torchrun --standalone --nproc_per_node=2 examples/per_example_clipping.py

DP-SGD-style training: per-example gradients with ``torch.func.vmap`` inside a data-parallel step.

Each rank computes the gradient of every one of its examples separately (``torch.func.vmap``
over ``fddp.grad``), clips each to norm ``--clip``, sums them, and ``fddp.psum`` adds the sums of
all ranks in one bucketed all-reduce; Gaussian noise (the same on every rank: every rank seeds
its generator alike and draws in the same order) is added once, and the total is divided by the
global batch. DistributedDataParallel cannot express this: its hooks see only the summed
gradient of the whole local batch, never the per-example ones.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fddp
import fddp.optim as optim


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--clip", type=float, default=1.0, help="per-example gradient norm bound")
    parser.add_argument("--noise", type=float, default=0.5, help="noise multiplier (sigma/clip)")
    parser.add_argument("--lr", type=float, default=0.5)
    return parser.parse_args()


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target)


def make_step(apply, opt, clip: float, noise: float, global_batch: int):
    def example_loss(params, x, y):
        return F.cross_entropy(apply(params, {}, x[None]), y[None])

    def clipped_sum(params, x, y):
        per_example = torch.func.vmap(fddp.grad(example_loss), in_dims=(None, 0, 0))(params, x, y)
        leaves = list(per_example.values())
        norms = torch.linalg.vector_norm(
            torch.stack([g.flatten(1).norm(dim=1) for g in leaves]), dim=0
        )
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        return {
            k: (g * scale.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in per_example.items()
        }

    def step(params, opt_state, x, y):
        total = fddp.psum(clipped_sum(params, x, y))
        grads = {
            k: (g + noise * clip * torch.randn_like(g)) / global_batch for k, g in total.items()
        }
        updates, opt_state = opt.update(grads, opt_state, params)
        loss = fddp.pmean(F.cross_entropy(apply(params, {}, x), y))
        return optim.apply_updates(params, updates), opt_state, loss

    return step


def main() -> None:
    args = parse_args()
    fddp.init()
    torch.manual_seed(0)
    x_all, y_all = load_data()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    params, _ = fddp.state(model)
    params = fddp.replicate(params)
    apply = fddp.functional(model)
    opt = optim.sgd(lr=args.lr, momentum=0.9)
    opt_state = opt.init(params)
    global_batch = args.batch * fddp.world_size()
    step = fddp.data_parallel(
        make_step(apply, opt, args.clip, args.noise, global_batch), donate_argnums=(0, 1)
    )
    data_gen = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        idx = torch.randint(0, len(x_all), (global_batch,), generator=data_gen)
        x, y = fddp.shard((x_all[idx], y_all[idx]))
        params, opt_state, loss = step(params, opt_state, x, y)
        if fddp.rank() == 0 and (i % 50 == 0 or i == args.steps - 1):
            print(f"step {i:4d}  loss {loss.item():.4f}", flush=True)
    accuracy = (apply(params, {}, x_all).argmax(1) == y_all).float().mean().item()
    if fddp.rank() == 0:
        print(f"final loss {loss.item():.4f}  train accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
