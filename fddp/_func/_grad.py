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

    Returns:
        ``g(*args, **kwargs) -> (value, grads)`` or ``((value, aux), grads)``; ``grads`` is a
        tuple when ``argnums`` is a sequence.

    >>> import fddp, torch
    >>> f = lambda p: (p["w"] ** 2).sum()
    >>> loss, g = fddp.value_and_grad(f)({"w": torch.tensor([1.0, 2.0])})
    >>> loss, g["w"]
    (tensor(5.), tensor([2., 4.]))
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        invariant = _invariant_marks.active()  # a step built with invariant=: per chunk
        if invariant is not None:
            return invariant.run(f, argnums, has_aux, args, kwargs, value_and_grad)
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


def _grad_of_flat(
    flat_f: Callable[..., Any],
    n: int,
    leaf_lists: list[list[torch.Tensor]],
    argnums: int | Sequence[int],
) -> Any:
    """torch.func.grad of ``flat_f -> (value, aux)``; aux may hold any leaves, not only tensors."""
    aux_box: list[Any] = []

    def with_value(*lists: list[torch.Tensor]) -> Any:
        with fx_traceback.annotate({FORWARD: True}):  # tells a trace's forward from backward
            value, aux = flat_f(*lists)
        if isinstance(value, torch.Tensor) and not value.requires_grad:
            raise _unreachable_loss(argnums)
        leaves, spec = optree.tree_flatten((value, aux))
        aux_box.append((spec, leaves))
        return value, [x for x in leaves if isinstance(x, torch.Tensor)]

    grads, tensors = torch.func.grad(with_value, argnums=tuple(range(n)), has_aux=True)(*leaf_lists)
    spec, leaves = aux_box[0]
    it = iter(tensors)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
    return grads, optree.tree_unflatten(spec, leaves)


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
