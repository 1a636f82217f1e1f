"""torchrun --standalone --nproc_per_node=2 examples/train_remat.py

A decoder-only transformer with naive attention over 8,192-token sequences, trained with fully
sharded parameters (fddp.shard_params + fddp.optim.shard_state) and activation
rematerialisation (``data_parallel(step, remat=fddp.remat_policies.nothing_saveable)``: each
repeated block keeps only its input for the backward pass and is recomputed there, its dropout
replaying the generator state it used). Each block's attention materialises the 8,192 x 8,192
score matrix; without remat the forward keeps, per block, the scaled scores (for the gradient of
the learned temperature), the softmax output, the dropout mask and its output: the plan counts
17.3 GiB a rank for the 16 blocks, 34.5 GiB for the two ranks, more than this 24 GiB machine
holds. With remat a rank keeps 28 MiB for the backward and recomputes one block at a time.

Every rank prints the bytes its plan saves for backward with and without remat (counted in the
captured graph, before anything runs), each step's loss and time, and its peak RSS. The data
are random tokens (nothing downloads). ``--small`` runs the same code at toy sizes (the test).
Also runs as a world of one: ``python examples/train_remat.py --small``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.optim as optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=8192, help="context length in tokens")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--small", action="store_true", help="2 layers over 256 tokens")
    args = p.parse_args()
    if args.small:
        args.layers, args.seq = 2, 256
    return args


class Block(nn.Module):
    """Pre-norm block: naive causal attention (the full score matrix, a learned temperature,
    dropout on the probabilities) and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.temperature = nn.Parameter(torch.tensor(1 / math.sqrt(dim // heads)))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * self.temperature
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(future, -math.inf).softmax(-1))
        x = x + self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def peak_rss() -> int:
    """This process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


def machine_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    torch.manual_seed(0)  # the same initial values on every rank
    model = Model(args.vocab, args.dim, args.heads, args.layers, args.seq).train()
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.shard_state(optim.adamw(args.lr, weight_decay=0.01))

    def loss_fn(p: dict, ids: torch.Tensor) -> torch.Tensor:
        logits = apply(p, buffers, ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))

    def step(p: dict, opt_state, ids: torch.Tensor):
        loss, grads = fddp.value_and_grad(loss_fn)(p, ids)
        updates, opt_state = opt.update(grads, opt_state, p)  # reduce-scatters the grads
        return optim.apply_updates(p, updates), opt_state, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, remat=fddp.remat_policies.nothing_saveable)
    opt_state = fddp.data_parallel(opt.init, trace=False)(params)
    params = fddp.shard_params(params)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own sequence

    def batch() -> torch.Tensor:
        return torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen)

    ids = batch()
    start = time.perf_counter()
    remat = pstep.schedule(params, opt_state, ids).remat  # captures on fake tensors
    assert remat is not None
    print(
        f"rank {rank}: {world} rank(s) x 1 x {args.seq} tokens, {args.layers} blocks, "
        f"{sum(v.numel() for v in model.parameters()):,} parameters fully sharded; captured "
        f"in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    without, saved, total = remat.saved_bytes_without, remat.saved_bytes, machine_bytes()
    print(
        f"rank {rank}: saved for backward (the plan): {gib(without)} without remat, "
        f"{gib(saved)} with remat ({len(remat.regions)} regions, {remat.policy}); "
        f"{world} rank(s) without remat: {gib(world * without)} on a {gib(total)} machine",
        flush=True,
    )
    for i in range(1, args.steps + 1):
        start = time.perf_counter()
        params, opt_state, loss = pstep(params, opt_state, ids)
        print(
            f"rank {rank}: step {i}: loss {loss.item():.4f}, {time.perf_counter() - start:.1f} s, "
            f"peak RSS {gib(peak_rss())}",
            flush=True,
        )
        ids = batch()
    print(f"rank {rank}: done: {args.steps} steps fully sharded with remat", flush=True)


if __name__ == "__main__":
    main()
