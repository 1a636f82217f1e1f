"""python examples/ensemble.py

An ensemble of small MLPs trained together in one process: ``torch.func.stack_module_state``
stacks the members' parameters along a new leading dimension, and ``torch.func.vmap`` maps one
training step (gradient, then an ``fddp.optim.adamw`` update) over that dimension, optimizer
state included. Every member starts from its own initialisation and draws its own minibatches
of the digits dataset; the ensemble predicts with the mean of the members' logits.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fddp.optim as optim


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="examples per member per step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    return x[train], y[train], x[test], y[test]


def main() -> None:
    args = parse_args()
    x_train, y_train, x_test, y_test = load_data()
    members = []
    for seed in range(args.members):
        torch.manual_seed(seed)
        members.append(
            nn.Sequential(nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
        )
    params, _ = torch.func.stack_module_state(members)  # name -> [members, ...]
    params = {k: v.detach() for k, v in params.items()}
    base = copy.deepcopy(members[0]).to("meta")  # the architecture, for functional_call

    def apply(p, x):
        return torch.func.functional_call(base, p, (x,))

    def loss_fn(p, x, y):
        return F.cross_entropy(apply(p, x), y)

    opt = optim.adamw(args.lr, weight_decay=1e-2)

    def member_step(p, opt_state, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(p, x, y)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optim.apply_updates(p, updates), opt_state, loss

    opt_state = torch.func.vmap(opt.init)(params)  # one Adam state per member
    step = torch.func.vmap(member_step)  # every argument mapped over the member dimension
    data = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        idx = torch.randint(0, len(x_train), (args.members, args.batch), generator=data)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
        if i % 100 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  member losses {[round(v, 4) for v in loss.tolist()]}", flush=True)

    logits = torch.func.vmap(apply, in_dims=(0, None))(params, x_test)  # [members, n, 10]
    for m, acc in enumerate((logits.argmax(-1) == y_test).float().mean(1).tolist()):
        print(f"member {m}: test accuracy {100 * acc:.1f}%")
    ensemble = (logits.mean(0).argmax(-1) == y_test).float().mean().item()
    print(f"ensemble of {args.members} (mean logits): test accuracy {100 * ensemble:.1f}%")


if __name__ == "__main__":
    main()
