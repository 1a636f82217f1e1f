"""Gradients of functions of pytrees: torch.func transforms over optree-flattened arguments."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.fx import traceback as fx_traceback

from fddp._base import _invariant_marks
from fddp._base._annotations import FORWARD
from fddp._base._errors import UsageValueError
from fddp._base._tree import leaves_with_paths, tensor_leaves
from fddp._collectives._ops import psum
from fddp._func._loss import Loss


def _differentiable_leaves(arg: Any, argnum: int) -> tuple[list[torch.Tensor], Any]:
    paths, leaves, _ = leaves_with_paths(arg)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.nn.Module):
            where = f"argument {argnum}" + ("" if path == "<root>" else f" leaf {path}")
            raise TypeError(
                f"{where} is a torch.nn.Module ({type(leaf).__name__}), not a pytree of "
                "tensors: differentiate with respect to its parameters. Take them with "
                "`params, buffers = fddp.state(model)` and call the model as "
                "`fddp.functional(model)(params, buffers, *inputs)`."
            )
    leaves, spec = tensor_leaves(arg, f"differentiated argument {argnum}")
    for path, leaf in zip(paths, leaves):
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"argument {argnum} leaf {path} has dtype {leaf.dtype}; gradients need floating "
                f"point. Cast it, or move integer tensors (step counts, token ids) to an "
                f"argument that is not in argnums."
            )
    return leaves, spec


def value_and_grad(
    f: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Return a function computing ``f``'s value and its gradient w.r.t. ``argnums``.

    Like ``jax.value_and_grad``: ``f`` returns a scalar tensor (or ``(scalar, aux)`` with
    ``has_aux=True``); the differentiated arguments can be any optree pytree of floating-point
    tensors (dicts, lists, namedtuples, registered custom nodes; ``None`` is an empty subtree),
    and each gradient has the same structure as its argument. Built on ``torch.func``, so it
    composes with ``torch.func.vmap`` and traces under ``torch.compile``.

    A scalar loss is taken as a mean over the batch's examples: inside ``fddp.data_parallel``
    this rank's value and gradient come back, and the step's ``fddp.pmean`` averages them
    over the ranks (the global mean when every rank holds as many examples). ``f`` may return
    an :class:`fddp.Loss` instead, which says how the loss is normalised (a mean over tokens,
    a sum): then the value and the gradient are those over the global batch, summed over the
    step's axis (``data_parallel``'s ranks, ``fddp.vmap``'s replicas) and divided by the
    global weight, already reduced, so ``fddp.pmean`` returns them as they are. Outside such
    a transform, an :class:`fddp.Loss` is normalised over this call's batch alone.

    Returns:
        ``g(*args, **kwargs) -> (value, grads)`` or ``((value, aux), grads)``; ``grads`` is a
        tuple when ``argnums`` is a sequence.

    >>> import fddp, torch
    >>> f = lambda p: (p["w"] ** 2).sum()
    >>> loss, g = fddp.value_and_grad(f)({"w": torch.tensor([1.0, 2.0])})
    >>> loss, g["w"]
    (tensor(5.), tensor([2., 4.]))
    >>> f = lambda p: fddp.Loss.mean((p["w"] ** 2).sum(), 2)
    >>> fddp.value_and_grad(f)({"w": torch.tensor([1.0, 2.0])})
    (tensor(2.5000), {'w': tensor([1., 2.])})
    """
    local = partial_value_and_grad(f, argnums, has_aux)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        context = _invariant_marks.active()
        if context is not None and context.run is not None:  # invariant=: per chunk
            return context.run(f, argnums, has_aux, args, kwargs, partial_value_and_grad)
        value, grads = local(*args, **kwargs)
        value, aux = value if has_aux else (value, None)
        if isinstance(value, Loss):
            value, grads = normalised(value, grads)
        return ((value, aux) if has_aux else value), grads

    return wrapper


