"""Mixed precision: compute in a low-precision dtype, keep float32 master parameters and grads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor leaf cast to ``dtype``; other leaves unchanged.

    The cast is differentiable: the gradient of a leaf cast from float32 to bfloat16 comes back
    as float32.

    >>> import fddp, torch
    >>> tree = fddp.nn.cast_floating({"w": torch.ones(2), "ids": torch.arange(2)}, torch.bfloat16)
    >>> tree["w"].dtype, tree["ids"].dtype
    (torch.bfloat16, torch.int64)
    """
    return optree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
    )


def mixed_precision(
    fn: Callable[..., Any],
    compute_dtype: torch.dtype = torch.bfloat16,
    *,
    output_dtype: torch.dtype = torch.float32,
) -> Callable[..., Any]:
    """``fn`` run in ``compute_dtype``: floating inputs cast down, floating outputs cast back.

    Every floating-point tensor leaf of every argument is cast to ``compute_dtype`` before the
    call and every floating-point tensor leaf of the result to ``output_dtype`` after it; integer
    leaves (labels, token ids) pass unchanged. Differentiating the wrapped loss with respect to
    float32 parameters gives float32 gradients, so the master parameters, the gradient all-reduce
    and the optimizer stay in float32 while the forward and backward matmuls run in
    ``compute_dtype`` (as ``torch.autocast`` with float32 master weights). Compute the loss's
    reduction in float32 by returning logits and reducing outside, or inside ``fn`` after a cast.

    Args:
        fn: the function to run in low precision, typically the model's loss.
        compute_dtype: dtype of the computation (``torch.bfloat16`` or ``torch.float16``).
        output_dtype: dtype of the floating outputs.

    >>> import fddp, torch
    >>> loss_fn = fddp.nn.mixed_precision(lambda w, x: (x @ w).sum())
    >>> g = fddp.grad(loss_fn)(torch.ones(3), torch.ones(2, 3))
    >>> g, g.dtype
    (tensor([2., 2., 2.]), torch.float32)
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_floating((args, kwargs), compute_dtype)
        return cast_floating(fn(*args, **kwargs), output_dtype)

    return wrapper
