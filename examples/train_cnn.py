"""torchrun --standalone --nproc_per_node=2 examples/train_cnn.py

A small ResNet with BatchNorm trained with fddp.data_parallel on scikit-learn's digits (1,797
8x8 handwritten digits shipped inside the package, no download). BatchNorm's running statistics
are state the step returns: each rank computes them on its shard, and the step averages them
across replicas (``fddp.nn.sync_buffers(buffers, "mean")``), so all replicas keep the same buffers
(DDP instead copies rank 0's buffers to every rank before each forward, which is
``fddp.nn.sync_buffers(buffers, "broadcast")``). Evaluation runs the network in ``eval()`` mode,
with those running statistics.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fddp
import fddp.optim as optim

TEST_FRACTION = 0.2  # the last 20 % of a fixed shuffle of the data set


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=32, help="channels of the first stage")
    p.add_argument("--batch", type=int, default=64, help="images per rank per step")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD, cosine)")
    p.add_argument(
        "--bucket-mb", type=float, help="all-reduce bucket cap, MiB (default: fddp's own)"
    )
    p.add_argument("--compile", action="store_true", help="compile the step with Inductor")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_data(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Digits as ``(N, 1, 8, 8)`` floats in [0, 1] and labels, split into train and test."""
    # Imported here: benchmarks/workloads.py imports BasicBlock and keeps scikit-learn out of
    # the processes whose memory it measures.
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    split = int(len(labels) * (1 - TEST_FRACTION))
    train, test = order[:split], order[split:]
    return (images[train], labels[train]), (images[test], labels[test])


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (ResNet v1)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, two stages of two blocks (8x8 then 4x4), global average pooling, classifier."""

    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            BasicBlock(width, width, 1),
            BasicBlock(width, width, 1),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 2 * width, 1),
        )
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    log = tqdm.write if rank == 0 else lambda *a, **k: None

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    log(f"digits: {len(y_train)} train / {len(y_test)} test images, 8x8, 10 classes")

    torch.manual_seed(args.seed)
    model = ResNet(args.width)  # in train mode: BatchNorm uses and updates batch statistics
    eval_model = copy.deepcopy(model).eval()  # the same function, with the running statistics
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    apply = fddp.functional(model, return_buffers=True)
    apply_eval = fddp.functional(eval_model)
    n_params = sum(p.numel() for p in params.values())
    log(f"model: ResNet, {n_params / 1e3:.0f}K parameters; {world} rank(s) x batch {args.batch}")

    lr = optim.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)
    opt = optim.sgd(lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    opt_state = opt.init(params)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(logits, y), new_buffers

    def train_step(params, opt_state, buffers, x, y):
        (loss, buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers, x, y)
        grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        return params, opt_state, fddp.nn.sync_buffers(buffers, "mean"), fddp.pmean(loss)

    step = fddp.data_parallel(
        train_step, bucket_cap_mb=args.bucket_mb, donate_argnums=(0, 1, 2), compile=args.compile
    )
    x_eval, y_eval = fddp.shard((x_test, y_test), uneven=True)

    @torch.no_grad()
    def evaluate(params, buffers) -> tuple[float, float]:
        # Eager collectives outside data_parallel: sum per-rank totals of an uneven shard.
        logits = apply_eval(params, buffers, x_eval)
        loss = F.cross_entropy(logits, y_eval, reduction="sum")
        correct = (logits.argmax(1) == y_eval).sum().to(loss.dtype)
        loss, correct = fddp.psum((loss, correct))
        return loss.item() / len(y_test), correct.item() / len(y_test)

    test_loss, test_acc = evaluate(params, buffers)
    log(f"step 0: test loss {test_loss:.3f}, test accuracy {test_acc:.1%}")
    first = test_loss

    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, unit="step", dynamic_ncols=True)
    for i in bar:
        rows = torch.randint(len(y_train), (world * args.batch,), generator=gen)
        x, y = fddp.shard((x_train[rows], y_train[rows]))
        params, opt_state, buffers, loss = step(params, opt_state, buffers, x, y)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if i % args.eval_every == 0 or i == args.steps:
            test_loss, test_acc = evaluate(params, buffers)
            log(
                f"step {i}: train loss {loss.item():.3f}, test loss {test_loss:.3f}, "
                f"test accuracy {test_acc:.1%}"
            )
    bar.close()
    log(f"test loss: {first:.3f} -> {test_loss:.3f}; final test accuracy {test_acc:.1%}")


if __name__ == "__main__":
    main()
