"""While a fully sharded step is traced: which full tensors are gathered parameter buckets."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """A full leaf: leaf ``position`` of bucket ``bucket`` of ``layout``, whose shard on this
    replica is ``shard``; ``kind`` is ``"params"`` or ``"updates"``."""

    tensor: torch.Tensor  # kept alive, so that its id is not reused while the record lasts
    version: int
    layout: object
    bucket: int
    position: int
    count: int  # leaves in the bucket
    kind: str
    shard: torch.Tensor


_records: list[dict[int, Piece]] = []


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Note gathered leaves inside the block (one trace of a fully sharded step).

    A fully sharded step sees its parameters gathered from this replica's shards, and its
    optimizer (``shard_state``) computes this replica's shard of every update. When the step
    returns ``params + updates`` built from exactly those, this replica's shard of the result
    is ``shard + update shard``, with no gather of the updates: the record lets the optimizer,
    ``apply_updates`` and the transform recognise that case. Tensors are recognised by identity
    and version (an in-place write after they were noted makes them unknown), so anything else
    the step computes takes the general path: the shards cut from the full result.
    """
    _records.append({})
    try:
        yield
    finally:
        _records.pop()


def active() -> bool:
    return bool(_records) and not torch.compiler.is_compiling()


def note(
    leaves: list[torch.Tensor], layout: object, bucket: int, kind: str, shard: torch.Tensor
) -> None:
    """Record ``leaves`` as the full leaves, in order, of ``bucket``, whose shard is ``shard``."""
    if not active():
        return
    record = _records[-1]
    for position, leaf in enumerate(leaves):
        record[id(leaf)] = Piece(
            leaf, leaf._version, layout, bucket, position, len(leaves), kind, shard
        )


def bucket_of(leaves: list[torch.Tensor], kind: str) -> Piece | None:
    """The piece that ``leaves`` are, in order, all of one bucket's leaves (as noted, unchanged
    since), or None."""
    if not active() or not leaves:
        return None
    record = _records[-1]
    pieces = [record.get(id(x)) for x in leaves]
    first = pieces[0]
    if first is None or first.count != len(leaves):
        return None
    for position, (leaf, piece) in enumerate(zip(leaves, pieces)):
        if (
            piece is None
            or piece.tensor is not leaf
            or piece.version != leaf._version
            or piece.kind != kind
            or piece.layout is not first.layout
            or piece.bucket != first.bucket
            or piece.position != position
        ):
            return None
    return first


def follow_update(
    params: list[torch.Tensor], updates: list[torch.Tensor], results: list[torch.Tensor]
) -> None:
    """After ``results[i] = params[i] + updates[i]``: where a whole bucket of ``params`` was
    gathered and its ``updates`` are the gathered update shards of that bucket, the results
    are that bucket's new parameters, whose shard is the sum of the two shards."""
    if not active():
        return
    record = _records[-1]
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(params):
        piece = record.get(id(p))
        if piece is not None and piece.kind == "params" and piece.tensor is p:
            buckets.setdefault((id(piece.layout), piece.bucket), []).append(i)
    for members in buckets.values():
        param = bucket_of([params[i] for i in members], "params")
        update = bucket_of([updates[i] for i in members], "updates")
        if param is None or update is None:
            continue
        if update.layout is not param.layout or update.bucket != param.bucket:
            continue
        shard = param.shard + update.shard.to(param.shard.dtype)
        note([results[i] for i in members], param.layout, param.bucket, "params", shard)
