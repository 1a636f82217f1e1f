"""Which values are the same on every rank: bitwise digests of tensors, compared across ranks."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError
from fddp._base._tree import leaves_with_paths
from fddp._ranks._agree import Line, find_difference

_CHUNK = 1 << 18  # words hashed at once: each int64 temporary is 2 MiB
_WEIGHT = (-7046029254386353131, 1442695040888963407)  # odd 64-bit multipliers (wrapping)
_SECOND = (-4658895280553007687, 6364136223846793005)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in memory order, a flat uint8 view (a copy if it is not contiguous)."""
    t = t.detach() if t.requires_grad else t
    return (t if t.is_contiguous() else t.contiguous()).view(-1).view(torch.uint8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as words, 4 bytes each (int32) where the size allows."""
    raw = _bytes(t)
    return raw.view(torch.int32) if raw.numel() % 4 == 0 else raw


@functools.lru_cache(maxsize=8)
def _position_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``position * multiplier + increment`` of each digest for positions 0 .. _CHUNK - 1."""
    position = torch.arange(_CHUNK, dtype=torch.int64, device=device)
    return position * _WEIGHT[0] + _WEIGHT[1], position * _SECOND[0] + _SECOND[1]


def _terms(words: torch.Tensor) -> torch.Tensor:
    """Per word of ``words`` (int32 or uint8), the four terms a digest sums: ``w * weight``,
    ``w``, ``w^2 * second weight``, ``w^2`` (positions from 0), as rows of an int64 ``(4, n)``
    tensor.

    A run of words starting at position ``s`` instead of 0 sums to the same first two terms
    shifted: ``sum(w * ((p + s) * a + b)) = sum(w * (p * a + b)) + s * a * sum(w)``, exactly in
    wrapping arithmetic, so the weights are computed once (:func:`_position_weights`).
    """
    first, second = _position_weights(words.device)
    n = words.numel()
    terms = torch.empty(4, n, dtype=torch.int64, device=words.device)
    wide = terms[1].copy_(words)
    torch.mul(wide, first[:n], out=terms[0])
    torch.mul(wide, wide, out=terms[3])
    torch.mul(terms[3], second[:n], out=terms[2])
    return terms


def _combine(sums: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The digests ``(first, second)`` of runs whose four term sums are the last dim of
    ``sums``, taken as if each run's positions counted from its own start."""
    first = sums[..., 0] - starts * _WEIGHT[0] * sums[..., 1]
    second = sums[..., 2] - starts * _SECOND[0] * sums[..., 3]
    return torch.stack([first, second], dim=-1)


def _single(words: torch.Tensor) -> torch.Tensor:
    """The digest of one tensor's ``words``: two position-weighted sums in wrapping int64
    arithmetic (exact, order-independent to compute, so equal on every device, and changed by
    a permutation of the words), ``_CHUNK`` words at a time."""
    total = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, max(words.numel(), 1), _CHUNK):
        sums = _terms(words[start : start + _CHUNK]).sum(dim=1)
        total += _combine(sums, torch.tensor(-start, device=words.device))
    return total.cpu()


def _batched(raws: list[torch.Tensor], wide: bool) -> torch.Tensor:
    """The digests of several small tensors' bytes at once, equal to :func:`_single` of each:
    one concatenation, the terms summed by a running sum read at each tensor's end."""
    flat = torch.cat(raws)
    words = flat.view(torch.int32) if wide else flat
    lengths = [r.numel() // (4 if wide else 1) for r in raws]
    ends = torch.tensor(list(itertools.accumulate(lengths)), device=words.device)
    running = torch.cumsum(_terms(words), dim=1)
    at_ends = torch.cat([torch.zeros_like(running[:, :1]), running[:, ends - 1]], dim=1)
    sums = (at_ends[:, 1:] - at_ends[:, :-1]).T
    return _combine(sums, ends - torch.tensor(lengths, device=words.device)).cpu()


def digests(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A ``(len(tensors), 2)`` int64 CPU tensor: a digest of each tensor's exact bits.

    Two tensors of one shape and dtype have the same digest when their bits are equal (NaNs
    included); rows permuted, a square matrix transposed or one bit flipped change it. Small
    tensors are hashed together, a batch per device and word size (a model's thousands of
    biases and norms cost a few operations, not a few each).
    """
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    batches: dict[tuple[torch.device, bool], _Batch] = {}

    def flush(key: tuple[torch.device, bool]) -> None:
        batch = batches.pop(key)
        out[batch.indices] = _batched(batch.raws, wide=key[1])

    for i, t in enumerate(tensors):
        raw = _bytes(t)
        if raw.numel() == 0:  # no bytes: the digest of nothing, (0, 0), as _single computes it
            continue
        wide = raw.numel() % 4 == 0
        count = raw.numel() // 4 if wide else raw.numel()
        if count > _CHUNK:
            out[i] = _single(_words(t))
            continue
        key = (raw.device, wide)
        if key in batches and batches[key].words + count > _CHUNK:
            flush(key)
        batch = batches.setdefault(key, _Batch([], [], 0))
        batch.indices.append(i)
        batch.raws.append(raw)
        batch.words += count
    for key in list(batches):
        flush(key)
    return out


@dataclasses.dataclass
class _Batch:
    indices: list[int]
    raws: list[torch.Tensor]
    words: int


def _describe(leaf: Any, digest: torch.Tensor | None) -> str:
    if not isinstance(leaf, torch.Tensor):
        return repr(leaf)
    text = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}"
    return text if digest is None else text + f" with digest {int(digest[0]) & (2**64 - 1):016x}"


def leaf_lines(
    paths: list[str], leaves: list[Any], known: torch.Tensor | None = None
) -> list[Line]:
    """A line per leaf, labelled ``leaf <path>``: a tensor's dtype, shape and digest, another
    leaf's ``repr`` (``known``: the :func:`digests` of the tensor leaves, where the caller has
    them), for :func:`fddp._ranks._agree.find_difference`."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    by_leaf = iter(digests(tensors) if known is None else known)
    lines = []
    for path, leaf in zip(paths, leaves):
        digest = next(by_leaf) if isinstance(leaf, torch.Tensor) else None
        lines.append((f"leaf {path}", _describe(leaf, digest)))
    return lines


def check_identical(
    tree: Any, group: dist.ProcessGroup | None, what: str, known: torch.Tensor | None = None
) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank if ``tree`` differs between ranks.

    Compares the structure, each leaf's shape and dtype, and a digest of each tensor's bits
    (one small all-reduce when all agree), naming the first leaf that differs. ``known``: the
    :func:`digests` of ``tree``'s tensor leaves, where the caller has them.
    """
    paths, leaves, spec = leaves_with_paths(tree)
    lines = [*leaf_lines(paths, leaves, known), ("the tree structure", str(spec))]
    difference = find_difference(lines, group)
    if difference is not None:
        raise ReplicaMismatchError(
            f"{what} differ between ranks: {difference}. Replicas must start from the same "
            "values: create them from the same seed and model code, or call "
            "fddp.replicate(tree) before training."
        )


def varying(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, known: torch.Tensor | None = None
) -> list[bool]:
    """For each tensor (of the same shapes on every rank), whether its bits differ between ranks
    (``known``: their :func:`digests`, where the caller has them)."""
    local = digests(tensors) if known is None else known
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    stacked = torch.stack(everyone)
    return (stacked != stacked[0]).any(dim=2).any(dim=0).tolist()