def partial_value_and_grad(
    f: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """:func:`value_and_grad` of this call's batch alone, not normalised: an :class:`Loss`
    comes back as it is, the gradients those of its ``total`` (the parts that accumulation
    and the invariant mode sum before they divide once). ``f`` runs with the step's reduction
    suspended, so a gradient taken inside it is of its own batch too."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ValueError(
                    f"argnums {argnums} refers to argument {n}, but only {len(args)} positional "
                    "arguments were passed."
                )
        flat = [_differentiable_leaves(args[n], n) for n in nums]

        def flat_f(*leaf_lists: list[torch.Tensor]) -> Any:
            new_args = list(args)
            for n, (_, spec), leaves in zip(nums, flat, leaf_lists):
                new_args[n] = optree.tree_unflatten(spec, leaves)
            with _invariant_marks.entered(None):
                out = f(*new_args, **kwargs)
            if not has_aux:
                return out, None
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True the function must return a pair (loss, aux); got "
                    f"{type(out).__name__}."
                )
            return out

        grad_lists, (value, aux) = _grad_of_flat(
            flat_f, len(nums), [leaves for leaves, _ in flat], argnums
        )
        grads = tuple(optree.tree_unflatten(spec, g) for (_, spec), g in zip(flat, grad_lists))
        result = grads[0] if isinstance(argnums, int) else grads
        return ((value, aux) if has_aux else value), result

    return wrapper


def normalised(loss: Loss, grads: Any) -> tuple[torch.Tensor, Any]:
    """The value and gradient of ``loss`` over the global batch from this replica's sums
    (``loss.total`` and ``grads``, the gradient of that total): summed over the active step's
    axis and divided by the summed weight (a sum is not divided), marked as reduced so that a
    ``pmean`` over the axis returns them as they are. Without an active step (outside
    ``data_parallel`` and ``vmap``, or inside a function being differentiated), of this
    batch alone."""
    context = _invariant_marks.active()
    total, weight = loss.total, loss.weight
    if context is not None:
        total, weight = psum((total, weight), context.axis_name)
        grads = psum(grads, context.axis_name)
    if weight is not None:
        total = total / weight
        grads = optree.tree_map(lambda g: g / weight, grads)
    if context is not None:
        context.mark((total, grads))
    return total, grads


def _grad_of_flat(
    flat_f: Callable[..., Any],
    n: int,
    leaf_lists: list[list[torch.Tensor]],
    argnums: int | Sequence[int],
) -> Any:
    """torch.func.grad of ``flat_f -> (value, aux)``; aux may hold any leaves, not only tensors.
    A value that is a :class:`Loss` is differentiated through its ``total``; it comes back as
    a :class:`Loss` of the unwrapped total and weight."""
    aux_box: list[Any] = []

    def with_value(*lists: list[torch.Tensor]) -> Any:
        with fx_traceback.annotate({FORWARD: True}):  # tells a trace's forward from backward
            value, aux = flat_f(*lists)
        is_loss = isinstance(value, Loss)
        weight = value.weight if is_loss else None
        scalar = value.total if is_loss else value
        if isinstance(scalar, torch.Tensor) and not scalar.requires_grad:
            raise _unreachable_loss(argnums)
        leaves, spec = optree.tree_flatten((is_loss, scalar, weight, aux))
        aux_box.append((spec, leaves))
        return scalar, [x for x in leaves if isinstance(x, torch.Tensor)]

    grads, tensors = torch.func.grad(with_value, argnums=tuple(range(n)), has_aux=True)(*leaf_lists)
    spec, leaves = aux_box[0]
    it = iter(tensors)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
    is_loss, scalar, weight, aux = optree.tree_unflatten(spec, leaves)
    value = Loss(scalar, weight) if is_loss else scalar
    return grads, (value, aux)


def _unreachable_loss(argnums: int | Sequence[int]) -> UsageValueError:
    """The error for a loss that no differentiated argument reaches: torch.func.grad, which
    tracks only the arguments it was given, would return zeros for every gradient."""
    return UsageValueError(
        f"the differentiated function's value does not depend on argnums={argnums!r}: every "
        "gradient would be zero and the parameters would never change. Usually the loss calls "
        "the model itself (`model(x)`), which computes with the module's own parameters, not "
        "the ones passed in: build `apply = fddp.functional(model)` once and call "
        "`apply(params, buffers, x)` inside the loss. (A torch.no_grad() block or a .detach() "
        "between the arguments and the value cuts the path the same way.)"
    )


def grad(
    f: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """Return a function computing the gradient of scalar-valued ``f`` w.r.t. ``argnums``.

    Same rules as :func:`value_and_grad`; returns ``grads`` (or ``(grads, aux)`` with
    ``has_aux=True``).

    >>> import fddp, torch
    >>> fddp.grad(lambda w, x: (w * x).sum(), argnums=(0, 1))(torch.tensor(2.0), torch.tensor(3.0))
    (tensor(3.), tensor(2.))
    """
    vg = value_and_grad(f, argnums=argnums, has_aux=has_aux)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapper
