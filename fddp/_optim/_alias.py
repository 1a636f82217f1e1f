"""The usual optimizers as chains of transformations: SGD, Adam, AdamW."""

from __future__ import annotations

from typing import Any

import torch

from fddp._base._types import GradientTransformation, ScalarOrSchedule
from fddp._optim._combine import chain, masked
from fddp._optim._transform import (
    add_decayed_weights,
    identity,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)


def _nonzero(value: float | torch.Tensor) -> bool:
    """Whether a coefficient may be nonzero: a tensor (an injected hyperparameter) always may."""
    return isinstance(value, torch.Tensor) or bool(value)


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, step for step as ``torch.optim.SGD`` (no dampening).

    Args:
        lr: the learning rate: a float, or a schedule (a function of the step count).
        momentum: Momentum coefficient; 0 keeps no state.
        nesterov: Use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 coefficient added to the gradient before momentum.

    Example:
        >>> import torch
        >>> from fddp.optim import sgd, apply_updates
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = [torch.tensor(1.0)]
        >>> state = opt.init(params)
        >>> updates, state = opt.update([torch.tensor(1.0)], state, params)
        >>> apply_updates(params, updates)
        [tensor(0.9000)]
    """
    if momentum < 0:
        raise ValueError(f"momentum must be non-negative; got {momentum}.")
    if nesterov and momentum <= 0:
        raise ValueError("nesterov=True needs momentum > 0.")
    return chain(
        add_decayed_weights(weight_decay) if _nonzero(weight_decay) else identity(),
        trace(momentum, nesterov) if momentum else identity(),
        scale_by_learning_rate(lr),
    )


def adam(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    """Adam, step for step as ``torch.optim.Adam`` (L2 weight decay added to the gradient).

    Args:
        lr: the learning rate: a float, or a schedule (a function of the step count).
        b1: Decay of the first moment.
        b2: Decay of the second moment.
        eps: Added to the denominator.
        weight_decay: L2 coefficient added to the gradient.

    Example:
        >>> import torch
        >>> from fddp.optim import adam, apply_updates
        >>> opt = adam(0.1)
        >>> params = [torch.tensor(1.0)]
        >>> updates, state = opt.update([torch.tensor(5.0)], opt.init(params), params)
        >>> apply_updates(params, updates)
        [tensor(0.9000)]
    """
    return chain(
        add_decayed_weights(weight_decay) if _nonzero(weight_decay) else identity(),
        scale_by_adam(b1, b2, eps),
        scale_by_learning_rate(lr),
    )


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float | torch.Tensor = 0.01,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW, step for step as ``torch.optim.AdamW``: params decay by ``lr * weight_decay``.

    With ``mask``, only the masked-in parameters decay, as ``torch.optim.AdamW`` with a
    ``weight_decay=0`` parameter group for the others (the usual recipe leaves biases and norm
    weights undecayed). Inside ``fddp.optim.shard_state`` a mask by parameter cannot select
    flat shards: there, see :func:`masked`.

    Args:
        lr: the learning rate: a float, or a schedule (a function of the step count).
        b1: Decay of the first moment.
        b2: Decay of the second moment.
        eps: Added to the denominator.
        weight_decay: Decoupled decay coefficient, scaled by the learning rate.
        mask: None (all decay), a pytree of bools with the parameters' structure (True:
            decays), or a function ``params -> that pytree``, as in :func:`masked`.

    Example:
        >>> import torch
        >>> from fddp.optim import adamw, apply_updates
        >>> opt = adamw(0.1, weight_decay=0.5)
        >>> params = [torch.tensor(1.0)]
        >>> updates, state = opt.update([torch.tensor(5.0)], opt.init(params), params)
        >>> apply_updates(params, updates)
        [tensor(0.8500)]
    """
    decay = add_decayed_weights(weight_decay) if _nonzero(weight_decay) else identity()
    return chain(
        scale_by_adam(b1, b2, eps),
        decay if mask is None else masked(decay, mask),
        scale_by_learning_rate(lr),
    )
