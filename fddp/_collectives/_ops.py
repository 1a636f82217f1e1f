"""Collectives over a named axis: psum, pmean, psum_scatter, all_gather, broadcast, axis_*."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback

from fddp._base import _annotations, _axes, _invariant_marks
from fddp._base._axes import DEFAULT_AXIS
from fddp._base._errors import UsageTypeError
from fddp._base._tree import leaves_with_paths, tensor_leaves
from fddp._collectives import _bucket_policy
from fddp._ranks import _runtime

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

_c10d = torch.ops._c10d_functional
EAGER_BUCKET_BYTES = _bucket_policy.DDP_CAP_BYTES  # trace=False: no overlap to tune for


def _summed(x: torch.Tensor, group_name: GroupName) -> torch.Tensor:
    # The functional ops themselves: traced, funcol.all_reduce adds a wait of its own, and a
    # gradient sum per leaf would cost four graph nodes instead of two.
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of a group; its vjp is the same sum of the cotangents."""

    @staticmethod
    def forward(x: torch.Tensor, group_name: GroupName) -> torch.Tensor:
        return _summed(x, group_name)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group_name), None


def _all_reduce_sum(x: torch.Tensor, group_name: GroupName) -> torch.Tensor:
    if x.requires_grad:
        return _AllReduceSum.apply(x, group_name)
    return _summed(x, group_name)


def _eager_buckets(leaves: list[torch.Tensor]) -> list[list[int]]:
    """Leaves of one dtype and device, in order, up to ``EAGER_BUCKET_BYTES`` per bucket."""
    nbytes = [x.numel() * x.element_size() for x in leaves]
    keys = [(x.dtype, x.device) for x in leaves]
    buckets = _bucket_policy.pack(nbytes, keys, EAGER_BUCKET_BYTES, crossing_joins=False)
    return sorted(buckets, key=lambda bucket: bucket[0])


def _packed(leaves: list[torch.Tensor], fn: Any) -> list[torch.Tensor]:
    """Apply ``fn`` to one flat buffer per bucket of ``leaves``; hand back views of the results."""
    out: list[torch.Tensor] = [None] * len(leaves)  # type: ignore[list-item]
    for bucket in _eager_buckets(leaves):
        flat = torch.cat([leaves[i].reshape(-1) for i in bucket])
        sizes = [leaves[i].numel() for i in bucket]
        for i, part in zip(bucket, fn(flat).split(sizes)):
            out[i] = part.view(leaves[i].shape)
    return out


