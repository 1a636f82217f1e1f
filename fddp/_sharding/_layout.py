"""The one bucket layout of ZeRO-1/2/3: whole leaves in flat buckets, each cut in N chunks."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch.fx import traceback as fx_traceback

from fddp._base._annotations import AXIS_INDEX
from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._collectives import _bucket_policy
from fddp._collectives._ops import ProcessAxis, axis_index, named_axis

Shapes = tuple[tuple[tuple[int, ...], torch.dtype], ...]  # (shape, dtype) of each leaf


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves (indices in flattening order) of one dtype reduced together.

    The bucket's ``size`` elements are padded to ``replicas * chunk``; replica ``r`` owns
    elements ``r * chunk`` to ``(r + 1) * chunk``: ``torch.chunk``'s split, so a shard is a
    ``Shard(0)`` DTensor piece of the bucket.
    """

    leaves: tuple[int, ...]
    size: int
    chunk: int  # elements per replica: ceil(size / replicas)


def cap_bytes(bucket_cap_mb: float | None, where: str) -> int | None:
    """``bucket_cap_mb`` in bytes (None: the default rule), refused unless positive."""
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise UsageValueError(f"{where}: bucket_cap_mb must be positive; got {bucket_cap_mb}.")
    return None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * 2**20))


@functools.lru_cache(maxsize=64)
def buckets(shapes: Shapes, replicas: int, cap: int | None) -> tuple[Bucket, ...]:
    """Whole leaves in flattening order, one dtype per bucket, each up to the cap (None: the
    rule of thumb, from the bytes alone: noise in a measurement must not move a layout)."""
    nbytes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
    if cap is None:
        cap = _bucket_policy.rule_of_thumb(sum(nbytes), _bucket_policy.FIRST_CAP_BYTES)
    packed = _bucket_policy.pack(nbytes, [dtype for _, dtype in shapes], cap)
    out = []
    for members in sorted(packed, key=lambda members: members[0]):
        size = sum(math.prod(shapes[i][0]) for i in members)
        out.append(Bucket(tuple(members), size, -(-size // replicas)))
    return tuple(out)


def layout_of(
    leaves: list[torch.Tensor], replicas: int, cap: int | None, where: str
) -> tuple[Bucket, ...]:
    """The buckets of ``leaves``; ``where`` names the function the user called."""
    for x in leaves:
        if not x.is_floating_point():
            raise UsageTypeError(
                f"{where}: a parameter has dtype {x.dtype}; sharding needs floating-point "
                "parameters. Keep integer values out of the parameter tree (in the buffers)."
            )
    return buckets(tuple((tuple(x.shape), x.dtype) for x in leaves), replicas, cap)


def flat_bucket(leaves: list[torch.Tensor], bucket: Bucket, replicas: int) -> torch.Tensor:
    """The bucket's leaves as one vector, zero-padded to ``replicas * chunk`` elements."""
    parts = [leaves[i].reshape(-1) for i in bucket.leaves]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    pad = replicas * bucket.chunk - bucket.size
    return F.pad(flat, (0, pad)) if pad else flat


def _own_chunk(flat: torch.Tensor, bucket: Bucket, index: torch.Tensor) -> torch.Tensor:
    """This replica's chunk of a padded bucket (``index`` may be batched by ``fddp.vmap``)."""
    return flat.view(-1, bucket.chunk).index_select(0, index.reshape(1)).reshape(-1)


def _own_slice(
    leaves: list[torch.Tensor], bucket: Bucket, rank: int, replicas: int
) -> torch.Tensor:
    """Chunk ``rank`` of a padded bucket, built from a slice of every leaf (empty where it holds
    none of it) and its zero padding: the same operators on every rank, whose integers (the
    slices' bounds and the padding's size) are this rank's own, annotated as such by the
    layout where there are several replicas (the ranks compare everything else of a traced
    step)."""
    numels = [leaves[i].numel() for i in bucket.leaves]
    first = leaves[bucket.leaves[0]]
    own = {AXIS_INDEX: "the sharded layout: this rank's chunk of a bucket"} if replicas > 1 else {}
    with fx_traceback.annotate(own):
        parts = [
            leaves[i].reshape(-1).narrow(0, lo, hi - lo)
            for i, (lo, hi) in zip(bucket.leaves, leaf_spans(bucket, numels, rank))
        ]
        held = sum(part.numel() for part in parts)
        return torch.cat([*parts, first.new_zeros(bucket.chunk - held)])


def leaf_spans(bucket: Bucket, numels: list[int], rank: int) -> list[tuple[int, int]]:
    """For each leaf of ``bucket``, of ``numels`` elements each: the span ``(lo, hi)`` of its
    flattened elements that chunk ``rank`` holds (``(0, 0)``: none)."""
    start, stop = rank * bucket.chunk, (rank + 1) * bucket.chunk
    spans, offset = [], 0
    for numel in numels:
        lo, hi = offset, offset + numel
        offset = hi
        first, last = max(lo, start), min(hi, stop)
        spans.append((first - lo, last - lo) if first < last else (0, 0))
    return spans


def own_shard(
    leaves: list[torch.Tensor], bucket: Bucket, replicas: int, axis_name: str
) -> torch.Tensor:
    """This replica's chunk of ``bucket`` of ``leaves`` on ``axis_name``."""
    axis = named_axis(axis_name)
    # The rank is a constant: copy only this shard. Not under Dynamo, where a fully sharded
    # step takes this general path: slicing by rank would give every rank a different graph,
    # and the compiler could then schedule the parameter gathers differently.
    if isinstance(axis, ProcessAxis) and not torch.compiler.is_compiling():
        return _own_slice(leaves, bucket, axis.group_rank, replicas)
    return _own_chunk(flat_bucket(leaves, bucket, replicas), bucket, axis_index(axis_name))


def bucket_views(
    full: torch.Tensor, bucket: Bucket, shapes: list[torch.Size] | tuple[tuple[int, ...], ...]
) -> list[torch.Tensor]:
    """The leaves of ``bucket`` (of shapes ``shapes``, by leaf index), as views of its gathered
    flat buffer ``full``."""
    sizes = [math.prod(shapes[i]) for i in bucket.leaves]
    parts = full[: bucket.size].split(sizes) if len(sizes) > 1 else [full[: bucket.size]]
    return [p.view(shapes[i]) for p, i in zip(parts, bucket.leaves)]


def bucket_piece(bucket: Bucket, rank: int) -> tuple[int, int, int, int]:
    """``(shard_length, offset, length, bucket_size)``: replica ``rank``'s valid elements of
    ``bucket`` are ``length`` elements at ``offset`` (the rest of its shard is padding)."""
    offset = rank * bucket.chunk
    return bucket.chunk, offset, max(0, min(bucket.chunk, bucket.size - offset)), bucket.size


def pieces(buckets: tuple[Bucket, ...], replicas: int, index: torch.Tensor) -> torch.Tensor:
    """:func:`bucket_piece` of every bucket for the replica ``index``, one int64 row each."""
    rows = [[list(bucket_piece(b, r)) for b in buckets] for r in range(replicas)]
    table = torch.tensor(rows, dtype=torch.int64, device=index.device)
    return table.index_select(0, index.reshape(1)).squeeze(0)
