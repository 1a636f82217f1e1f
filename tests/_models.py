"""Small seeded models and data for the data_parallel tests: MLP, CNN with BatchNorm, decoder;
and the capture of a step as data_parallel's make_fx path makes it."""

from __future__ import annotations

import itertools

import optree
import torch
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.optim as optim
from fddp._base import _axes
from fddp._collectives import _ops
from fddp._compiler._capture import _repeated
from fddp._compiler._capture._trace import Captured, capture


def mlp(sizes: tuple[int, ...], *, bias: bool = True, seed: int = 0) -> nn.Sequential:
    """Linear layers of the given widths with tanh between them; layer ``i`` is ``f"{2*i}"``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b, bias=bias))
    return nn.Sequential(*layers)


def mlp_weight_names(sizes: tuple[int, ...]) -> list[str]:
    """The parameter names of :func:`mlp`'s weights, first layer first."""
    return [f"{2 * i}.weight" for i in range(len(sizes) - 1)]


class SmallCNN(nn.Module):
    """Two conv + BatchNorm blocks, global pooling, a linear head; input ``(N, 3, 8, 8)``."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def small_cnn(seed: int = 0) -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN()


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyDecoder(nn.Module):
    """A decoder-only language model: token and position embeddings, blocks, tied output."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tiny_decoder(seed: int = 0, layers: int = 2) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(layers=layers)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A one-layer Hugging Face GPT-2 from a small random config, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=32,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from ``logits[:, :-1]``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mlp_step(opt, sizes: tuple[int, ...]):
    """A pure data-parallel training step of ``mlp(sizes)`` on a regression batch (``{"x",
    "y"}``, mean squared error) with the optimizer ``opt``, and the model's parameters:
    ``step(params, opt_state, batch) -> (params, opt_state, pmean(loss))``."""
    model = mlp(sizes)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return F.mse_loss(apply(p, buffers, batch["x"]), batch["y"])

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step, params


def regression_batch(step: int, rows: int, dim_in: int, dim_out: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "x": torch.randn(rows, dim_in, generator=g),
        "y": torch.randn(rows, dim_out, generator=g),
    }


def image_batch(step: int, rows: int, classes: int = 5) -> dict:
    g = torch.Generator().manual_seed(2000 + step)
    return {
        "x": torch.randn(rows, 3, 8, 8, generator=g) * 2 + 0.5,
        "y": torch.randint(0, classes, (rows,), generator=g),
    }


def token_batch(step: int, rows: int, length: int = 12, vocab: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, vocab, (rows, length), generator=g)


def captured_step(step, args: tuple) -> Captured:
    """``step(*args)`` captured as ``data_parallel`` captures it (make_fx first, the fused
    backward, pmean over a traced "data" axis), before scheduling."""
    tensors = [x for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    with _axes.bind(_ops.process_axis("data", None, traced=True)):
        captured, _ = capture(step, args, tensors, fused_backward=True)
    return captured


def captured_counting_replays(step, args: tuple, monkeypatch, *, replay: bool):
    """``captured_step(step, args)`` with repeated-block replay on or off, and how many block
    calls were replayed."""
    replayed = []
    call = _repeated._Call

    def counted(template):
        replayed.append(template)
        return call(template)

    with monkeypatch.context() as m:
        m.setattr(_repeated, "ENABLED", replay)
        m.setattr(_repeated, "_Call", counted)
        captured = captured_step(step, args)
    return captured, len(replayed)