@dataclasses.dataclass(frozen=True)
class ProcessAxis:
    """An axis whose replicas are the ranks of a ``torch.distributed`` process group."""

    name: str
    group_name: GroupName
    group_size: int
    group_rank: int
    traced: bool = False
    # Gloo's own all-gather and reduce-scatter are swapped for all-to-alls (see gather_rows).
    gloo: bool = False

    def size(self) -> int:
        return self.group_size

    def index(self) -> torch.Tensor:
        # the one value that is per rank by construction
        with fx_traceback.annotate({_annotations.AXIS_INDEX: "the rank (fddp.axis_index)"}):
            return torch.tensor(self.group_rank)

    def psum(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.traced:
            return [_all_reduce_sum(x, self.group_name) for x in leaves]
        if self.group_size == 1:
            return [x.clone() for x in leaves]
        return _packed(leaves, lambda flat: _all_reduce_sum(flat, self.group_name))

    def all_gather(self, leaves: list[torch.Tensor], tiled: bool) -> list[torch.Tensor]:
        out = []
        for x in leaves:
            part = x if tiled else x.unsqueeze(0)
            if x.requires_grad:
                out.append(
                    _AllGather.apply(
                        part, self.group_name, self.group_size, self.group_rank, self.gloo
                    )
                )
            else:
                out.append(gather_rows(part, self.group_name, self.group_size, self.gloo))
        return out

    def psum_scatter(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf, one reduce-scatter along dim 0 (traced: scheduled where its input is ready)."""
        out = []
        for x in leaves:
            if x.requires_grad:
                out.append(_ReduceScatter.apply(x, self.group_name, self.group_size, self.gloo))
            else:
                out.append(_reduce_scatter(x, self.group_name, self.group_size, self.gloo))
        return out

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """One broadcast per dtype for the whole call (traced too: the results are usually
        needed at once, as BatchNorm buffers at the start of a step are)."""
        return _packed(
            leaves, lambda flat: funcol.wait_tensor(funcol.broadcast(flat, src, self.group_name))
        )


def gather_rows(
    x: torch.Tensor, group_name: GroupName, size: int, gloo: bool, *, alone: bool = False
) -> torch.Tensor:
    """Concatenate ``x`` (at least 1-d) from every rank along dim 0.

    ``alone``: the caller guarantees that no other all-gather of the process runs while this
    one does (``_compiler._passes._param_gathers`` runs parameter gathers one at a time), so gloo's
    own all-gather is safe; it sends ``x`` where the all-to-all below sends ``size`` copies.
    """
    if size == 1:
        return x.clone()
    x = x.contiguous()
    if gloo and not alone:
        # Gloo's all-gather (AsyncAllgatherCoalescedWork) corrupts the heap when two run at once
        # on its two worker threads, as a scheduled step's overlapped buckets do (torch 2.13):
        # send every rank a copy of x through the all-to-all instead, the same bytes on the wire.
        copies = x.unsqueeze(0).expand(size, *x.shape).reshape(size * x.shape[0], *x.shape[1:])
        return funcol.wait_tensor(funcol.all_to_all_single(copies, None, None, group_name))
    return funcol.wait_tensor(funcol.all_gather_single(x, 0, group_name))


class _AllGather(torch.autograd.Function):
    """Concatenate along dim 0 over ranks; the vjp sums cotangents, keeps this rank's rows."""

    @staticmethod
    def forward(
        x: torch.Tensor, group_name: GroupName, size: int, rank: int, gloo: bool
    ) -> torch.Tensor:
        return gather_rows(x, group_name, size, gloo)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group_name, ctx.size, ctx.rank = inputs[1], inputs[2], inputs[3]
        ctx.rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        # the rank comes in as an argument: Dynamo cannot trace a group lookup in backward
        total = _AllReduceSum.apply(grad.contiguous(), ctx.group_name)
        rows = (
            {_annotations.AXIS_INDEX: "all_gather's vjp: this rank's rows"} if ctx.size > 1 else {}
        )
        with fx_traceback.annotate(rows):
            own = total.narrow(0, ctx.rank * ctx.rows, ctx.rows)
        return own, None, None, None, None


def _reduce_scatter(x: torch.Tensor, group_name: GroupName, size: int, gloo: bool) -> torch.Tensor:
    if size == 1:
        return x.clone()
    x = x.contiguous()
    if gloo:
        # Gloo's reduce-scatter costs 1.2-1.4x its all-reduce of the same tensor on loopback
        # (2 ranks, 1-16 MiB); its all-to-all moves the bytes a ring reduce-scatter does and,
        # with the local sum, costs 0.85-0.95x the all-reduce (benchmarks/collectives.py).
        # each rank's own blocks
        with fx_traceback.annotate({_annotations.AXIS_INDEX: "psum_scatter: this rank's block"}):
            blocks = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group_name))
        return blocks.view(size, -1, *x.shape[1:]).sum(0)
    return funcol.wait_tensor(funcol.reduce_scatter_single(x, "sum", 0, group_name))


class _ReduceScatter(torch.autograd.Function):
    """Sum over ranks, keep this rank's rows; the vjp gathers the cotangents' rows back."""

    @staticmethod
    def forward(x: torch.Tensor, group_name: GroupName, size: int, gloo: bool) -> torch.Tensor:
        return _reduce_scatter(x, group_name, size, gloo)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group_name, ctx.size, ctx.gloo = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return gather_rows(grad, ctx.group_name, ctx.size, ctx.gloo), None, None, None


