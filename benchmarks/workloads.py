"""The benchmark workloads: an MLP, a small GPT and a ResNet-style CNN, with data and loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0
DATA_SEED = 1234
N_BATCHES = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model builder, a batch generator and a loss; ``per_rank`` rows per rank per step."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    per_rank: int
    has_buffers: bool


def _mlp() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(1024, 1024)]
    for _ in range(7):
        layers += [nn.GELU(), nn.Linear(1024, 1024)]
    layers += [nn.GELU(), nn.Linear(1024, 10)]
    return nn.Sequential(*layers)


def _mlp_batch(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 1024, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


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


def _gpt_batch(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, GPT_VOCAB, (rows, GPT_SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _Basic(nn.Module):
    """ResNet basic block: two 3x3 conv-BN pairs and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


def _cnn() -> nn.Module:
    widths = (32, 64, 128, 256)
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)]
    layers += [nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [_Basic(cin, w, 1 if i == 0 else 2), _Basic(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def _cnn_batch(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 3, 32, 32, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


WORKLOADS = {
    "mlp": Workload("mlp", _mlp, _mlp_batch, F.cross_entropy, per_rank=64, has_buffers=False),
    "gpt": Workload("gpt", _gpt, _gpt_batch, _gpt_loss, per_rank=8, has_buffers=False),
    "cnn": Workload("cnn", _cnn, _cnn_batch, F.cross_entropy, per_rank=16, has_buffers=True),
}


def build_model(workload: Workload, device: torch.device) -> nn.Module:
    """The workload's model, initialised from the same seed on every call."""
    torch.manual_seed(SEED)
    return workload.build().to(device).train()


def rank_batches(
    workload: Workload, world: int, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
