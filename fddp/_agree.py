"""Cross-rank agreement: every rank compares the same digest; a mismatch names the first difference.

Every check that ranks hold the same thing (replicated arguments, call signatures, the
collective sequence of a compiled step, checkpoint calls) describes that thing as labelled lines
and goes through :func:`find_difference`: one all-reduce of a 56-bit digest when all agree, and
only on a mismatch an all-gather of the lines to say where they differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

Line = tuple[str, str]  # (what it describes, its value on this rank)


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first line on which rank ``rank`` differs from rank 0."""

    rank: int
    label: str
    theirs: str
    ours: str

    def __str__(self) -> str:
        return f"{self.label} is {self.theirs} on rank {self.rank} but {self.ours} on rank 0"


def digest(lines: Sequence[Line]) -> int:
    """A 56-bit digest of ``lines``, the same in every process (``hash`` of a str is not)."""
    text = "\n".join(f"{label}\t{value}" for label, value in lines).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class DigestCheck:
    """One all-reduce of a digest, in flight: :meth:`same` waits and says if all ranks agree."""

    def __init__(self, value: int, group: dist.ProcessGroup | None) -> None:
        self.value = value
        self._bounds = torch.tensor([value, -value], dtype=torch.int64)
        self._work = dist.all_reduce(self._bounds, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def same(self) -> bool:
        assert self._work is not None
        self._work.wait()
        return int(self._bounds[0]) == self.value == -int(self._bounds[1])


def _same_everywhere(value: int, group: dist.ProcessGroup | None) -> bool:
    return DigestCheck(value, group).same()


def first_difference(everyone: list[list[Line]]) -> Difference:
    """The first line on which some rank differs from rank 0, given every rank's lines."""
    reference = everyone[0]
    for r, lines in enumerate(everyone[1:], start=1):
        missing = ("", "<none>")
        for i, (theirs, ours) in enumerate(
            itertools.zip_longest(lines, reference, fillvalue=missing)
        ):
            if theirs == ours:
                continue
            if theirs[0] == ours[0] or not (theirs[0] and ours[0]):
                return Difference(r, theirs[0] or ours[0], theirs[1], ours[1])
            return Difference(
                r, f"entry {i}", f"{theirs[0]} ({theirs[1]})", f"{ours[0]} ({ours[1]})"
            )
    raise AssertionError("digests differed but the lines are equal")


def find_difference(
    lines: Sequence[Line],
    group: dist.ProcessGroup | None = None,
    *,
    known_digest: int | None = None,
) -> Difference | None:
    """Compare ``lines`` across the ranks of ``group``; None when every rank holds the same.

    Every rank must call this at the same point. ``known_digest`` (``digest(lines)``, cached by
    the caller) skips hashing on the fast path. The result is the same on every rank.
    """
    if dist.get_world_size(group) == 1:
        return None
    value = digest(lines) if known_digest is None else known_digest
    if _same_everywhere(value, group):
        return None
    return gather_difference(lines, group)


def gather_lines(lines: Sequence[Line], group: dist.ProcessGroup | None) -> list[list[Line]]:
    """Every rank's lines (an all-gather), once every rank knows that the digests differ."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [tuple(line) for line in lines], group=group)
    return [[tuple(line) for line in theirs] for theirs in everyone]


def gather_difference(lines: Sequence[Line], group: dist.ProcessGroup | None) -> Difference:
    """The first difference, once every rank knows that the digests differ (an all-gather of
    the lines)."""
    return first_difference(gather_lines(lines, group))
