"""The per-call agreement: all ranks run the same step, with the same options and signature."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import NamedTuple

import optree
import torch
import torch.distributed as dist

from fddp._base._errors import ScheduleMismatchError
from fddp._ranks import _runtime
from fddp._ranks._agree import Difference, DigestCheck, Line, digest, first_difference, gather_lines
from fddp._ranks._signature import Signature, leaf_paths
from fddp._sharding import sharded_positions

_LINES_KEPT = 64  # signatures whose lines are kept for the next calls
SMALL_NUMEL = 8  # replicated tensors of at most this many elements have their values checked
_VALUE = "the value of argument leaf "
_COUNT = "the integer value of argument leaf "  # a step count, say: a skipped call


class Small(NamedTuple):
    """A small replicated tensor leaf: its argument, how to reach it there, and its label."""

    argument: int
    reach: optree.PyTreeAccessor
    label: str


class Known(NamedTuple):
    """What a signature's calls check: its lines and their digest, and the small replicated
    tensors whose values are read on every call."""

    lines: list[Line]
    value: int
    small: list[Small]


def small_replicated(args: tuple, replicated: tuple[int, ...]) -> list[Small]:
    """The leaves of the replicated arguments (but sharded parameters) whose values are read on
    every call: CPU tensors of at most ``SMALL_NUMEL`` elements; integer ones first, as a step
    count names a skipped call best."""
    sharded = sharded_positions(args)
    found = []
    for n in sorted({n % len(args) for n in replicated if -len(args) <= n < len(args)}):
        if n in sharded:
            continue
        accessors, leaves, _ = optree.tree_flatten_with_accessor(args[n])
        for reach, x in zip(accessors, leaves):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() <= SMALL_NUMEL:
                inexact = x.is_floating_point() or x.is_complex()
                label = (_VALUE if inexact else _COUNT) + reach.codify(f"[{n}]")  # [1][0].count
                found.append((inexact, Small(n, reach, label)))
    return [small for _, small in sorted(found, key=lambda f: f[0])]


def with_values(value: int, tensors: list[torch.Tensor]) -> int:
    """``value`` (a signature's digest) combined with the values of ``tensors``, a 56-bit
    digest."""
    text = f"{value}:{[t.tolist() for t in tensors]!r}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def value_lines(small: list[Small], tensors: list[torch.Tensor]) -> list[Line]:
    """The values of a call's small replicated tensors, as labelled lines."""
    return [(leaf.label, repr(t.tolist())) for leaf, t in zip(small, tensors)]


class Pending:
    """A launched check; :meth:`settle` waits for it once and raises if the ranks differ."""

    def __init__(
        self,
        check: CallCheck,
        lines: list[Line],
        value: int | None,
        on_argument_mismatch: Callable[[], None],
        values: tuple[list[Small], list[torch.Tensor]] = ([], []),
    ) -> None:
        """Launch the all-reduce of ``value``, the digest of ``lines`` and of ``values`` (the
        small replicated tensors and their values, lines only when the ranks differ); None:
        nothing to check (a world of one)."""
        self._check, self._lines, self._values = check, lines, values
        self._on_argument_mismatch = on_argument_mismatch
        self._call = check.calls
        self._start = time.monotonic()
        self._group = check.group()
        self._in_flight = None
        if value is not None:
            with self._peer_failures():
                self._in_flight = DigestCheck(value, self._group)

    def _peer_failures(self) -> contextlib.AbstractContextManager[None]:
        """A peer that died or hangs is a :class:`RankFailureError` naming the step and call."""
        return _runtime.peer_failures(f"{self._check.name}, call {self._call}", self._start)

    def settle(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        with self._peer_failures():
            same = in_flight.same()
        if same:
            self._check.agreed()
            return
        lines = [*self._lines, *value_lines(*self._values), ("the call", str(self._call))]
        everyone = gather_lines(lines, self._group)
        difference = first_difference(everyone)
        # integers that differ (a step count) are a skipped or repeated call; other values,
        # replicas drifting apart, which the replicated arguments' own check names better
        counted = difference.label.startswith(_COUNT)
        built = self._check.described_lines
        built_alike = all(theirs[:built] == everyone[0][:built] for theirs in everyone)
        if not counted and built_alike:
            self._on_argument_mismatch()  # every rank calls it: it may compare more
        if difference.label.startswith((_COUNT, _VALUE)):
            raise _skipped(self._check.name, self._call, difference)
        raise _mismatch(self._check.name, difference, built_alike)


def _skipped(name: str, call: int, difference: Difference) -> ScheduleMismatchError:
    what = _relabelled(difference, difference.label.removeprefix(_COUNT).removeprefix(_VALUE))
    return ScheduleMismatchError(
        f"{name}, call {call} on this rank: a replicated argument differs between ranks: "
        f"{what}: a rank skipped or repeated a call (calls pair off in order: every rank must "
        "call the step as often as the others, passing back the state its last call returned), "
        "or changed its replicated state on its own. Nothing of this call has run; resume all "
        "ranks from the same checkpoint."
    )


def _relabelled(difference: Difference, label: str) -> Difference:
    return Difference(difference.rank, label, difference.theirs, difference.ours)


def _mismatch(name: str, difference: Difference, built_alike: bool) -> ScheduleMismatchError:
    if difference.label == "the request":
        return ScheduleMismatchError(
            f"{name}: rank {difference.rank} {difference.theirs} while rank 0 "
            f"{difference.ours}. Compiling the step for new arguments is a collective: call "
            "schedule() and graph() on every rank at the same point, or after a first call "
            "with these arguments (then they need no other rank)."
        )
    if not built_alike:  # the difference is in how the step was built
        return ScheduleMismatchError(
            f"{name}: ranks built the step differently: {difference}. Every rank must wrap "
            "the same step function with the same options."
        )
    return ScheduleMismatchError(
        f"{name}: ranks were called with different arguments: {difference}. Every rank must "
        "pass arguments of the same structure, shapes, dtypes and non-tensor values in every "
        "step, the last batch of an epoch included: drop it, or pad it to the full size and "
        "mask the padding in the loss."
    )


class CallCheck:
    """The agreement of one step object's calls.

    ``options`` describe how the step was built, as labelled lines. With ``own_group`` (a step
    whose last buckets may still be on the wire when it returns), calls after the first check
    on a side group of their own: queued behind those buckets on the step's group, the check
    would wait for them before the call could start.
    """

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        options: list[Line],
        *,
        own_group: bool,
        replicated: tuple[int, ...],
    ) -> None:
        """``replicated``: the argument positions that hold the same values on every rank
        (the step's ``check_replicas``)."""
        self.name, self._group, self._options = name, group, options
        self.described_lines = 1 + len(options)  # the request, then how the step was built
        self._own_group = own_group
        self._replicated = replicated
        self._side: dist.ProcessGroup | None = None
        self._agreed_once = False
        self._lines: dict[tuple[Signature, str], Known] = {}
        self.calls = 0  # calls of the step launched on this rank, this one included

    def launch(
        self,
        signature: Signature,
        args: tuple,
        request: str,
        on_argument_mismatch: Callable[[], None] = lambda: None,
    ) -> Pending:
        """Start the check of a call (``request`` says what was called, e.g. ``schedule()``).

        ``on_argument_mismatch`` runs on every rank when the ranks built the step alike and
        differ only in their arguments, before the error is raised: a check of its own that
        can name the difference better (the replicated arguments' digests) may raise first.
        """
        self.calls += request == "called the step"
        if _runtime.world_size(self._group) == 1:
            return Pending(self, [], None, on_argument_mismatch)
        key = (signature, request)
        known = self._lines.get(key)
        if known is None:
            if len(self._lines) >= _LINES_KEPT:
                self._lines.clear()
            arguments = signature.lines(leaf_paths(args))
            lines = [("the request", request), *self._options, *arguments]
            # with own_group (overlap_steps), replicated outputs come back as pending tensors,
            # which reading would finish early, undoing the overlap across steps
            small = [] if self._own_group else small_replicated(args, self._replicated)
            known = self._lines[key] = Known(lines, digest(lines), small)
        if not known.small:
            return Pending(self, known.lines, known.value, on_argument_mismatch)
        tensors = [leaf.reach(args[leaf.argument]) for leaf in known.small]
        value = with_values(known.value, tensors)
        return Pending(self, known.lines, value, on_argument_mismatch, (known.small, tensors))

    def agreed(self) -> None:
        self._agreed_once = True

    def group(self) -> dist.ProcessGroup | None:
        """The step's group until a first check has passed; then, with ``own_group``, the side
        group (made at that point, once every rank knows that this is such a step)."""
        if self._own_group and self._agreed_once and self._side is None:
            self._side = _runtime.side_group(self._group)
        return self._side or self._group
