"""``fddp.vmap``: N simulated replicas in one process, collectives reduce over the mapped dim."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fddp._base import _axes
from fddp._base._axes import DEFAULT_AXIS
from fddp._base._tree import path_str
from fddp._func import _invariant
from fddp._sharding import TAKES_SHARDS, gathering

# How a collective finds "its" vmap level: every collective passes the axis's replica index as
# an extra operand. That tensor is batched at the axis's vmap level and at no other, so inside
# the autograd.Function's vmap rule (called once per vmap level that batches an operand) the
# index's in_dim is not None exactly at the axis's level: reduce there, pass through elsewhere.


def _pass_through(
    fn: type[torch.autograd.Function],
    consts: tuple[Any, ...],
    index: torch.Tensor,
    dims: Sequence[int | None],
    xs: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
    """Re-apply ``fn`` one level down with each batch dim kept last (every op acts on dim 0)."""
    moved = [x if d is None else x.movedim(d, -1) for x, d in zip(xs, dims)]
    out = fn.apply(*consts, index, *moved)
    return out, tuple(None if d is None else y.dim() - 1 for y, d in zip(out, dims))


class _Psum(torch.autograd.Function):
    """Sum over the axis whose replica index is the first operand; vjp: psum of cotangents."""

    @staticmethod
    def forward(index: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise AssertionError("_Psum runs only through its vmap rule")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.index = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *_Psum.apply(ctx.index, *grads))

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return _Psum.apply(ctx.index, *tangents[1:])

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], index: torch.Tensor, *xs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        index_dim, *dims = in_dims
        if index_dim is None:
            return _pass_through(_Psum, (), index, dims, xs)
        out = tuple(
            x * info.batch_size if d is None else torch.sum(x, d, dtype=x.dtype)
            for x, d in zip(xs, dims)
        )
        return out, (None,) * len(out)


class _AllGather(torch.autograd.Function):
    """Stack (or concatenate) over the axis; vjp: this replica's part of the psum of cotangents."""

    @staticmethod
    def forward(
        tiled: bool, replicas: int, index: torch.Tensor, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        raise AssertionError("_AllGather runs only through its vmap rule")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.tiled, ctx.replicas, ctx.index = inputs[:3]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        totals = _Psum.apply(ctx.index, *grads)
        row = ctx.index.reshape(1)
        parts = []
        for total in totals:
            stacked = total.unflatten(0, (ctx.replicas, -1)) if ctx.tiled else total
            parts.append(stacked.index_select(0, row.to(total.device)).squeeze(0))
        return (None, None, None, *parts)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return _AllGather.apply(ctx.tiled, ctx.replicas, ctx.index, *tangents[3:])

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        tiled: bool,
        replicas: int,
        index: torch.Tensor,
        *xs: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        _, _, index_dim, *dims = in_dims
        if index_dim is None:
            return _pass_through(_AllGather, (tiled, replicas), index, dims, xs)
        n = info.batch_size
        out = []
        for x, d in zip(xs, dims):
            if d is None:
                y = (
                    x.repeat(n, *[1] * (x.dim() - 1))
                    if tiled
                    else x.unsqueeze(0).repeat_interleave(n, 0)
                )
            else:
                y = x.movedim(d, 0)
                y = y.flatten(0, 1) if tiled else y
            out.append(y)
        return tuple(out), (None,) * len(out)


class _PsumScatter(torch.autograd.Function):
    """Sum over the axis, replica ``r`` keeps block ``r`` of dim 0; vjp: tiled all-gather."""

    @staticmethod
    def forward(replicas: int, index: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise AssertionError("_PsumScatter runs only through its vmap rule")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.replicas, ctx.index = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *_AllGather.apply(True, ctx.replicas, ctx.index, *grads))

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return _PsumScatter.apply(ctx.replicas, ctx.index, *tangents[2:])

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        replicas: int,
        index: torch.Tensor,
        *xs: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        _, index_dim, *dims = in_dims
        if index_dim is None:
            return _pass_through(_PsumScatter, (replicas,), index, dims, xs)
        n = info.batch_size
        out = []
        for x, d in zip(xs, dims):
            total = x * n if d is None else torch.sum(x, d, dtype=x.dtype)
            out.append(total.unflatten(0, (n, -1)))
        return tuple(out), (0,) * len(out)


class _Broadcast(torch.autograd.Function):
    """Replica ``src``'s value everywhere; vjp: psum of cotangents on ``src``, zero elsewhere."""

    @staticmethod
    def forward(src: int, index: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise AssertionError("_Broadcast runs only through its vmap rule")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.src, ctx.index = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        totals = _Psum.apply(ctx.index, *grads)
        is_src = ctx.index == ctx.src
        return (
            None,
            None,
            *(torch.where(is_src.to(t.device), t, torch.zeros_like(t)) for t in totals),
        )

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return _Broadcast.apply(ctx.src, ctx.index, *tangents[2:])

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        src: int,
        index: torch.Tensor,
        *xs: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
        _, index_dim, *dims = in_dims
        if index_dim is None:
            return _pass_through(_Broadcast, (src,), index, dims, xs)
        out = tuple(x.clone() if d is None else x.select(d, src).clone() for x, d in zip(xs, dims))
        return out, (None,) * len(out)


@dataclasses.dataclass(frozen=True)
class VmapAxis:
    """An axis whose replicas are the entries of a dimension mapped by ``torch.func.vmap``.

    ``replica_index`` is ``arange(replicas)`` batched at that vmap level (replica ``r`` sees
    ``r``); collectives pass it along to find the level they reduce over.
    """

    name: str
    replicas: int
    replica_index: torch.Tensor
    traced = False

    def size(self) -> int:
        return self.replicas

    def index(self) -> torch.Tensor:
        return self.replica_index.clone()

    def psum(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(_Psum.apply(self.replica_index, *leaves)) if leaves else []

    def all_gather(self, leaves: list[torch.Tensor], tiled: bool) -> list[torch.Tensor]:
        if tiled:
            for x in leaves:
                if x.dim() == 0:
                    raise ValueError(
                        "all_gather(..., tiled=True) concatenates along dim 0, but a leaf is a "
                        "0-d tensor. Use tiled=False to stack scalars."
                    )
        if not leaves:
            return []
        return list(_AllGather.apply(tiled, self.replicas, self.replica_index, *leaves))

    def psum_scatter(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return (
            list(_PsumScatter.apply(self.replicas, self.replica_index, *leaves)) if leaves else []
        )

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        return list(_Broadcast.apply(src, self.replica_index, *leaves)) if leaves else []


_UNMAPPED = object()


def _prefix_dims(dims: Any, tree: Any, what: str) -> list[int | None]:
    """Broadcast a prefix pytree of ints/None (``None`` = not mapped) to ``tree``'s leaves."""
    marked = optree.tree_map(lambda d: _UNMAPPED if d is None else d, dims, none_is_leaf=True)
    for d in optree.tree_leaves(marked):
        if d is not _UNMAPPED and (not isinstance(d, int) or isinstance(d, bool)):
            raise TypeError(
                f"vmap: {what} must be made of ints and None, got {d!r} in {dims!r}. "
                "Use an int for a mapped dimension and None for an unmapped value."
            )
    try:
        flat = optree.broadcast_prefix(marked, tree)
    except ValueError:
        raise ValueError(
            f"vmap: {what} {dims!r} must be an int, None, or a pytree prefix of the value it "
            f"describes, whose structure is {optree.tree_structure(tree)}. Give one entry "
            "per subtree, e.g. (0, None) for a pair."
        ) from None
    return [None if d is _UNMAPPED else d for d in flat]


def _flat_inputs(
    in_dims: Any, args: tuple[Any, ...]
) -> tuple[list[Any], list[int | None], list[optree.PyTreeSpec], int, torch.device]:
    if in_dims is None or isinstance(in_dims, int):
        per_arg: Sequence[Any] = [in_dims] * len(args)
    elif isinstance(in_dims, tuple) and len(in_dims) == len(args):
        per_arg = in_dims
    else:
        raise ValueError(
            f"vmap: in_dims={in_dims!r} must be an int, None, or a tuple with one entry per "
            f"positional argument ({len(args)} were passed)."
        )
    leaves: list[Any] = []
    dims: list[int | None] = []
    specs: list[optree.PyTreeSpec] = []
    sizes: dict[int, str] = {}
    device = None
    for i, (arg, arg_dims) in enumerate(zip(args, per_arg)):
        paths, arg_leaves, spec = optree.tree_flatten_with_path(arg)
        arg_flat_dims = _prefix_dims(arg_dims, arg, f"in_dims for argument {i}")
        for path, leaf, d in zip(paths, arg_leaves, arg_flat_dims):
            where = f"argument {i} leaf {path_str(path)}"
            if d is None:
                continue
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(
                    f"vmap: {where} is a {type(leaf).__name__}, not a tensor, but in_dims maps "
                    f"it over dim {d}. Give it in_dims None (e.g. in_dims=(0, None))."
                )
            if not -leaf.dim() <= d < leaf.dim():
                raise ValueError(
                    f"vmap: in_dims maps {where} over dim {d}, but it has only {leaf.dim()} "
                    "dims. Give the replica dimension's index."
                )
            sizes.setdefault(leaf.shape[d], where)
            if device is None:
                device = leaf.device
        leaves += arg_leaves
        dims += arg_flat_dims
        specs.append(spec)
    if not sizes:
        raise ValueError(
            "vmap: no tensor input is mapped, so the number of replicas is unknown. Map at "
            "least one tensor over its replica dimension with in_dims (e.g. in_dims=0)."
        )
    if len(sizes) > 1:
        found = ", ".join(f"{n} ({where})" for n, where in sizes.items())
        raise ValueError(
            f"vmap: the mapped dimensions have different sizes: {found}. Every mapped input "
            "needs the same number of replicas."
        )
    assert device is not None
    return leaves, dims, specs, next(iter(sizes)), device


def _vmap_call(
    fn: Callable[..., Any],
    axis_name: str,
    in_dims: Any,
    out_dims: Any,
    randomness: str,
    chunked: _invariant.Invariant | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    leaves, dims, specs, replicas, device = _flat_inputs(in_dims, args)
    counts = [spec.num_leaves for spec in specs]
    uniform = out_dims is None or isinstance(out_dims, int)
    # A pytree out_dims is a prefix of the optree output, known only once fn returns;
    # torch.func.vmap reads out_dims after fn returns, so this list is filled in then.
    flat_out_dims: list[int | None] = []
    out_spec: list[optree.PyTreeSpec] = []

    def run(replica_index: torch.Tensor, flat: list[Any]) -> list[Any]:
        it = iter(flat)
        inner_args = [
            optree.tree_unflatten(spec, [next(it) for _ in range(n)])
            for spec, n in zip(specs, counts)
        ]
        with _axes.bind(VmapAxis(axis_name, replicas, replica_index)):
            out = _invariant.within(chunked, axis_name, (), _gathered_call, fn, inner_args, kwargs)
        out_leaves, spec = optree.tree_flatten(out)
        if not uniform:
            flat_out_dims[:] = _prefix_dims(out_dims, out, "out_dims")
        out_spec.append(spec)
        return out_leaves

    run.__name__ = getattr(fn, "__name__", run.__name__)
    flat_out = torch.func.vmap(
        run,
        in_dims=(0, dims),
        # a list (filled in by run) where torch's stub says int or tuple; vmap takes any pytree
        out_dims=out_dims if uniform else flat_out_dims,  # type: ignore[arg-type]
        randomness=randomness,
    )(torch.arange(replicas, device=device), leaves)
    return optree.tree_unflatten(out_spec[0], flat_out)


def _gathered_call(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)``, with each ``fddp.ShardedParams`` argument gathered for it and
    the output in its position cut back into shards, as ``data_parallel`` runs a step (but for
    the functions that take the shards themselves, such as ``fddp.full_params``)."""
    step = functools.partial(fn, **kwargs) if kwargs else fn
    if fn in TAKES_SHARDS:
        return step(*args)
    where = f"fddp.vmap({getattr(fn, '__name__', 'fn')})"
    return gathering(step, tuple(args), where)(*args)


def vmap(
    fn: Callable[..., Any],
    *,
    axis_name: str = DEFAULT_AXIS,
    in_dims: Any = 0,
    out_dims: Any = 0,
    randomness: str = "error",
    invariant: _invariant.Invariant | int | None = None,
) -> Callable[..., Any]:
    """Run ``fn`` as N simulated replicas in one process, one per entry of a mapped dimension.

    Like ``jax.vmap`` with ``axis_name``: ``fn`` is vectorised with ``torch.func.vmap``, and
    inside it the collectives (``psum``, ``pmean``, ``psum_scatter``, ``all_gather``, ``broadcast``,
    ``axis_index``, ``axis_size``) with that axis name act across the mapped dimension exactly
    as they act across the ranks of ``data_parallel``. So ``fddp.vmap(step)`` on arguments with
    a leading replica dimension computes what N ranks would, each holding one slice.
    Gradients flow through the collectives (psum's vjp is psum), nested ``fddp.vmap`` calls with
    different axis names compose, and ``fn`` may itself use ``torch.func`` transforms (e.g. an
    inner ``torch.func.vmap`` for per-example gradients).

    Args:
        fn: the per-replica function; arguments and results are optree pytrees.
        axis_name: the name collectives inside ``fn`` use for the replica dimension.
        in_dims: the mapped dimension of each positional argument, as for
            ``torch.func.vmap``: an int, ``None`` (not mapped: the same value on every
            replica), or a tuple with one entry per argument, each a pytree prefix of it.
            Keyword arguments are never mapped.
        out_dims: where the replica dimension goes in each result (int, ``None`` for results
            that are the same on every replica, or a pytree prefix of the result).
        randomness: ``torch.func.vmap``'s ``"error"``, ``"different"`` or ``"same"``.
        invariant: a chunk size or :class:`fddp.Invariant`, as for ``data_parallel``: the
            gradients are computed per chunk on each replica's own slice (unbatched, the
            kernels a rank runs) and averaged exactly, bitwise what any number of ranks gives.

    Returns:
        A function with ``fn``'s signature whose mapped arguments carry the replica dimension.

    >>> import fddp, torch
    >>> x = torch.tensor([1.0, 2.0, 6.0])
    >>> fddp.vmap(lambda x: fddp.psum(x))(x)
    tensor([9., 9., 9.])
    >>> fddp.vmap(lambda x: x - fddp.pmean(x) + fddp.axis_index())(x)
    tensor([-2.,  0.,  5.])
    """

    chunked = _invariant.checked(invariant)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _vmap_call(fn, axis_name, in_dims, out_dims, randomness, chunked, args, kwargs)

    return wrapper
