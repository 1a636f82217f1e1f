"""PowerSGD gradient compression as a pure function of (grads, state), on fddp's collectives."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fddp._base._axes import DEFAULT_AXIS
from fddp._base._tree import leaves_with_paths
from fddp._collectives._ops import axis_size, psum


class PowerSGDState(NamedTuple):
    """What PowerSGD carries from one step to the next, keyed by gradient leaf path.

    Attributes:
        qs: for each compressed leaf (viewed as an ``n x m`` matrix), the ``m x rank`` factor of
            the previous step, the warm start of the next one.
        errors: for each compressed leaf, this replica's ``n x m`` compression error, added to
            the next step's gradient (error feedback); empty when error feedback is off.
    """

    qs: dict[str, torch.Tensor]
    errors: dict[str, torch.Tensor]


def _should_compress(
    shape: torch.Size, approximation_rank: int, min_compression_rate: float
) -> bool:
    """DDP's rule: compress an ``n x m`` matrix when ``(n + m) * r * rate < n * m``."""
    if len(shape) < 2:
        return False
    n, m = shape[0], shape[1:].numel()
    r = min(n, m, approximation_rank)
    return (n + m) * r * min_compression_rate < n * m


def _init(
    params: Any,
    *,
    approximation_rank: int = 1,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    seed: int = 0,
) -> PowerSGDState:
    """The initial :class:`PowerSGDState` for gradients shaped like ``params``.

    A leaf with two or more dimensions, viewed as an ``n x m`` matrix (``m`` the product of the
    trailing dimensions), is compressed to rank ``r = min(n, m, approximation_rank)`` when that
    shrinks it by more than ``min_compression_rate``: ``(n + m) * r * min_compression_rate <
    n * m``, as in DDP's ``powerSGD_hook``. Vectors (biases, norms) and small matrices are
    averaged exactly. The initial ``Q`` factors are standard normal draws from a generator
    seeded with ``seed``, so every replica starts from the same ones (also under
    ``torch.func.vmap``, which maps ``init`` over stacked parameters without a randomness mode);
    the errors start at zero.

    Args:
        params: the parameters (or gradients) pytree; only shapes and dtypes are read.
        approximation_rank: the approximation rank (DDP's ``matrix_approximation_rank``).
        min_compression_rate: the least size reduction worth compressing a leaf for.
        error_feedback: keep each replica's compression error and add it to its next gradient.
        seed: seed of the initial ``Q`` factors.

    >>> import fddp, torch
    >>> psgd = fddp.powersgd(approximation_rank=2)
    >>> state = psgd.init({"w": torch.zeros(64, 32), "b": torch.zeros(64)})
    >>> {k: tuple(q.shape) for k, q in state.qs.items()}
    {"['w']": (32, 2)}
    """
    paths, leaves, _ = leaves_with_paths(params)
    generator = torch.Generator().manual_seed(seed)
    # the draws depend on the seed alone, so vmap(init) needs no randomness mode
    no_transform = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)
    qs, errors = {}, {}
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                f"powersgd's init: leaf {path} is not a floating-point tensor; pass the parameters "
                "(or a gradient-shaped tree)."
            )
        if not _should_compress(leaf.shape, approximation_rank, min_compression_rate):
            continue
        n, m = leaf.shape[0], leaf.shape[1:].numel()
        with no_transform():
            q = torch.randn(m, min(n, m, approximation_rank), generator=generator, dtype=leaf.dtype)
        qs[path] = q.to(leaf.device)
        if error_feedback:
            errors[path] = torch.zeros(n, m, dtype=leaf.dtype, device=leaf.device)
    return PowerSGDState(qs, errors)


