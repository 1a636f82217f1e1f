"""A global batch across ranks: even and uneven shards, padded batches, a row-weighted mean."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import optree
import torch
import torch.distributed as dist

from fddp._base._axes import DEFAULT_AXIS
from fddp._base._tree import leaves_with_paths
from fddp._collectives._ops import psum
from fddp._ranks import _runtime

T = TypeVar("T")


def shard(
    global_batch: Any, *, uneven: bool = False, group: dist.ProcessGroup | None = None
) -> Any:
    """This rank's slice, along dim 0, of every tensor leaf of ``global_batch``.

    Rank ``r`` of ``n`` gets rows ``[r*B/n, (r+1)*B/n)``. A leading dimension that does not
    divide by ``n`` is a ``ValueError`` unless ``uneven=True``, which gives the first ranks one
    row more (as ``torch.tensor_split``). Non-tensor leaves are returned unchanged. The slices
    are views of the input.

    >>> import fddp, torch
    >>> fddp.shard({"x": torch.arange(4)})["x"]
    tensor([0, 1, 2, 3])
    """
    n, r = _runtime.world_size(group), _runtime.rank(group)
    paths, leaves, spec = leaves_with_paths(global_batch)
    out = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        if leaf.dim() == 0:
            raise ValueError(
                f"fddp.shard: leaf {path} is a 0-d tensor and has no batch dimension to split; "
                "keep scalars out of the batch tree or give them a leading dimension."
            )
        if leaf.shape[0] % n and not uneven:
            raise ValueError(
                f"fddp.shard: leaf {path} has {leaf.shape[0]} rows, which does not split evenly "
                f"over {n} ranks. Drop or pad the remainder (a global batch size divisible by "
                f"{n}), or pass uneven=True and weight the mean by rows per rank."
            )
        out.append(torch.tensor_split(leaf, n)[r])
    return optree.tree_unflatten(spec, out)


def shard_batches(
    num_samples: int,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[list[int]]:
    """This rank's sample indices for each step of one epoch; every rank gets as many steps.

    The dataset order is ``torch.utils.data.DistributedSampler``'s (``randperm`` seeded with
    ``seed + epoch`` when ``shuffle``), cut into global batches of ``batch_size * num_replicas``
    samples; rank ``r`` takes every ``num_replicas``-th sample of each global batch from the
    ``r``-th on. While global batches are full this is exactly what
    ``DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, ...))`` yields on
    each rank. The difference is the end: DistributedSampler pads the last batches with repeated
    samples (or drops samples with ``drop_last=True``) so that ranks stay even, whereas here the
    last global batch is the remaining samples, split as evenly as possible (some ranks may get
    one row fewer, or none), and every sample counts exactly once. ``drop_last=True`` drops the
    last global batch if it is not full.

    ``fddp.data_parallel`` needs the same argument shapes on every rank in every step, so pad
    each batch to ``batch_size`` rows with :func:`pad_rows`, mask the padding in the loss and
    average with :func:`weighted_pmean` by the real row count: one compiled program for the
    whole epoch, and the exact mean over the samples of the last, smaller global batch.

    The result works as a ``batch_sampler``:
    ``DataLoader(dataset, batch_sampler=fddp.data.shard_batches(len(dataset), 32, shuffle=True,
    epoch=epoch))``.

    Args:
        num_samples: dataset length.
        batch_size: rows per rank in a full step.
        shuffle: permute the dataset each epoch, identically on every rank.
        seed: the shuffle's base seed (DistributedSampler's ``seed``).
        epoch: added to the seed (DistributedSampler's ``set_epoch``).
        drop_last: drop the last global batch when it is not full.
        num_replicas: number of ranks (default: the size of ``group``).
        rank: this rank (default: its rank in ``group``).
        group: process group (default: the world).

    Returns:
        One list of dataset indices per step.

    >>> import fddp
    >>> fddp.data.shard_batches(5, 2, num_replicas=2, rank=0)
    [[0, 2], [4]]
    >>> fddp.data.shard_batches(5, 2, num_replicas=2, rank=1)
    [[1, 3], []]
    """
    if num_replicas is None:
        num_replicas = _runtime.world_size(group)
    if rank is None:
        rank = _runtime.rank(group)
    if batch_size < 1 or num_samples < 0:
        raise ValueError(
            f"shard_batches: batch_size must be >= 1 and num_samples >= 0, got "
            f"batch_size={batch_size}, num_samples={num_samples}."
        )
    if not 0 <= rank < num_replicas:
        raise ValueError(f"shard_batches: rank {rank} is not in [0, {num_replicas}).")
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=generator).tolist()
    else:
        order = list(range(num_samples))
    per_step = batch_size * num_replicas
    end = num_samples - num_samples % per_step if drop_last else num_samples
    return [
        order[start + rank : min(start + per_step, end) : num_replicas]
        for start in range(0, end, per_step)
    ]


def pad_rows(batch: Any, rows: int) -> tuple[Any, torch.Tensor]:
    """Pad every tensor leaf of ``batch`` with zero rows to ``rows`` rows; return a row mask too.

    The mask is a float tensor of shape ``(rows,)``: 1 for the batch's rows, 0 for padding. With
    every rank padding to the same ``rows``, a data_parallel step sees one input shape on every
    rank and every step (one compiled program, no rank compiling alone); weight per-row losses
    by the mask and average with :func:`weighted_pmean` by ``mask.sum()``.

    Args:
        batch: pytree whose tensor leaves share their leading (row) dimension.
        rows: the padded number of rows (the full per-rank batch size).

    Returns:
        ``(padded_batch, mask)``.

    >>> import fddp, torch
    >>> batch, mask = fddp.data.pad_rows({"x": torch.ones(2, 3)}, 4)
    >>> batch["x"].shape, mask
    (torch.Size([4, 3]), tensor([1., 1., 0., 0.]))
    """
    paths, leaves, spec = leaves_with_paths(batch)
    tensors = [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("pad_rows: the batch holds no tensor to pad.")
    have = {x.shape[0] if x.dim() else None for _, x in tensors}
    if len(have) != 1 or None in have:
        raise ValueError(
            "pad_rows: every tensor leaf needs the same leading (row) dimension; got "
            + ", ".join(f"{p}: {list(x.shape)}" for p, x in tensors[:4])
        )
    n = tensors[0][1].shape[0]
    if n > rows:
        raise ValueError(f"pad_rows: the batch has {n} rows, more than rows={rows}.")
    out = [
        torch.cat([x, x.new_zeros(rows - n, *x.shape[1:])]) if isinstance(x, torch.Tensor) else x
        for x in leaves
    ]
    mask = torch.zeros(rows, device=tensors[0][1].device)
    mask[:n] = 1
    return optree.tree_unflatten(spec, out), mask


def weighted_pmean(tree: Any, weight: float | torch.Tensor, axis_name: str = DEFAULT_AXIS) -> Any:
    """Average every leaf over the replicas of ``axis_name``, weighting replica ``r`` by ``w_r``.

    Per leaf: ``sum_r w_r * leaf_r / sum_r w_r``. With ``weight`` the number of rows a replica's
    loss and gradients were averaged over, the result is the mean over the global batch even when
    replicas hold different numbers of rows (the last batch of an epoch). A replica with weight 0
    (no rows) contributes nothing, even if its leaves are NaN (the mean of an empty batch). The
    weights travel in the same all-reduce as the leaves.

    Args:
        tree: pytree of floating-point tensors.
        weight: this replica's weight: a number or a 0-d tensor, >= 0.
        axis_name: the replica axis.

    >>> import fddp, torch
    >>> fddp.data.weighted_pmean({"g": torch.tensor([2.0, 4.0])}, weight=3)
    {'g': tensor([2., 4.])}
    """
    leaves, spec = optree.tree_flatten(tree)
    if not leaves:
        return tree
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                "weighted_pmean: every leaf must be a floating-point tensor; got "
                f"{type(leaf).__name__ if not isinstance(leaf, torch.Tensor) else leaf.dtype}."
            )
    w = torch.as_tensor(weight, dtype=torch.float32, device=leaves[0].device)
    if w.dim() != 0:
        raise ValueError(
            f"weighted_pmean: weight must be a number or a 0-d tensor, got shape {list(w.shape)}; "
            "pass this replica's row count."
        )
    scaled = [torch.where(w > 0, x * w.to(x.dtype), torch.zeros_like(x)) for x in leaves]
    *sums, total = psum([*scaled, w], axis_name)
    return optree.tree_unflatten(spec, [s / total.to(s.dtype) for s in sums])


def lockstep(iterable: Iterable[T], *, group: dist.ProcessGroup | None = None) -> Iterator[T]:
    """Iterate ``iterable`` on every rank together; raise on all of them if one runs out early.

    Before each item, the ranks exchange one flag saying whether they still have data (a small
    all-gather, as DDP's ``join`` does every iteration). If every rank has an item, it is
    yielded; if none has, iteration stops; if only some have, every rank raises a
    ``ValueError`` naming the ranks that ran out, instead of the others waiting forever in
    the next step's all-reduce.

    >>> import fddp
    >>> list(fddp.data.lockstep([1, 2, 3]))
    [1, 2, 3]
    """
    n = _runtime.world_size(group)
    device = _runtime.local_device()
    iterator = iter(iterable)
    step = 0
    while True:
        try:
            item, has = next(iterator), 1
        except StopIteration:
            item, has = None, 0
        if n > 1:
            flags = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(n)]
            dist.all_gather(flags, torch.tensor([has], dtype=torch.int32, device=device), group)
            have = [int(f.item()) for f in flags]
        else:
            have = [has]
        if not any(have):
            return
        if not all(have):
            empty = [r for r, h in enumerate(have) if not h]
            raise ValueError(
                f"lockstep: rank(s) {empty} ran out of data after {step} steps while the other "
                "ranks have more; every rank must make the same number of step calls. Shard the "
                "data with fddp.data.shard_batches (the same number of steps everywhere; pad the "
                "last batch with fddp.data.pad_rows and average with fddp.data.weighted_pmean), "
                "or drop the remainder."
            )
        step += 1
        yield item  # type: ignore[misc]
