"""Optax-style pure gradient transformations on torch's foreach kernels."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._base._types import (
    GradientTransformation,
    OptState,
    Params,
    ParamsT,
    ScalarOrSchedule,
    TensorTree,
    Updates,
)
from fddp._collectives._ops import psum
from fddp._sharding import _gathered
from fddp._sharding._shard_axes import call_update, takes_shard_axes

Schedule = Callable[[Any], Any]  # of the step count: an int64 0-d tensor or a Python int


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


def _flatten(tree: TensorTree) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=False)


def _params_like(params: Params | None, spec: optree.PyTreeSpec, who: str) -> list[torch.Tensor]:
    if params is None:
        raise ValueError(f"{who} needs the parameters: call update(updates, state, params).")
    leaves, params_spec = _flatten(params)
    if params_spec != spec:
        raise ValueError(
            f"{who}: params and updates have different tree structures ({params_spec} vs {spec}); "
            "pass params with the same structure as the gradients."
        )
    return leaves


# The foreach kernels have no vmap batching rules, so leaves wrapped by a torch.func transform
# (vmap, grad, jvp) take the per-leaf op instead; plain and traced leaves keep the foreach kernel.
_PER_LEAF: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    torch._foreach_add: torch.add,
    torch._foreach_addcmul: torch.addcmul,
    torch._foreach_div: torch.div,
    torch._foreach_lerp: torch.lerp,
    torch._foreach_mul: torch.mul,
    torch._foreach_norm: torch.linalg.vector_norm,
    torch._foreach_sqrt: torch.sqrt,
}


def _transformed(args: tuple[Any, ...]) -> bool:
    """Whether a tensor in ``args`` (or in a list there) is wrapped by a ``torch.func`` transform.

    Dynamo traces only the batched-tensor test, so under ``torch.compile`` that is the test.
    """
    if torch.compiler.is_compiling():
        wrapped = torch._C._functorch.is_batchedtensor
    elif torch._C._functorch.peek_interpreter_stack() is None:
        return False
    else:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for arg in args:
        for x in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(x, torch.Tensor) and wrapped(x):
                return True
    return False


def _foreach(op: Callable[..., Any], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``op(*args, **kwargs)`` for a ``torch._foreach_*`` op, or its per-leaf op under a transform.

    List (or tuple) arguments are taken leaf by leaf; others are passed to every leaf's op.
    """
    if not _transformed(args):
        return op(*args, **kwargs)
    per_leaf = _PER_LEAF[op]
    lists = [isinstance(a, (list, tuple)) for a in args]
    n = len(args[lists.index(True)])
    return [
        per_leaf(*(a[i] if is_list else a for a, is_list in zip(args, lists)), **kwargs)
        for i in range(n)
    ]


def _with_scalar(
    op: Callable[..., Any], leaves: list[torch.Tensor], scalar: Any
) -> list[torch.Tensor]:
    """``op(leaves, scalar)``, where a tensor scalar acts as a Python float would.

    A Python float scalar is used at the precision the kernel computes in (float32 for 16-bit
    leaves) and never changes the result's dtype; a 0-d tensor scalar is cast to match that,
    one dtype and device group at a time, and 0-d leaves, which would promote, are cast back.
    """
    if not isinstance(scalar, torch.Tensor):
        return _foreach(op, leaves, scalar)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for (device, dtype), index in groups.items():
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        group, factor = [leaves[i] for i in index], scalar.to(device, compute)
        if _transformed((group, factor)):
            # a batched scalar is no longer a scalar to the kernel: compute in its dtype here
            results = [_PER_LEAF[op](x.to(compute), factor).to(dtype) for x in group]
        else:
            results = op(group, factor)
            if compute != dtype:
                results = [r.to(dtype) for r in results]
        for i, r in zip(index, results, strict=True):
            out[i] = r
    return out


def _zero_count(leaves: list[torch.Tensor]) -> torch.Tensor:
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)


def _nonzero(value: float | torch.Tensor) -> bool:
    """Whether a coefficient may be nonzero: a tensor (an injected hyperparameter) always may."""
    return isinstance(value, torch.Tensor) or bool(value)


