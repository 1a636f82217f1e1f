"""The basic gradient transformations: identity, scales, weight decay, momentum and Adam."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from fddp._base._types import (
    GradientTransformation,
    OptState,
    Params,
    ScalarOrSchedule,
    TensorTree,
    Updates,
)
from fddp._optim._kernels import flatten, foreach, params_like, with_scalar, zero_count
from fddp._optim._schedule import Schedule, check_schedule


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


class ScaleByScheduleState(NamedTuple):
    """Step count (int64 0-d tensor) of a scheduled scale."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's field name shadows tuple.count


class TraceState(NamedTuple):
    """Momentum buffers, one per parameter."""

    trace: TensorTree


class ScaleByAdamState(NamedTuple):
    """Step count (int64 0-d tensor) and first and second moment estimates."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's field name shadows tuple.count
    mu: TensorTree
    nu: TensorTree


def identity() -> GradientTransformation:
    """Leaves the updates unchanged.

    Example:
        >>> import torch
        >>> from fddp.optim import identity
        >>> opt = identity()
        >>> opt.update([torch.tensor(3.0)], opt.init([torch.tensor(0.0)]))[0]
        [tensor(3.)]
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        return updates, state

    return GradientTransformation(init, update)


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiplies the updates by a constant.

    Args:
        step_size: The factor.

    Example:
        >>> import torch
        >>> from fddp.optim import scale
        >>> opt = scale(-2.0)
        >>> opt.update({"w": torch.tensor(1.5)}, opt.init({"w": torch.tensor(0.0)}))[0]
        {'w': tensor(-3.)}
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        if not leaves:
            return updates, state
        return optree.tree_unflatten(
            spec, with_scalar(torch._foreach_mul, leaves, step_size)
        ), state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiplies the updates by ``step_size_fn(count)``, where ``count`` counts earlier updates.

    Args:
        step_size_fn: A function of the step count (an int64 0-d tensor, 0 on the first update)
            returning a float or a 0-d tensor.

    Example:
        >>> import torch
        >>> from fddp.optim import scale_by_schedule
        >>> opt = scale_by_schedule(lambda count: 1.0 + count)
        >>> state = opt.init([torch.tensor(0.0)])
        >>> updates, state = opt.update([torch.tensor(2.0)], state)
        >>> updates, state = opt.update([torch.tensor(2.0)], state)
        >>> updates, state.count
        ([tensor(4.)], tensor(2))
    """
    check_schedule(step_size_fn, "step_size_fn")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=zero_count(flatten(params)[0]))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        new_state = ScaleByScheduleState(count=state.count + 1)
        if not leaves:
            return updates, new_state
        factor = step_size_fn(state.count)
        return optree.tree_unflatten(
            spec, with_scalar(torch._foreach_mul, leaves, factor)
        ), new_state

    return GradientTransformation(init, update)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiplies the updates by ``-learning_rate`` (by ``learning_rate`` if not ``flip_sign``).

    Args:
        learning_rate: A float, or a schedule: a function of the step count.
        flip_sign: Negate, so that the updates descend when added to the parameters.

    Example:
        >>> import torch
        >>> from fddp.optim import scale_by_learning_rate
        >>> opt = scale_by_learning_rate(0.1)
        >>> opt.update([torch.tensor(2.0)], opt.init([torch.tensor(0.0)]))[0]
        [tensor(-0.2000)]
    """
    check_schedule(learning_rate, "learning_rate")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


