"""Schedules: functions of the step count that give a hyperparameter's value."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fddp._base._types import ScalarOrSchedule

Schedule = Callable[[Any], Any]  # of the step count: an int64 0-d tensor or a Python int


def check_schedule(value: ScalarOrSchedule, name: str) -> None:
    if not (callable(value) or isinstance(value, (int, float, torch.Tensor))):
        raise TypeError(
            f"{name} must be a number or a schedule (a function of the step count); "
            f"got {type(value).__name__}."
        )


def _count_f64(count: int | torch.Tensor) -> torch.Tensor:
    """The step count as a float64 0-d tensor: a tensor count on its device, a Python int on
    the CPU."""
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64)
    return torch.tensor(float(count), dtype=torch.float64)


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``, for a Python int or a tensor count.

    Example:
        >>> import torch
        >>> from fddp.optim import constant_schedule
        >>> constant_schedule(0.1)(torch.tensor(7))
        0.1
    """
    return lambda count: value


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Goes linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    Holds ``init_value`` for the first ``transition_begin`` steps and ``end_value`` after the
    transition. The count is a Python int or a tensor; the value is a float64 0-d tensor on the
    count's device (the CPU for an int).

    Example:
        >>> import torch
        >>> from fddp.optim import linear_schedule
        >>> linear_schedule(1.0, 0.0, transition_steps=4)(torch.tensor(1))
        tensor(0.7500, dtype=torch.float64)
        >>> float(linear_schedule(1.0, 0.0, transition_steps=4)(3))
        0.25
    """
    if transition_steps <= 0:
        raise ValueError(f"transition_steps must be positive; got {transition_steps}.")

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_count_f64(count) - transition_begin, 0, transition_steps)
        return init_value + (end_value - init_value) * (t / transition_steps)

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    The count is a Python int or a tensor; the value is a float64 0-d tensor on the count's
    device (the CPU for an int).

    Example:
        >>> import torch
        >>> from fddp.optim import cosine_decay_schedule
        >>> cosine_decay_schedule(1.0, decay_steps=10)(torch.tensor(5))
        tensor(0.5000, dtype=torch.float64)
    """
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be positive; got {decay_steps}.")

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_count_f64(count), max=decay_steps)
        cosine = 0.5 * (1.0 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    ``decay_steps`` counts the warmup too, as in optax: the value reaches ``end_value`` at step
    ``decay_steps``. The count is a Python int or a tensor; the value is a float64 0-d tensor on
    the count's device (the CPU for an int).

    Example:
        >>> import torch
        >>> from fddp.optim import warmup_cosine_decay_schedule
        >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(s(i).item(), 3) for i in (0, 1, 2, 4, 6, 9)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    if not 0 <= warmup_steps < decay_steps:
        raise ValueError(
            f"need 0 <= warmup_steps < decay_steps; got warmup_steps={warmup_steps}, "
            f"decay_steps={decay_steps}."
        )
    cooldown = decay_steps - warmup_steps

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        t = _count_f64(count)
        warm = init_value + (peak_value - init_value) * (t / max(warmup_steps, 1))
        s = torch.clamp(t - warmup_steps, 0, cooldown)
        cool = end_value + (peak_value - end_value) * 0.5 * (
            1.0 + torch.cos(math.pi * s / cooldown)
        )
        return torch.where(t < warmup_steps, warm, cool)

    return schedule
