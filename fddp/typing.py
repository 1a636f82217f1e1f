"""Domain type aliases shared across fddp."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

TensorTree = Any
"""A pytree (as optree understands it) whose leaves are tensors."""

Params = TensorTree
Grads = TensorTree
Updates = TensorTree
OptState = Any
Batch = Any

ScalarOrSchedule = Union[float, Callable[[torch.Tensor], Any]]
"""A constant, or a function of the step count (an int64 tensor) returning the value."""

__all__ = ["Batch", "Grads", "OptState", "Params", "ScalarOrSchedule", "TensorTree", "Updates"]
