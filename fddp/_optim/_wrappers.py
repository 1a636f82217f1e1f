"""Wrapping an optimizer factory so that its hyperparameters live in its state."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._base._types import GradientTransformation, OptState, Params, Updates
from fddp._optim._kernels import flatten, zero_count
from fddp._sharding._shard_axes import call_update, takes_shard_axes


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
            count = zero_count(flatten(params)[0])
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