def process_axis(
    name: str, group: dist.ProcessGroup | None, *, traced: bool = False
) -> ProcessAxis:
    """Describe ``group`` (default: the world) as an axis called ``name``.

    ``traced`` axes issue one collective per leaf, annotated with its path, for the compiler to
    bucket; eager ones pack each call's leaves into flat buckets themselves.
    """
    _runtime.ensure_group()
    group = group if group is not None else dist.group.WORLD
    assert group is not None  # ensure_group() made the default group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    gloo = dist.get_backend(group) == "gloo"
    return ProcessAxis(name, group.group_name, size, rank, traced, gloo)


def named_axis(name: str) -> _axes.Axis:
    """The axis a collective's ``axis_name`` refers to here: the innermost binding, else, for
    ``"data"``, the default process group."""
    bound = _axes.find(name)
    if bound is not None:
        return bound
    if name == DEFAULT_AXIS:
        return process_axis(DEFAULT_AXIS, None)
    raise _axes.unbound_error(name)


def _map_tensors(
    tree: Any, what: str, axis: _axes.Axis, fn: Any, *, bucketed_by_compiler: bool = False
) -> Any:
    """Apply ``fn(list_of_leaves)`` to the tensor leaves of ``tree``.

    For a collective the compiler buckets (``bucketed_by_compiler``) on a traced axis, each
    leaf goes through ``fn`` alone inside an annotation naming its path, so the compiler can
    group the per-leaf collectives and report which leaves each bucket holds.
    """
    leaves, spec = tensor_leaves(tree, what)
    if not leaves:  # nothing to reduce: the tree as it is (Dynamo may rebuild an empty
        return tree  # defaultdict as a dict)
    if not (axis.traced and bucketed_by_compiler):
        return optree.tree_unflatten(spec, fn(leaves))
    out = []
    for path, leaf in zip(leaves_with_paths(tree)[0], leaves):
        with fx_traceback.annotate({_annotations.LEAF_PATH: path}):
            out.extend(fn([leaf]))
    return optree.tree_unflatten(spec, out)


def psum(tree: Any, axis_name: str = DEFAULT_AXIS) -> Any:
    """Sum every leaf over the replicas of ``axis_name``.

    Per leaf: ``out = sum over replicas r of leaf_r``, the same value on every replica. The
    gradient of ``psum`` is ``psum`` of the cotangent, so it can sit inside a loss (e.g.
    synchronised batch statistics). With a world of one it is the identity.

    >>> import fddp, torch
    >>> fddp.psum({"g": torch.ones(3)})["g"]
    tensor([1., 1., 1.])
    """
    axis = named_axis(axis_name)
    return _map_tensors(tree, "psum's tree", axis, axis.psum, bucketed_by_compiler=True)


def pmean(tree: Any, axis_name: str = DEFAULT_AXIS) -> Any:
    """Average every leaf over the replicas of ``axis_name``: ``psum(leaf) / axis_size``.

    Inside ``data_parallel``, ``pmean`` of the gradients is the one line that makes N ranks with
    batch B train like one process with batch N*B. Integer leaves are a ``TypeError`` (their
    mean is not an integer), the same eagerly, traced and under ``fddp.vmap``: use ``psum``.

    >>> import fddp, torch
    >>> fddp.pmean(torch.tensor([2.0, 4.0]))
    tensor([2., 4.])
    """
    axis = named_axis(axis_name)
    if _invariant_marks.passes_through(tree, axis_name):
        return tree  # already the exact mean over the global batch (fddp.Invariant)
    _require_floating(tree)
    n = axis.size()
    return _map_tensors(
        tree,
        "pmean's tree",
        axis,
        lambda xs: [y / n for y in axis.psum(xs)],
        bucketed_by_compiler=True,
    )


def _require_floating(tree: Any) -> None:
    paths, leaves, _ = leaves_with_paths(tree)
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise UsageTypeError(
                f"pmean: leaf {path} has dtype {leaf.dtype}; the mean of integers is not an "
                "integer. Use fddp.psum for an integer total, cast the leaf to a floating dtype "
                "first, or, for module buffers, fddp.nn.sync_buffers(buffers, 'mean'), which "
                "averages the floating-point buffers and leaves counters such as "
                "num_batches_tracked as they are."
            )