def add_decayed_weights(weight_decay: float | torch.Tensor = 0.0) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates.

    Before an Adam or momentum transformation this is L2 regularisation (``torch.optim.Adam``'s
    ``weight_decay``); after it and before the learning rate it is decoupled weight decay
    (``torch.optim.AdamW``).

    Args:
        weight_decay: The coefficient: a float, or a 0-d tensor (as ``inject_hyperparams``
            passes it).

    Example:
        >>> import torch
        >>> from fddp.optim import add_decayed_weights
        >>> opt = add_decayed_weights(0.5)
        >>> params = [torch.tensor(4.0)]
        >>> opt.update([torch.tensor(1.0)], opt.init(params), params)[0]
        [tensor(3.)]
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        param_leaves = params_like(params, spec, "add_decayed_weights")
        if not leaves:
            return updates, state
        if isinstance(weight_decay, torch.Tensor):  # injected: a 0-d tensor, not a constant
            decay = with_scalar(torch._foreach_mul, param_leaves, weight_decay)
            new = foreach(torch._foreach_add, leaves, decay)
        else:
            new = foreach(torch._foreach_add, leaves, param_leaves, alpha=weight_decay)
        return optree.tree_unflatten(spec, new), state

    return GradientTransformation(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``trace = decay * trace + updates``, as ``torch.optim.SGD`` with no dampening.

    The trace starts at zero, so after the first update it equals the gradient, as torch's
    momentum buffer does. With ``nesterov`` the output is ``updates + decay * trace``.

    Args:
        decay: The momentum coefficient.
        nesterov: Use Nesterov momentum.

    Example:
        >>> import torch
        >>> from fddp.optim import trace
        >>> opt = trace(0.5)
        >>> state = opt.init([torch.tensor(0.0)])
        >>> updates, state = opt.update([torch.tensor(2.0)], state)
        >>> updates, state = opt.update([torch.tensor(2.0)], state)
        >>> updates
        [tensor(3.)]
    """

    def init(params: Params) -> TraceState:
        return TraceState(trace=optree.tree_map(torch.zeros_like, params, none_is_leaf=False))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        if not leaves:
            return updates, state
        old = flatten(state.trace)[0]
        buf = foreach(torch._foreach_add, foreach(torch._foreach_mul, old, decay), leaves)
        out = foreach(torch._foreach_add, leaves, buf, alpha=decay) if nesterov else buf
        return optree.tree_unflatten(spec, out), TraceState(trace=optree.tree_unflatten(spec, buf))

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescales updates by Adam's bias-corrected moment estimates, in ``torch.optim.Adam``'s order.

    ``mu`` and ``nu`` are exponential averages of the gradient and its square; the output is
    ``mu / (sqrt(nu) / sqrt(1 - b2**t) + eps) / (1 - b1**t)`` at step ``t``.

    Args:
        b1: Decay of the first moment.
        b2: Decay of the second moment.
        eps: Added to the denominator.

    Example:
        >>> import torch
        >>> from fddp.optim import scale_by_adam
        >>> opt = scale_by_adam()
        >>> updates, state = opt.update([torch.tensor(-3.0)], opt.init([torch.tensor(0.0)]))
        >>> updates[0].round(decimals=4), state.count
        (tensor(-1.), tensor(1))
    """
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"b1 and b2 must be in [0, 1); got b1={b1}, b2={b2}.")

    def init(params: Params) -> ScaleByAdamState:
        mu = optree.tree_map(torch.zeros_like, params, none_is_leaf=False)
        nu = optree.tree_map(torch.zeros_like, params, none_is_leaf=False)
        return ScaleByAdamState(count=zero_count(flatten(params)[0]), mu=mu, nu=nu)

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = flatten(updates)
        count = state.count + 1
        if not leaves:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        mu = foreach(torch._foreach_lerp, flatten(state.mu)[0], leaves, 1.0 - b1)
        nu = foreach(torch._foreach_mul, flatten(state.nu)[0], b2)
        nu = foreach(torch._foreach_addcmul, nu, leaves, leaves, value=1.0 - b2)
        # float64 like torch's Python-float bias corrections; 1 - 0.999**t is imprecise in float32.
        t = count.to(torch.float64)
        bias_correction1 = 1.0 - b1**t
        bias_correction2_sqrt = torch.sqrt(1.0 - b2**t)
        # nested calls, so that no intermediate list outlives its use (allocator reuse)
        denom = foreach(
            torch._foreach_add,
            with_scalar(
                torch._foreach_div, foreach(torch._foreach_sqrt, nu), bias_correction2_sqrt
            ),
            eps,
        )
        out = with_scalar(
            torch._foreach_div, foreach(torch._foreach_div, mu, denom), bias_correction1
        )
        new_state = ScaleByAdamState(
            count=count, mu=optree.tree_unflatten(spec, mu), nu=optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, out), new_state

    return GradientTransformation(init, update)
