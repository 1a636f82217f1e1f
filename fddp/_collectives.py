"""Collectives over a named axis: psum, pmean, all_gather, broadcast, axis_index, axis_size.

Every collective takes a pytree and acts per leaf. Over a process-group axis the work is done by
``torch.distributed._functional_collectives``: traced inside ``data_parallel`` they become graph
nodes that the scheduler buckets and overlaps; run eagerly, the leaves of one call are packed
into flat buckets. Under ``fddp.vmap`` the same calls reduce over the mapped dimension.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback

from fddp import _axes, _runtime
from fddp._axes import DEFAULT_AXIS
from fddp._tree import leaves_with_paths, tensor_leaves

EAGER_BUCKET_BYTES = 25 * 2**20


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of a group; its vjp is the same sum of the cotangents."""

    @staticmethod
    def forward(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group_name), None


def _all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    if x.requires_grad:
        return _AllReduceSum.apply(x, group_name)
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))


def _eager_buckets(leaves: list[torch.Tensor]) -> list[list[int]]:
    """Leaves of one dtype and device, in order, up to ``EAGER_BUCKET_BYTES`` per bucket."""
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, x in enumerate(leaves):
        key, nbytes = (x.dtype, x.device), x.numel() * x.element_size()
        if key in open_buckets:
            bucket, size = open_buckets[key]
            if size + nbytes <= EAGER_BUCKET_BYTES:
                open_buckets[key] = ([*bucket, i], size + nbytes)
                continue
            done.append(bucket)
        open_buckets[key] = ([i], nbytes)
    done.extend(bucket for bucket, _ in open_buckets.values())
    return sorted(done, key=lambda bucket: bucket[0])


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
    group_name: str
    group_size: int
    group_rank: int
    traced: bool = False

    def size(self) -> int:
        return self.group_size

    def index(self) -> torch.Tensor:
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
                    _AllGather.apply(part, self.group_name, self.group_size, self.group_rank)
                )
            else:
                out.append(_gather(part, self.group_name, self.group_size))
        return out

    def broadcast(self, leaves: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """One broadcast per dtype for the whole call (traced too: the results are usually
        needed at once, as BatchNorm buffers at the start of a step are)."""
        return _packed(
            leaves, lambda flat: funcol.wait_tensor(funcol.broadcast(flat, src, self.group_name))
        )


def _gather(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    if size == 1:
        return x.clone()
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group_name))


class _AllGather(torch.autograd.Function):
    """Concatenate along dim 0 over ranks; the vjp sums cotangents, keeps this rank's rows."""

    @staticmethod
    def forward(x: torch.Tensor, group_name: str, size: int, rank: int) -> torch.Tensor:
        return _gather(x, group_name, size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group_name, ctx.size, ctx.rank = inputs[1], inputs[2], inputs[3]
        ctx.rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # the rank comes in as an argument: Dynamo cannot trace a group lookup in backward
        total = _AllReduceSum.apply(grad.contiguous(), ctx.group_name)
        return total.narrow(0, ctx.rank * ctx.rows, ctx.rows), None, None, None


def process_axis(
    name: str, group: dist.ProcessGroup | None, *, traced: bool = False
) -> ProcessAxis:
    """Describe ``group`` (default: the world) as an axis called ``name``.

    ``traced`` axes issue one collective per leaf, annotated with its path, for the scheduler to
    bucket; eager ones pack each call's leaves into flat buckets themselves.
    """
    _runtime.init()
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return ProcessAxis(name, group.group_name, size, rank, traced)


def default_process_axis() -> ProcessAxis:
    """The axis ``"data"`` means outside every transform: the default process group."""
    return process_axis(DEFAULT_AXIS, None)


def _map_tensors(
    tree: Any, what: str, axis: _axes.Axis, fn: Any, *, bucketed_by_scheduler: bool = False
) -> Any:
    """Apply ``fn(list_of_leaves)`` to the tensor leaves of ``tree``.

    For a collective the scheduler buckets (``bucketed_by_scheduler``) on a traced axis, each
    leaf goes through ``fn`` alone inside an annotation naming its path, so the scheduler can
    group the per-leaf collectives and report which leaves each bucket holds.
    """
    leaves, spec = tensor_leaves(tree, what)
    if not (axis.traced and bucketed_by_scheduler):
        return optree.tree_unflatten(spec, fn(leaves))
    out = []
    for path, leaf in zip(leaves_with_paths(tree)[0], leaves):
        with fx_traceback.annotate({"fddp_leaf": path}):
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
    axis = _axes.lookup(axis_name)
    return _map_tensors(tree, "psum's tree", axis, axis.psum, bucketed_by_scheduler=True)


def pmean(tree: Any, axis_name: str = DEFAULT_AXIS) -> Any:
    """Average every leaf over the replicas of ``axis_name``: ``psum(leaf) / axis_size``.

    Inside ``data_parallel``, ``pmean`` of the gradients is the one line that makes N ranks with
    batch B train like one process with batch N*B.

    >>> import fddp, torch
    >>> fddp.pmean(torch.tensor([2.0, 4.0]))
    tensor([2., 4.])
    """
    axis = _axes.lookup(axis_name)
    n = axis.size()
    return _map_tensors(
        tree,
        "pmean's tree",
        axis,
        lambda xs: [y / n for y in axis.psum(xs)],
        bucketed_by_scheduler=True,
    )


def all_gather(tree: Any, axis_name: str = DEFAULT_AXIS, *, tiled: bool = False) -> Any:
    """Gather every leaf from all replicas of ``axis_name``.

    Per leaf of shape ``S``: ``tiled=False`` stacks into ``(N, *S)`` with replica ``r``'s value
    at index ``r``; ``tiled=True`` concatenates along dim 0 into ``(N*S[0], *S[1:])``.

    >>> import fddp, torch
    >>> fddp.all_gather(torch.tensor([1.0, 2.0])).shape
    torch.Size([1, 2])
    """
    axis = _axes.lookup(axis_name)
    return _map_tensors(tree, "all_gather's tree", axis, lambda xs: axis.all_gather(xs, tiled))


def broadcast(tree: Any, src: int = 0, axis_name: str = DEFAULT_AXIS) -> Any:
    """Replace every leaf with replica ``src``'s value on every replica of ``axis_name``.

    >>> import fddp, torch
    >>> fddp.broadcast(torch.tensor([5.0]))
    tensor([5.])
    """
    axis = _axes.lookup(axis_name)
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
    return _axes.lookup(axis_name).index()


def axis_size(axis_name: str = DEFAULT_AXIS) -> int:
    """The number of replicas along ``axis_name``.

    >>> import fddp
    >>> fddp.axis_size()
    1
    """
    return _axes.lookup(axis_name).size()