def _orthogonalize(matrix: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Orthonormal columns by modified Gram-Schmidt, in the column order DDP uses."""
    columns: list[torch.Tensor] = []
    for i in range(matrix.shape[1]):
        col = matrix[:, i]
        for prev in columns:
            col = col - (prev * col).sum() * prev
        columns.append(col / (torch.linalg.vector_norm(col) + epsilon))
    return torch.stack(columns, dim=1)


def _update(
    grads: Any,
    state: PowerSGDState,
    *,
    epsilon: float = 1e-8,
    axis_name: str = DEFAULT_AXIS,
) -> tuple[Any, PowerSGDState]:
    """Average ``grads`` over the replicas of ``axis_name`` through a low-rank approximation.

    A drop-in replacement for ``fddp.pmean(grads)`` that sends far fewer bytes: DDP's
    ``powerSGD_hook`` (Vogels et al., 2019) as a pure function. For each compressed leaf ``M``
    (plus this replica's error from the last step): ``P = M Q`` with ``Q`` orthonormalised from
    the last step's (warm start), ``P`` summed over replicas and orthonormalised,
    ``Q = M^T P`` averaged over replicas, and the result is ``P Q^T``; the new error is
    ``M - P Q^T``. Other leaves are averaged exactly. Per step this all-reduces the ``P``
    factors with the uncompressed leaves, then the ``Q`` factors. (DDP also keeps an error for
    the uncompressed tensors of a bucket, ``local - mean``; those errors sum to zero over the
    replicas, so they do not change the average and are not kept here.)

    Like DDP, run plain ``fddp.pmean`` for the first steps (``start_powerSGD_iter``) and switch
    to ``powersgd`` afterwards: two step functions, each traced once.

    Args:
        grads: this replica's gradients, structured like the ``params`` of
            ``init``.
        state: the state from ``init`` or from the previous step.
        epsilon: added to column norms in the orthonormalisation: DDP's
            ``orthogonalization_epsilon``, whose default 0 turns an all-zero gradient (an
            unused parameter) into NaN.
        axis_name: the replica axis.

    Returns:
        ``(averaged_grads, new_state)``.

    >>> import fddp, torch
    >>> grads = {"w": torch.outer(torch.arange(8.0), torch.ones(4))}
    >>> psgd = fddp.powersgd(approximation_rank=1)
    >>> mean, state = psgd.update(grads, psgd.init(grads))
    >>> torch.allclose(mean["w"], grads["w"], atol=1e-4)
    True
    """
    paths, leaves, spec = leaves_with_paths(grads)
    present = set(paths)
    missing = [p for p in state.qs if p not in present]
    if missing:
        raise ValueError(
            f"powersgd: the state has factors for leaves {missing[:3]} that grads lacks; build "
            "the state with powersgd(...).init from a tree shaped like these gradients."
        )
    n = axis_size(axis_name)
    error_feedback = bool(state.errors)
    compressed = [i for i, p in enumerate(paths) if p in state.qs]
    exact = [i for i, p in enumerate(paths) if p not in state.qs]
    matrices, ps = {}, {}
    for i in compressed:
        path, g = paths[i], leaves[i]
        m = g.reshape(g.shape[0], -1)
        if m.shape != (m.shape[0], state.qs[path].shape[0]):
            raise ValueError(
                f"powersgd: gradient leaf {path} has shape {list(g.shape)}, which does not "
                f"match its state factor {list(state.qs[path].shape)}; rebuild the state with "
                "powersgd(...).init for these parameters."
            )
        if error_feedback:
            m = m + state.errors[path]
        matrices[i] = m
        ps[i] = m @ _orthogonalize(state.qs[path], epsilon)
    summed = psum([*(ps[i] for i in compressed), *(leaves[i] for i in exact)], axis_name)
    out = list(leaves)
    for i, s in zip(exact, summed[len(compressed) :]):
        out[i] = s / n
    qs = {}
    for i, p in zip(compressed, summed[: len(compressed)]):
        ps[i] = _orthogonalize(p, epsilon)
        qs[i] = matrices[i].transpose(0, 1) @ ps[i]
    averaged = psum([qs[i] for i in compressed], axis_name)
    new_qs, new_errors = {}, {}
    for i, q in zip(compressed, averaged):
        path = paths[i]
        q = q / n
        approx = ps[i] @ q.transpose(0, 1)
        out[i] = approx.view(leaves[i].shape)
        new_qs[path] = q
        if error_feedback:
            new_errors[path] = matrices[i] - approx
    return optree.tree_unflatten(spec, out), PowerSGDState(new_qs, new_errors)


class PowerSGD(NamedTuple):
    """PowerSGD as an ``(init, update)`` pair, like an optimizer of :mod:`fddp.optim`.

    Attributes:
        init: ``init(params) -> PowerSGDState``, the state for gradients shaped like ``params``.
        update: ``update(grads, state) -> (averaged_grads, new_state)``, in place of
            ``fddp.pmean(grads)``.
    """

    init: Callable[[Any], PowerSGDState]
    update: Callable[[Any, PowerSGDState], tuple[Any, PowerSGDState]]


def powersgd(
    *,
    approximation_rank: int = 1,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    seed: int = 0,
    epsilon: float = 1e-8,
    axis_name: str = DEFAULT_AXIS,
    rank: int | None = None,
) -> PowerSGD:
    """PowerSGD gradient compression (DDP's ``powerSGD_hook``) as a pure ``(init, update)`` pair.

    ``update`` replaces ``fddp.pmean(grads)`` and sends far fewer bytes; its state carries the
    warm-start factors and this replica's error feedback (per-rank by design, so keep it out of
    ``check_replicas``). Like DDP, run plain ``fddp.pmean`` for the first steps
    (``start_powerSGD_iter``) and switch afterwards: two step functions, each traced once.

    Args:
        approximation_rank: the rank of each gradient matrix's low-rank approximation (DDP's
            ``matrix_approximation_rank``).
        min_compression_rate: the least size reduction worth compressing a leaf for.
        error_feedback: keep each replica's compression error and add it to its next gradient.
        seed: seed of the initial ``Q`` factors (the same on every replica).
        epsilon: added to column norms in the orthonormalisation (DDP's
            ``orthogonalization_epsilon``, whose default 0 turns an all-zero gradient into NaN).
        axis_name: the replica axis.
        rank: deprecated name of ``approximation_rank`` (it read like the process rank).

    >>> import fddp, torch
    >>> psgd = fddp.powersgd(approximation_rank=2)
    >>> grads = {"w": torch.outer(torch.arange(8.0), torch.ones(4)), "b": torch.ones(8)}
    >>> state = psgd.init(grads)
    >>> mean, state = psgd.update(grads, state)
    >>> torch.allclose(mean["w"], grads["w"], atol=1e-4)
    True
    """
    if rank is not None:
        warnings.warn(
            "fddp.powersgd(rank=...) is deprecated: the argument is now called "
            "approximation_rank (fddp.powersgd(approximation_rank=...)); rank= will be removed "
            "in the next release.",
            FutureWarning,
            stacklevel=2,
        )
        approximation_rank = rank
    if not isinstance(approximation_rank, int) or approximation_rank < 1:
        raise ValueError(
            f"fddp.powersgd: approximation_rank must be a positive int, got {approximation_rank!r}."
        )
    init = functools.partial(
        _init,
        approximation_rank=approximation_rank,
        min_compression_rate=min_compression_rate,
        error_feedback=error_feedback,
        seed=seed,
    )
    update = functools.partial(_update, epsilon=epsilon, axis_name=axis_name)
    return PowerSGD(init, update)
