"""Cross-rank agreement: ranks compare one digest of labelled lines; a failure raises everywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Line = tuple[str, str]  # (what it describes, its value on this rank)
PeerError = Callable[[BaseException, int], BaseException]  # (a rank's error, that rank) -> raised
_OUTCOME = "the outcome"


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
    difference = difference_if_any(everyone)
    if difference is None:
        raise AssertionError("digests differed but the lines are equal")
    return difference


def difference_if_any(everyone: list[list[Line]]) -> Difference | None:
    """The first line on which some rank differs from rank 0 (None: all ranks hold the same)."""
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
    return None


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


def raise_everywhere(
    error: BaseException | None,
    group: dist.ProcessGroup | None = None,
    lines: Sequence[Line] = (),
    *,
    peer: PeerError | None = None,
) -> Difference | None:
    """Compare ``lines`` and whether this rank failed (``error``) across the ranks of ``group``.

    If any rank failed, every rank raises: its own ``error`` where it has one, else the lowest
    failing rank's, as :func:`on_rank` (or ``peer``) makes it. Otherwise returns the first
    difference of ``lines``, None when every rank holds the same: one all-reduce of a digest
    when all agree. Every rank of ``group`` calls it at the same point (a collective); the
    caller translates a failure to hear from a rank (``_runtime.peer_failures``).
    """
    if not _distributed(group):
        if error is not None:
            raise error
        return None
    labelled = [(_OUTCOME, "ok" if error is None else "failed"), *lines]
    if _same_everywhere(digest(labelled), group):
        if error is not None:
            raise error  # every rank failed, each raises its own
        return None
    everyone = gather_lines(labelled, group)
    if any(theirs[0] != (_OUTCOME, "ok") for theirs in everyone):
        gather_or_raise(error, None, group, peer=peer)
    return first_difference(everyone)


def gather_or_raise(
    error: BaseException | None,
    value: Any,
    group: dist.ProcessGroup | None = None,
    *,
    peer: PeerError | None = None,
) -> list[Any]:
    """Every rank's ``value`` (an all-gather of objects), or, if any rank failed, the failure
    raised on every rank as by :func:`raise_everywhere`. Without a process group, ``[value]``."""
    if not _distributed(group):
        if error is not None:
            raise error
        return [value]
    pairs: list[Any] = [None] * dist.get_world_size(group)
    mine = (None if error is None else _portable(error), value)
    dist.all_gather_object(pairs, mine, group=group)
    if error is not None:
        raise error
    failed = next(((r, e) for r, (e, _) in enumerate(pairs) if e is not None), None)
    if failed is not None:
        rank, theirs = failed
        raise (peer or on_rank)(theirs, rank) from None
    return [v for _, v in pairs]


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _portable(error: BaseException) -> BaseException:
    """``error`` as another rank can unpickle it, without its traceback and attributes: a
    built-in or fddp exception of the same type and message, else a RuntimeError naming it."""
    kind = type(error)
    if isinstance(error, Exception) and kind.__module__ in ("builtins", "fddp._base._errors"):
        if isinstance(error, OSError) and error.errno is not None:
            return OSError(error.errno, error.strerror, error.filename)
        with contextlib.suppress(Exception):
            return kind(str(error))
    return RuntimeError(f"{kind.__name__}: {error}")


def on_rank(error: BaseException, rank: int) -> BaseException:
    """``error``, raised on ``rank``, as another rank raises it: same type, the rank named."""
    note = f" (on rank {rank})"
    if isinstance(error, OSError) and error.errno is not None:
        return OSError(error.errno, f"{error.strerror}{note}", error.filename)
    first, *rest = str(error).split("\n", 1)
    message = "\n".join([first + note, *rest])
    try:
        return type(error)(message)
    except TypeError:  # a constructor of other arguments
        return RuntimeError(f"{type(error).__name__}: {message}")