def _check_schedule(value: ScalarOrSchedule, name: str) -> None:
    if not (callable(value) or isinstance(value, (int, float, torch.Tensor))):
        raise TypeError(
            f"{name} must be a number or a schedule (a function of the step count); "
            f"got {type(value).__name__}."
        )


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
        leaves, spec = _flatten(updates)
        if not leaves:
            return updates, state
        return optree.tree_unflatten(
            spec, _with_scalar(torch._foreach_mul, leaves, step_size)
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
    _check_schedule(step_size_fn, "step_size_fn")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_zero_count(_flatten(params)[0]))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = _flatten(updates)
        new_state = ScaleByScheduleState(count=state.count + 1)
        if not leaves:
            return updates, new_state
        factor = step_size_fn(state.count)
        return optree.tree_unflatten(
            spec, _with_scalar(torch._foreach_mul, leaves, factor)
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
    _check_schedule(learning_rate, "learning_rate")
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
        leaves, spec = _flatten(updates)
        param_leaves = _params_like(params, spec, "add_decayed_weights")
        if not leaves:
            return updates, state
        if isinstance(weight_decay, torch.Tensor):  # injected: a 0-d tensor, not a constant
            decay = _with_scalar(torch._foreach_mul, param_leaves, weight_decay)
            new = _foreach(torch._foreach_add, leaves, decay)
        else:
            new = _foreach(torch._foreach_add, leaves, param_leaves, alpha=weight_decay)
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
        leaves, spec = _flatten(updates)
        if not leaves:
            return updates, state
        old = _flatten(state.trace)[0]
        buf = _foreach(torch._foreach_add, _foreach(torch._foreach_mul, old, decay), leaves)
        out = _foreach(torch._foreach_add, leaves, buf, alpha=decay) if nesterov else buf
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
        return ScaleByAdamState(count=_zero_count(_flatten(params)[0]), mu=mu, nu=nu)

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        leaves, spec = _flatten(updates)
        count = state.count + 1
        if not leaves:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        mu = _foreach(torch._foreach_lerp, _flatten(state.mu)[0], leaves, 1.0 - b1)
        nu = _foreach(torch._foreach_mul, _flatten(state.nu)[0], b2)
        nu = _foreach(torch._foreach_addcmul, nu, leaves, leaves, value=1.0 - b2)
        # float64 like torch's Python-float bias corrections; 1 - 0.999**t is imprecise in float32.
        t = count.to(torch.float64)
        bias_correction1 = 1.0 - b1**t
        bias_correction2_sqrt = torch.sqrt(1.0 - b2**t)
        # nested calls, so that no intermediate list outlives its use (allocator reuse)
        denom = _foreach(
            torch._foreach_add,
            _with_scalar(
                torch._foreach_div, _foreach(torch._foreach_sqrt, nu), bias_correction2_sqrt
            ),
            eps,
        )
        out = _with_scalar(
            torch._foreach_div, _foreach(torch._foreach_div, mu, denom), bias_correction1
        )
        new_state = ScaleByAdamState(
            count=count, mu=optree.tree_unflatten(spec, mu), nu=optree.tree_unflatten(spec, nu)
        )
        return optree.tree_unflatten(spec, out), new_state

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales the updates so that their global L2 norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``min(1, max_norm / (norm + 1e-6))``, applied without branching on the norm's value.

    Args:
        max_norm: The largest global norm let through.

    Example:
        >>> import torch
        >>> from fddp.optim import clip_by_global_norm
        >>> opt = clip_by_global_norm(1.0)
        >>> opt.update([torch.tensor([3.0, 4.0])], opt.init(None))[0]
        [tensor([0.6000, 0.8000])]
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive; got {max_norm}.")

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        leaves, spec = _flatten(updates)
        if not leaves:
            return updates, state
        norm = global_norm(leaves, shard_axes)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return optree.tree_unflatten(spec, _with_scalar(torch._foreach_mul, leaves, factor)), state

    return GradientTransformation(init, update)


def global_norm(tree: TensorTree, shard_axes: Sequence[str] = ()) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` taken together.

    Args:
        tree: the tensors.
        shard_axes: named axes over whose replicas ``tree`` is one shard of the whole, as the
            updates are that an optimizer sees inside ``fddp.optim.shard_state`` (which passes
            them to its inner transformation's ``update`` as ``shard_axes=``): the squares are
            summed over those replicas, so every replica gets the norm of the whole.

    Example:
        >>> import torch
        >>> from fddp.optim import global_norm
        >>> global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]})
        tensor(5.)
    """
    leaves = _flatten(tree)[0]
    if not leaves:
        return torch.zeros(())
    norms = _foreach(torch._foreach_norm, leaves)
    device = norms[0].device
    norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    if not shard_axes:
        return norm
    square = norm * norm
    for name in shard_axes:
        square = psum(square, name)
    return torch.sqrt(square)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transformations one after the other; the state is the tuple of their states.

    Example:
        >>> import torch
        >>> from fddp.optim import chain, clip_by_global_norm, scale
        >>> opt = chain(clip_by_global_norm(1.0), scale(-0.1))
        >>> opt.update([torch.tensor([3.0, 4.0])], opt.init(None))[0]
        [tensor([-0.0600, -0.0800])]
    """
    for t in transforms:
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise TypeError(
                f"chain() takes GradientTransformations, got {type(t).__name__}; "
                "call the factory, e.g. chain(clip_by_global_norm(1.0), sgd(0.1))."
            )

    takes = [takes_shard_axes(t) for t in transforms]

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of {len(state)}; "
                "pass the state returned by this chain's init or update."
            )
        new_state = []
        for t, t_takes, s in zip(transforms, takes, state, strict=True):
            updates, s = call_update(t, t_takes, updates, s, params, shard_axes)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


class MaskedState(NamedTuple):
    """The state of :func:`masked`: ``inner``'s state over the masked-in leaves (a list)."""

    inner_state: OptState


_SHARDED_MASK_FIX = (
    "inside fddp.optim.shard_state the parameters are flat shards of many leaves, which a mask "
    "by leaf cannot select: mask outside the sharded part instead, e.g. for a masked AdamW "
    "chain(shard_state(scale_by_adam()), masked(add_decayed_weights(wd), mask), "
    "scale_by_learning_rate(lr))"
)


def _mask_leaves(mask: Any, tree: TensorTree, spec: optree.PyTreeSpec, who: str) -> list[bool]:
    """The mask's bools, one per leaf of ``tree`` (whose structure is ``spec``)."""
    mask_tree = mask(tree) if callable(mask) else mask
    flags, mask_spec = optree.tree_flatten(mask_tree, none_is_leaf=False)
    if mask_spec != spec:
        raise UsageValueError(
            f"{who}: the mask's tree structure {mask_spec} is not the parameters' {spec}; pass "
            "a pytree of bools with the parameters' structure, or a function params -> that "
            f"pytree ({_SHARDED_MASK_FIX})."
        )
    if not all(isinstance(f, bool) for f in flags):
        bad = next(type(f).__name__ for f in flags if not isinstance(f, bool))
        raise UsageTypeError(
            f"{who}: mask leaves must be Python bools (the selection is fixed when the step is "
            f"traced); got a {bad}. Build the mask from names or shapes, e.g. "
            "{name: p.ndim > 1 for name, p in params.items()}."
        )
    return flags


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Applies ``inner`` to the masked-in leaves only; the others' updates pass through unchanged.

    As optax's ``masked``: ``inner`` sees (and its state holds) only the leaves whose mask is
    True, as a list in the parameters' leaf order. The usual use is a weight decay that skips
    biases and norm weights (``adamw(..., mask=...)``).

    Inside ``fddp.optim.shard_state`` the parameters ``inner`` sees are flat shards of many
    leaves, so a mask by leaf cannot apply there: ``update`` raises. Keep the mask outside
    the sharded part: ``chain(shard_state(scale_by_adam()), masked(add_decayed_weights(wd),
    mask), scale_by_learning_rate(lr))`` is a sharded masked AdamW (the decay and the learning
    rate keep no per-parameter state).

    Args:
        inner: the transformation for the masked-in leaves.
        mask: a pytree of Python bools with the parameters' structure, or a function
            ``params -> that pytree`` (called with the params in ``init`` and in ``update``,
            with the updates where no params are given).

    Returns:
        A ``GradientTransformation`` whose state is a :class:`MaskedState`.

    Example:
        >>> import torch
        >>> from fddp.optim import masked, scale
        >>> opt = masked(scale(-1.0), {"w": True, "b": False})
        >>> params = {"w": torch.tensor(1.0), "b": torch.tensor(1.0)}
        >>> opt.update({"w": torch.tensor(2.0), "b": torch.tensor(2.0)}, opt.init(params))[0]
        {'w': tensor(-2.), 'b': tensor(2.)}
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise UsageTypeError(
            f"masked() takes a GradientTransformation, got {type(inner).__name__}; "
            "call the factory, e.g. masked(add_decayed_weights(0.01), mask)."
        )
    takes = takes_shard_axes(inner)

    def init(params: Params) -> MaskedState:
        leaves, spec = _flatten(params)
        flags = _mask_leaves(mask, params, spec, "masked")
        return MaskedState(inner.init([x for x, f in zip(leaves, flags, strict=True) if f]))

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        if shard_axes:
            raise UsageValueError(f"masked: {_SHARDED_MASK_FIX}.")
        leaves, spec = _flatten(updates)
        flags = _mask_leaves(mask, updates if params is None else params, spec, "masked")
        chosen = [i for i, f in enumerate(flags) if f]
        inner_params = None
        if params is not None:
            param_leaves = _params_like(params, spec, "masked")
            inner_params = [param_leaves[i] for i in chosen]
        inner_updates, inner_state = call_update(
            inner, takes, [leaves[i] for i in chosen], state.inner_state, inner_params, ()
        )
        out = list(leaves)
        for i, u in zip(chosen, _flatten(inner_updates)[0], strict=True):
            out[i] = u
        return optree.tree_unflatten(spec, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


class InjectHyperparamsState(NamedTuple):
    """The state of :func:`inject_hyperparams`: a step count (int64 0-d tensor), the current
    hyperparameters (name -> float64 0-d tensor) and the optimizer's own state."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's field name shadows tuple.count
    hyperparams: dict[str, torch.Tensor]
    inner_state: OptState


def inject_hyperparams(
    optimizer_factory: Callable[..., GradientTransformation],
    *,
    static_args: Sequence[str] = (),
) -> Callable[..., GradientTransformation]:
    """Keeps an optimizer's numeric hyperparameters in its state, where they can be changed.

    As optax's ``inject_hyperparams``: ``inject_hyperparams(adamw)(lr=1e-3, weight_decay=0.01)``
    is ``adamw(lr=1e-3, weight_decay=0.01)`` whose state is an :class:`InjectHyperparamsState`.
    Each number passed (and each schedule, evaluated at every update from the state's count)
    is a float64 0-d tensor in ``state.hyperparams`` under the factory's own argument name
    (``lr`` for fddp's optimizers); replace one between steps
    (``state.hyperparams["lr"] = torch.tensor(1e-4, dtype=torch.float64)``) and the next update
    uses it (one given as a schedule is recomputed from the count at each update, so setting it
    has no effect). In a traced step the values are inputs of the program, not constants:
    changing them does not retrace. The optimizer is built anew from the factory at each
    update, with the tensors. Injected are the numbers and schedules passed for arguments that are
    unannotated or annotated to take a tensor or a schedule: of fddp's optimizers, ``lr`` and
    ``weight_decay``. The others (``b1``, ``eps``, ``momentum``, whose values shape the
    transformation or are checked when it is built; a mask; ``nesterov``), defaults, and
    those named in ``static_args`` are passed as given and fixed.

    Args:
        optimizer_factory: a function of hyperparameters returning a ``GradientTransformation``,
            e.g. ``fddp.optim.adamw``.
        static_args: names of numeric arguments to keep as Python values.

    Returns:
        A function taking the factory's arguments and returning the ``GradientTransformation``.

    Example:
        >>> import torch
        >>> from fddp.optim import inject_hyperparams, sgd
        >>> opt = inject_hyperparams(sgd)(lr=0.1)
        >>> state = opt.init([torch.tensor(1.0)])
        >>> state.hyperparams["lr"] = torch.tensor(0.5, dtype=torch.float64)
        >>> opt.update([torch.tensor(2.0)], state)[0]
        [tensor(-1.)]
    """
    signature = inspect.signature(optimizer_factory)
    who = f"inject_hyperparams({getattr(optimizer_factory, '__name__', 'factory')})"

    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        names = ", ".join(signature.parameters)
        unknown_kwargs = sorted(set(kwargs) - set(signature.parameters))
        if unknown_kwargs and not any(
            p.kind is p.VAR_KEYWORD for p in signature.parameters.values()
        ):
            raise UsageTypeError(
                f"{who}: no hyperparameter named {', '.join(unknown_kwargs)}; the factory's "
                f"arguments are: {names} (fddp's optimizers call the learning rate lr)."
            )
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise UsageTypeError(f"{who}: {e}; the factory's arguments are: {names}.") from None
        unknown = set(static_args) - set(signature.parameters)
        if unknown:
            raise UsageValueError(
                f"{who}: static_args {sorted(unknown)} are not arguments of the factory; "
                f"its arguments are: {', '.join(signature.parameters)}."
            )
        given = dict(bound.arguments)
        numeric = {
            k: v
            for k, v in given.items()
            if k not in static_args
            and _takes_tensor(signature.parameters[k])
            and isinstance(v, (int, float, torch.Tensor))
            and not isinstance(v, bool)
        }
        schedules = {
            k: v
            for k, v in given.items()
            # a callable mask selects leaves; any other callable is a schedule
            if k not in static_args
            and k not in numeric
            and _takes_tensor(signature.parameters[k])
            and callable(v)
            and k != "mask"
        }
        static = {k: v for k, v in given.items() if k not in numeric and k not in schedules}
        injected = set(numeric) | set(schedules)
        # built once with the given values: checks them, and decides whether update takes
        # shard_axes (the factory builds the same chain from tensors)
        takes = takes_shard_axes(optimizer_factory(**given))

        def values(count: torch.Tensor, device: torch.device | None) -> dict[str, torch.Tensor]:
            out = {
                k: torch.as_tensor(v, dtype=torch.float64, device=device)
                for k, v in numeric.items()
            }
            for k, fn in schedules.items():
                out[k] = torch.as_tensor(fn(count), device=device).to(torch.float64)
            return out

        def init(params: Params) -> InjectHyperparamsState:
            count = _zero_count(_flatten(params)[0])
            hyperparams = values(count, count.device)
            inner = optimizer_factory(**static, **hyperparams)
            return InjectHyperparamsState(count, hyperparams, inner.init(params))

        def update(
            updates: Updates,
            state: OptState,
            params: Params | None = None,
            *,
            shard_axes: Sequence[str] = (),
        ) -> tuple[Updates, OptState]:
            if set(state.hyperparams) != injected:
                raise UsageValueError(
                    f"{who}: state.hyperparams has {sorted(state.hyperparams)}, but this "
                    f"optimizer injects {sorted(injected)}; change the values of those names only "
                    "(a name not injected is fixed: pass it to the factory call instead)."
                )
            hyperparams = dict(state.hyperparams)
            if schedules:
                hyperparams.update(
                    {
                        k: v
                        for k, v in values(state.count, state.count.device).items()
                        if k in schedules
                    }
                )
            inner = optimizer_factory(**static, **hyperparams)
            out, inner_state = call_update(
                inner, takes, updates, state.inner_state, params, shard_axes
            )
            return out, InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        return GradientTransformation(init, update)

    return functools.wraps(optimizer_factory)(build)


def _takes_tensor(parameter: inspect.Parameter) -> bool:
    """Whether a factory's argument may be injected as a tensor: unannotated, or annotated to
    take a tensor or a schedule (fddp's ``b1``, ``eps``, ``momentum`` are plain floats: their
    values decide the transformation's structure or are checked when it is built)."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return True
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "Tensor" in text or "Schedule" in text


def apply_updates(params: ParamsT, updates: Updates) -> ParamsT:
    """Returns ``params + updates`` as new tensors, in the parameters' dtypes.

    Example:
        >>> import torch
        >>> from fddp.optim import apply_updates
        >>> apply_updates({"w": torch.tensor(1.0)}, {"w": torch.tensor(-0.25)})
        {'w': tensor(0.7500)}
    """
    leaves, spec = _flatten(params)
    update_leaves, update_spec = _flatten(updates)
    if update_spec != spec:
        raise ValueError(
            f"apply_updates: params and updates have different tree structures "
            f"({spec} vs {update_spec}); the updates must come from gradients of these params."
        )
    if not leaves:
        return params
    cast_leaves = [u.to(p.dtype) for p, u in zip(leaves, update_leaves, strict=True)]
    results = _foreach(torch._foreach_add, leaves, cast_leaves)
    _gathered.follow_update(leaves, update_leaves, results)
    return optree.tree_unflatten(spec, results)


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
