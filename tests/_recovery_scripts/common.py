"""The model, data and optimizer settings shared by the recovery workers and their reference."""

from __future__ import annotations

import torch

STEPS = 8
MICRO_BATCHES = 12
MICRO_ROWS = 2
FEATURES, HIDDEN, OUT = 8, 16, 4
LR, WEIGHT_DECAY = 1e-2, 0.01


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(FEATURES, HIDDEN, generator=g) / FEATURES**0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, OUT, generator=g) / HIDDEN**0.5,
        "b2": torch.zeros(OUT),
    }


def global_batch(step: int, micro_batches: int = MICRO_BATCHES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    rows = micro_batches * MICRO_ROWS
    x = torch.randn(rows, FEATURES, generator=g)
    return {"x": x, "y": torch.sin(x[:, :OUT] * 2)}
