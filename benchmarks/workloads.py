"""The benchmark workloads: an MLP, a small GPT, a ResNet-style CNN, an LSTM language model and
a ResNet-18, with data and loss."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from examples.train_cnn import BasicBlock  # the ResNet basic block, written once

SEED = 0
DATA_SEED = 1234
N_BATCHES = 4
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model builder, a batch generator and a loss; ``per_rank`` rows per rank per step."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_rank: int
    has_buffers: bool = False  # BatchNorm running statistics


def _mlp(width: int = 1024) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(7):
        layers += [nn.GELU(), nn.Linear(width, width)]
    layers += [nn.GELU(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def _mlp_batch(rows: int, gen: torch.Generator, width: int = 1024) -> Batch:
    return torch.randn(rows, width, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer with learned positions and a tied output head."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


GPT_VOCAB, GPT_SEQ = 8192, 128


def _gpt() -> nn.Module:
    return GPT(GPT_VOCAB, GPT_SEQ, dim=256, heads=4, layers=10)


DEEP_VOCAB, DEEP_SEQ = 256, 32


def _deep(layers: int) -> Callable[[], nn.Module]:
    """A narrow, deep decoder (width 128): many small leaves, where per-node costs show."""
    return lambda: GPT(DEEP_VOCAB, DEEP_SEQ, dim=128, heads=4, layers=layers)


def _token_batches(vocab: int, seq: int) -> Callable[[int, torch.Generator], Batch]:
    """Random token sequences; the target is the input shifted by one."""

    def make(rows: int, gen: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _resnet(stem: list[nn.Module], widths: tuple[int, ...], classes: int) -> nn.Module:
    """``stem``, then a stage of two basic blocks per width (all but the first halve the size),
    global average pooling and a linear head."""
    layers, cin = list(stem), widths[0]
    for i, w in enumerate(widths):
        layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def _cnn() -> nn.Module:
    stem = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    return _resnet(stem, (32, 64, 128, 256), classes=10)


def _images(size: int, classes: int) -> Callable[[int, torch.Generator], Batch]:
    """Random ``size`` x ``size`` RGB images with random labels."""

    def make(rows: int, gen: torch.Generator) -> Batch:
        x = torch.randn(rows, 3, size, size, generator=gen)
        return x, torch.randint(0, classes, (rows,), generator=gen)

    return make


class LSTMLM(nn.Module):
    """A word-level language model: embedding, a stacked LSTM, a linear head."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.tok(idx))
        return self.head(out)


LSTM_VOCAB, LSTM_SEQ = 1024, 32


def _lstm() -> nn.Module:
    return LSTMLM(LSTM_VOCAB, dim=128, layers=2)


def _resnet18() -> nn.Module:
    """torchvision's resnet18 layout (7x7 stem, max pool, basic blocks [2, 2, 2, 2] of 64 to
    512 channels, 1000 classes), built here because torchvision does not import with CPU torch."""
    stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    return _resnet([*stem, nn.MaxPool2d(3, 2, 1)], (64, 128, 256, 512), classes=1000)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("mlp", _mlp, _mlp_batch, F.cross_entropy, per_rank=64),
        Workload("gpt", _gpt, _token_batches(GPT_VOCAB, GPT_SEQ), _token_loss, per_rank=8),
        Workload("cnn", _cnn, _images(32, 10), F.cross_entropy, per_rank=16, has_buffers=True),
        Workload("lstm", _lstm, _token_batches(LSTM_VOCAB, LSTM_SEQ), _token_loss, per_rank=8),
        *(
            Workload(f"deep{n}", _deep(n), _token_batches(DEEP_VOCAB, DEEP_SEQ), _token_loss, 4)
            for n in (32, 96)
        ),
        Workload(
            "resnet18", _resnet18, _images(64, 1000), F.cross_entropy, per_rank=8, has_buffers=True
        ),
    )
}


SMALL_VOCAB, SMALL_SEQ = 512, 32


def _small_gpt() -> nn.Module:
    return GPT(SMALL_VOCAB, SMALL_SEQ, dim=64, heads=4, layers=2)


def _small_cnn() -> nn.Module:
    stem = [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()]
    return _resnet(stem, (8, 16), classes=10)


# The mlp, gpt and cnn workloads' layouts at a fraction of their sizes: a quick end-to-end run of
# a benchmark (compare_ddp --small), not a measurement.
SMALL_WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "mlp",
            functools.partial(_mlp, 128),
            functools.partial(_mlp_batch, width=128),
            F.cross_entropy,
            per_rank=4,
        ),
        Workload(
            "gpt", _small_gpt, _token_batches(SMALL_VOCAB, SMALL_SEQ), _token_loss, per_rank=2
        ),
        Workload("cnn", _small_cnn, _images(16, 10), F.cross_entropy, per_rank=4, has_buffers=True),
    )
}


def build_model(workload: Workload, device: torch.device) -> nn.Module:
    """The workload's model, initialised from the same seed on every call."""
    torch.manual_seed(SEED)
    return workload.build().to(device).train()


def rank_batches(workload: Workload, world: int, rank: int, device: torch.device) -> list[Batch]:
    """This rank's share of ``N_BATCHES`` fixed global batches; every variant trains on these."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(N_BATCHES):
        x, y = workload.make_batch(workload.per_rank * world, gen)
        rows = slice(rank * workload.per_rank, (rank + 1) * workload.per_rank)
        out.append((x[rows].to(device), y[rows].to(device)))
    return out


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
