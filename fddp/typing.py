"""Domain type aliases shared across fddp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TensorTree = Any
"""A pytree (as optree understands it) whose leaves are tensors."""

Params = TensorTree
Grads = TensorTree
Updates = TensorTree
OptState = Any
Batch = Any

ScalarOrSchedule = float | Callable[[torch.Tensor], Any]
"""A constant, or a function of the step count (an int64 tensor) returning the value."""

__all__ = ["Batch", "Grads", "OptState", "Params", "ScalarOrSchedule", "TensorTree", "Updates"]
