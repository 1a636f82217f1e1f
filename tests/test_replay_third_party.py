"""Repeated-block replay on models written by others (tiny random Hugging Face GPT-2, BERT and
Llama; torch's transformer layers), trained whole or with the first block frozen: the captured
step computes bitwise what the capture without replay computes, and replay engages exactly
where expected (torch's layers; the Hugging Face blocks keep their config object and read
mutable state, so they are traced as they are)."""

from __future__ import annotations

import optree
import pytest
import torch
from _compare import assert_trees_close, assert_trees_equal
from _models import captured_counting_replays, token_batch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import fddp

LAYERS = 3


class TorchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.tok(ids))


class TorchDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerDecoder(layer, LAYERS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        return self.layers(x, x * 0.5)


def _model(name: str) -> tuple[nn.Module, str]:
    """The model and the name prefix of its first block's parameters."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(
            vocab_size=32, n_positions=16, n_embd=16, n_layer=LAYERS, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config), "transformer.h.0."
    if name == "bert":
        config = BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return BertModel(config, add_pooling_layer=False), "encoder.layer.0."
    if name == "llama":
        config = LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return LlamaForCausalLM(config), "model.layers.0."
    if name == "torch encoder":
        return TorchEncoder(), "layers.layers.0."
    return TorchDecoder(), "layers.layers.0."


def _step(model: nn.Module, frozen: str | None):
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, ids):
        def loss_fn(p):
            p = {k: v.detach() if frozen and k.startswith(frozen) else v for k, v in p.items()}
            out = apply(p, buffers, ids)
            if not isinstance(out, torch.Tensor):
                out = out.logits if hasattr(out, "logits") else out.last_hidden_state
            return out.float().pow(2).mean()

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        return fddp.pmean(loss), fddp.pmean(grads)

    return step, (params, token_batch(0, 2, length=6))


def _run(name: str, frozen: bool, monkeypatch, *, replay: bool):
    model, first = _model(name)
    step, args = _step(model, first if frozen else None)
    captured, replays = captured_counting_replays(step, args, monkeypatch, replay=replay)
    assert captured.graph is not None and captured.method == "make_fx"
    tensors = [x.clone() for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    return list(captured.graph(*tensors)), replays, step, args


EXPECTED = {"gpt2": 0, "bert": 0, "llama": 0, "torch encoder": LAYERS, "torch decoder": LAYERS}


CASES = [
    ("gpt2", True),
    ("bert", True),
    ("llama", True),
    ("torch encoder", False),
    ("torch encoder", True),
    ("torch decoder", False),
    ("torch decoder", True),
]


@pytest.mark.parametrize(
    ("name", "frozen"),
    CASES,
    ids=[f"{name}-{'first block frozen' if frozen else 'trained'}" for name, frozen in CASES],
)
def test_replayed_capture_equals_the_capture_without_replay(name, frozen, monkeypatch):
    fddp.init()
    got, calls, step, args = _run(name, frozen, monkeypatch, replay=True)
    want, none, _, _ = _run(name, frozen, monkeypatch, replay=False)
    assert (calls, none) == (EXPECTED[name], 0)
    assert_trees_equal(got, want)
    assert_trees_close(want, optree.tree_leaves(step(*args)), rtol=1e-4, atol=1e-6)