def psum_scatter(tree: Any, axis_name: str = DEFAULT_AXIS, *, tiled: bool = False) -> Any:
    """Sum every leaf over the replicas of ``axis_name`` and hand each replica one block of it.

    As ``jax.lax.psum_scatter`` with ``scatter_dimension=0``. Per leaf of shape ``S`` over
    ``N`` replicas: ``tiled=False`` needs ``S[0] == N`` and replica ``r`` gets
    ``sum(leaf)[r]`` (shape ``S[1:]``); ``tiled=True`` needs ``S[0]`` divisible by ``N`` and
    replica ``r`` gets rows ``r*S[0]/N`` to ``(r+1)*S[0]/N`` of the sum. It moves ``1/N`` of
    the bytes of ``psum`` and is its first half: ``all_gather(psum_scatter(x, tiled=True),
    tiled=True)`` equals ``psum(x)``. Its gradient is the all-gather of the cotangents.

    >>> import fddp, torch
    >>> fddp.psum_scatter(torch.tensor([[1.0, 2.0]]))
    tensor([1., 2.])
    """
    axis = named_axis(axis_name)
    n = axis.size()
    leaves, spec = tensor_leaves(tree, "psum_scatter's tree")
    for x in leaves:
        rows = x.shape[0] if x.dim() else None
        if rows is None or (rows % n if tiled else rows != n):
            need = f"a multiple of {n}" if tiled else f"{n}"
            raise ValueError(
                f"psum_scatter over axis {axis_name!r} ({n} replicas) needs every leaf's dim 0 "
                f"to be {need}; got a leaf of shape {list(x.shape)}. Pad the leaf along dim 0"
                + (" (or use tiled=True for a multiple)." if not tiled else ".")
            )
    flat = leaves if tiled else [x.flatten(0, 1) if x.dim() > 1 else x for x in leaves]
    out = axis.psum_scatter(flat) if flat else []
    if not tiled:
        out = [y.reshape(x.shape[1:]) for x, y in zip(leaves, out)]
    return optree.tree_unflatten(spec, out)


def all_gather(tree: Any, axis_name: str = DEFAULT_AXIS, *, tiled: bool = False) -> Any:
    """Gather every leaf from all replicas of ``axis_name``.

    Per leaf of shape ``S``: ``tiled=False`` stacks into ``(N, *S)`` with replica ``r``'s value
    at index ``r``; ``tiled=True`` concatenates along dim 0 into ``(N*S[0], *S[1:])``.

    >>> import fddp, torch
    >>> fddp.all_gather(torch.tensor([1.0, 2.0])).shape
    torch.Size([1, 2])
    """
    axis = named_axis(axis_name)
    return _map_tensors(tree, "all_gather's tree", axis, lambda xs: axis.all_gather(xs, tiled))


def broadcast(tree: Any, src: int = 0, axis_name: str = DEFAULT_AXIS) -> Any:
    """Replace every leaf with replica ``src``'s value on every replica of ``axis_name``.

    >>> import fddp, torch
    >>> fddp.broadcast(torch.tensor([5.0]))
    tensor([5.])
    """
    axis = named_axis(axis_name)
    size = axis.size()
    if not 0 <= src < size:
        raise ValueError(
            f"broadcast: src={src} is not a replica index of axis "
            f"{axis_name!r}, which has {size} replicas."
        )
    return _map_tensors(tree, "broadcast's tree", axis, lambda xs: axis.broadcast(xs, src))


def axis_index(axis_name: str = DEFAULT_AXIS) -> torch.Tensor:
    """This replica's index along ``axis_name``, as a 0-d int64 tensor.

    >>> import fddp
    >>> fddp.axis_index()
    tensor(0)
    """
    return named_axis(axis_name).index()


def axis_size(axis_name: str = DEFAULT_AXIS) -> int:
    """The number of replicas along ``axis_name``.

    >>> import fddp
    >>> fddp.axis_size()
    1
    """
    return named_axis(axis_name).size()
