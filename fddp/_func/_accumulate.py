"""Gradient accumulation: the value and gradient of a loss over microbatches of one batch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fddp._base import _invariant_marks
from fddp._base._tree import leaves_with_paths
from fddp._func._grad import normalised, partial_value_and_grad, value_and_grad
from fddp._func._loss import Loss, kind, mixed_kinds_error


def _split(batch: Any, k: int, argnum: int) -> tuple[list[Any], list[int]]:
    """``k`` slices of every tensor leaf of ``batch`` along dim 0, and the rows of each slice."""
    paths, leaves, spec = leaves_with_paths(batch)
    rows = None
    parts: list[list[Any]] = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            parts.append([leaf] * k)
            continue
        if leaf.dim() == 0 or (rows is not None and leaf.shape[0] != rows):
            raise ValueError(
                f"accumulate_gradients: batch argument {argnum} leaf {path} has shape "
                f"{list(leaf.shape)}, but every tensor in a batch needs the same leading (row) "
                f"dimension{f' ({rows})' if rows is not None else ''} to be split into "
                "microbatches. Move per-batch constants to an argument not in batch_argnums."
            )
        rows = leaf.shape[0]
        parts.append(list(torch.tensor_split(leaf, k)))
    if rows is None:
        raise ValueError(
            f"accumulate_gradients: batch argument {argnum} holds no tensor to split; "
            "batch_argnums must select the arguments that hold the batch."
        )
    if rows < k:
        raise ValueError(
            f"accumulate_gradients: a batch of {rows} rows cannot make {k} non-empty "
            "microbatches; use num_microbatches <= rows."
        )
    micro = [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(k)]
    return micro, [len(s) for s in torch.tensor_split(torch.empty(rows, 0), k)]


def accumulate_gradients(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] = -1,
) -> Callable[..., Any]:
    """``fddp.value_and_grad`` of ``loss_fn``, computed over microbatches and averaged.

    The returned function splits every tensor leaf of the batch arguments along dim 0 into
    ``num_microbatches`` slices (``torch.tensor_split``: sizes differ by at most one row), runs
    the forward and backward pass on one slice at a time (peak activation memory of one
    microbatch), and returns the row-weighted mean of the losses and of the gradients, which
    for a loss that is a mean over rows equals the value and gradient on the whole batch.

    A ``loss_fn`` that returns an :class:`fddp.Loss` (a mean over tokens, a sum) is summed
    instead: each microbatch's total, weight and gradient are added as it is consumed, and
    the sums are divided once, by the weight summed over every microbatch and (inside
    ``fddp.data_parallel`` or ``fddp.vmap``) every replica, exactly as
    :func:`fddp.value_and_grad` of the whole batch does. In the invariant mode
    (``invariant=``) the chunks are the microbatches: the result is bitwise that of
    ``fddp.value_and_grad`` on the whole batch, and ``auxes`` holds one aux, its exact mean
    over every chunk.

    This is DDP's ``no_sync()`` without a context manager: nothing is communicated here for a
    scalar loss, so inside ``fddp.data_parallel`` one ``fddp.pmean`` of the result costs one
    all-reduce per bucket for all microbatches, overlapped with the last microbatch's backward
    pass (for an :class:`fddp.Loss`, that all-reduce happens here, once, and ``fddp.pmean``
    returns the result as it is).

    Args:
        loss_fn: ``loss_fn(*args) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``).
        num_microbatches: how many slices the batch is cut into.
        argnums: the arguments to differentiate, as in :func:`fddp.value_and_grad`.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        batch_argnums: the arguments holding the batch (default: the last one).

    Returns:
        ``f(*args) -> (loss, grads)``, or ``((loss, auxes), grads)`` with ``has_aux=True``,
        where ``auxes`` is the list of each microbatch's ``aux``.

    >>> import fddp, torch
    >>> loss_fn = lambda w, x: ((x @ w) ** 2).mean()
    >>> w, x = torch.ones(2), torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    >>> fddp.accumulate_gradients(loss_fn, 2)(w, x)  # microbatches of 2 and 1 rows
    (tensor(3.), tensor([2., 4.]))
    >>> fddp.value_and_grad(loss_fn)(w, x)
    (tensor(3.), tensor([2., 4.]))
    >>> summed = lambda w, x: fddp.Loss.sum(((x @ w) ** 2).sum())
    >>> fddp.accumulate_gradients(summed, 2)(w, x)
    (tensor(9.), tensor([ 6., 12.]))
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"accumulate_gradients: num_microbatches must be a positive int, got "
            f"{num_microbatches!r}."
        )
    whole = value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)
    vg = partial_value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)
    diff_nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    batch_nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    k = num_microbatches

    @functools.wraps(loss_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        n = len(args)
        for m in (*batch_nums, *diff_nums):
            if not -n <= m < n:
                raise ValueError(
                    f"accumulate_gradients: argument index {m} is out of range for "
                    f"{n} positional arguments."
                )
        batch_set = {m % n for m in batch_nums}
        if batch_set & {m % n for m in diff_nums}:
            raise ValueError(
                "accumulate_gradients: batch_argnums and argnums overlap; the batch is split, "
                "the differentiated arguments (parameters) are not. Pass batch_argnums."
            )
        splits = {m: _split(args[m], k, m) for m in sorted(batch_set)}
        sizes = {tuple(s) for _, s in splits.values()}
        if len(sizes) > 1:
            raise ValueError(
                "accumulate_gradients: the batch arguments have different numbers of rows; "
                "every batch argument must hold the same rows."
            )
        context = _invariant_marks.active()
        if context is not None and context.run is not None:  # the chunks are the microbatches
            value, grads = whole(*args, **kwargs)
            return (((value[0], [value[1]]) if has_aux else value), grads)
        (rows,) = sizes
        equal = len(set(rows)) == 1
        total: Any = None
        auxes = []
        for i in range(k):
            micro_args = [splits[m][0][i] if m in splits else a for m, a in enumerate(args)]
            value, grads = vg(*micro_args, **kwargs)
            if has_aux:
                value, aux = value
                auxes.append(aux)
            total = _added(total, _summand(value, grads, None if equal else rows[i]))
        value, grads = _finished(total, k if equal else sum(rows))
        return ((value, auxes) if has_aux else value), grads

    return wrapper


def _summand(value: Any, grads: Any, rows: int | None) -> tuple[str, Any]:
    """What a microbatch adds: an fddp.Loss's total, weight and gradients as they are; a
    scalar mean's value and gradients, times its rows when microbatches differ in rows."""
    if isinstance(value, Loss):
        return kind(value), (value.total, value.weight, grads)
    if rows is None:
        return "example", (value, grads)
    return "example", optree.tree_map(lambda t: t * rows, (value, grads))


def _added(total: tuple[str, Any] | None, part: tuple[str, Any]) -> tuple[str, Any]:
    if total is None:
        return part
    if total[0] != part[0]:
        raise mixed_kinds_error("accumulate_gradients", total[0], part[0], "microbatch")
    return total[0], optree.tree_map(torch.add, total[1], part[1])


def _finished(total: tuple[str, Any], divisor: int) -> tuple[torch.Tensor, Any]:
    """The accumulated sums divided once: a scalar mean's by ``divisor`` (the microbatches,
    or the rows when they differ), an fddp.Loss's by its global weight (:func:`normalised`)."""
    name, sums = total
    if name == "example":
        return optree.tree_map(lambda t: t / divisor, sums)
    summed, weight, grads = sums
    return normalised(Loss(summed, weight), grads)
