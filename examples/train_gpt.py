"""torchrun --standalone --nproc_per_node=2 examples/train_gpt.py

A character-level GPT trained with fddp.data_parallel on the Python standard library's own source
files (read at run time: offline and deterministic). Every rank samples the same global batch and
trains on its shard of it, so N ranks train exactly like one process on the whole batch. Rank 0
shows the progress, evaluates on held-out files, saves a checkpoint and prints a sample.
Also runs as a world of one: ``python examples/train_gpt.py --steps 3``.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fddp
import fddp.optim as optim

CORPUS_FILES = "*.py"  # the top-level modules of the standard library, in sorted order
HELD_OUT = 0.1  # the last 10 % of the corpus (its last files) is the evaluation split
EVAL_WINDOWS = 64  # fixed windows per split, spread evenly over it, for comparable losses


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="context length in characters")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (warmup, cosine)")
    p.add_argument(
        "--bucket-mb", type=float, help="all-reduce bucket cap, MiB (default: fddp's own)"
    )
    p.add_argument("--compile", action="store_true", help="compile the step with Inductor")
    p.add_argument(
        "--show-outputs",
        action="store_true",
        help="list each output of the step as replicated or per-rank, under the schedule",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="checkpoints/gpt.pt", help="checkpoint path")
    return p.parse_args()


def load_corpus() -> str:
    """The standard library's top-level modules, concatenated in sorted file-name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob(CORPUS_FILES))
    if not files:
        raise SystemExit(f"no {CORPUS_FILES} files under {stdlib}: this Python ships no sources")
    return "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class Vocab:
    """Characters of the corpus, in code-point order."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer over characters, with learned positions."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def sample_batch(
    data: torch.Tensor, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: inputs and next-character targets."""
    starts = torch.randint(len(data) - seq - 1, (batch,), generator=gen)
    return window_batch(data, starts, seq)


def window_batch(
    data: torch.Tensor, starts: torch.Tensor, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = starts[:, None] + torch.arange(seq + 1)
    chunk = data[rows]
    return chunk[:, :-1], chunk[:, 1:]


def fixed_windows(data: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``EVAL_WINDOWS`` windows spread evenly over ``data``, the same at every evaluation."""
    starts = torch.linspace(0, len(data) - seq - 1, EVAL_WINDOWS).long()
    return window_batch(data, starts, seq)


def make_step(apply, opt: optim.GradientTransformation, args: argparse.Namespace):
    """The loss, and the replicated training step: gradients averaged over ranks, AdamW."""

    def loss_fn(params, buffers, x, y):
        logits = apply(params, buffers, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def train_step(params, opt_state, buffers, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, x, y)
        grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    step = fddp.data_parallel(
        train_step, bucket_cap_mb=args.bucket_mb, donate_argnums=(0, 1), compile=args.compile
    )
    return loss_fn, step


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    log = tqdm.write if rank == 0 else lambda *a, **k: None

    text = load_corpus()
    vocab = Vocab("".join(sorted(set(text))))
    data = vocab.encode(text)
    split = int(len(data) * (1 - HELD_OUT))
    train_data, eval_data = data[:split], data[split:]
    log(
        f"corpus: {len(data) / 1e6:.2f}M characters of Python stdlib source "
        f"({split / 1e6:.2f}M train, {(len(data) - split) / 1e6:.2f}M held out), "
        f"vocab {len(vocab.chars)}"
    )

    torch.manual_seed(args.seed)
    model = GPT(len(vocab.chars), args.seq, args.dim, args.layers, args.heads)
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    apply = fddp.functional(model)
    size = sum(p.numel() for p in params.values()) / 1e6
    log(f"model: {size:.2f}M parameters; {world} rank(s) x batch {args.batch} x {args.seq}")

    lr = optim.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=args.steps // 10, decay_steps=args.steps, end_value=args.lr / 10
    )
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=lr, weight_decay=0.1))
    opt_state = opt.init(params)
    loss_fn, step = make_step(apply, opt, args)

    windows = {"train": train_data, "eval": eval_data}
    windows = {k: fddp.shard(fixed_windows(v, args.seq)) for k, v in windows.items()}

    @torch.no_grad()
    def evaluate(params, i: int) -> dict[str, float]:
        # Outside data_parallel, collectives run eagerly: each rank scores its shard of windows.
        losses = {k: fddp.pmean(loss_fn(params, buffers, *xy)).item() for k, xy in windows.items()}
        log(f"step {i}: train loss {losses['train']:.3f}, eval loss {losses['eval']:.3f}")
        return losses

    first = evaluate(params, 0)
    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    tokens = world * args.batch * args.seq
    seconds = 0.0  # time in steps after the first (which traces), for tokens/s
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, unit="step", dynamic_ncols=True)
    for i in bar:
        x, y = fddp.shard(sample_batch(train_data, world * args.batch, args.seq, gen))
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, buffers, x, y)
        loss = loss.item()
        if i == 1:
            plan = step.schedule(params, opt_state, buffers, x, y)
            log(f"compiled schedule (rank 0):\n{plan}")
            if args.show_outputs:
                log(f"outputs of the step:\n{plan.outputs_table()}")
        else:
            seconds += time.perf_counter() - t
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens * (i - 1) / seconds:,.0f}")
        if i % args.eval_every == 0 and i < args.steps:
            evaluate(params, i)
    bar.close()

    last = evaluate(params, args.steps)
    for k in ("train", "eval"):
        log(f"{k} loss: {first[k]:.3f} -> {last[k]:.3f}")
    if seconds:
        log(f"throughput: {tokens * (args.steps - 1) / seconds:,.0f} tokens/s on {world} rank(s)")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    state = {"params": params, "opt_state": opt_state, "step": args.steps, "vocab": vocab.chars}
    fddp.save(args.out, state)
    log(f"saved checkpoint {args.out}")
    if rank == 0:
        restored = fddp.load(args.out, like=state)
        sample = generate(apply, restored["params"], buffers, vocab, args)
        log(f"sample (temperature 0.8, from the reloaded checkpoint):\n{sample}")


@torch.no_grad()
def generate(apply, params, buffers, vocab: Vocab, args: argparse.Namespace) -> str:
    """Sample ``args.sample_chars`` characters after a prompt, at temperature 0.8."""
    gen = torch.Generator().manual_seed(args.seed)
    idx = vocab.encode("def ")[None]
    for _ in range(args.sample_chars):
        logits = apply(params, buffers, idx[:, -args.seq :])[:, -1]
        probs = torch.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return vocab.decode(idx[0])


if __name__ == "__main__":
    main()
