"""The per-call agreement: the same step, options, signature, call count and replicated inputs."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import NamedTuple

import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError, ScheduleMismatchError
from fddp._ranks import _runtime
from fddp._ranks._agree import (
    Difference,
    DigestCheck,
    Line,
    difference_if_any,
    digest,
    gather_lines,
)
from fddp._ranks._signature import Signature, leaf_paths
from fddp._step._call_inputs import GENERATOR, NEW, VALUE, Inputs
from fddp._step._held_tensors import HELD

_LINES_KEPT = 64  # signatures whose lines are kept for the next calls
_CALL = "the call"  # the line that counts this step's calls on this rank
OPT_OUT = (
    "check_replicas=False turns the check of replicated arguments off (or check_replicas=(...) "
    "names the arguments that must be the same on every rank)"
)
READ_AS_TRACED = "reads as traced"


class Known(NamedTuple):
    """What a signature's calls check: its lines and their digest."""

    lines: list[Line]
    value: int


def with_inputs(value: int, call: int, terms: str) -> int:
    """``value`` (a signature's digest) combined with the call count and a call's inputs
    (:meth:`Inputs.terms`), a 56-bit digest."""
    text = f"{value}:{call}:{terms}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class Pending:
    """A launched check; :meth:`settle` waits for it once and raises if the ranks differ."""

    def __init__(
        self,
        check: CallCheck,
        lines: list[Line],
        value: int | None,
        on_argument_mismatch: Callable[[], None],
        inputs: Inputs | None = None,
    ) -> None:
        """Launch the all-reduce of ``value``, the digest of ``lines``, the call count and
        ``inputs`` (lines only when the ranks differ); None: nothing to check (a world of
        one)."""
        self._check, self._lines, self._inputs = check, lines, inputs
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
        if not same:
            with self._peer_failures():
                self._name_the_difference()
        self._check.agreed()

    def _name_the_difference(self) -> None:
        """The digests differ: every rank compares its lines (the replicated inputs by value,
        also those known only by origin) and raises the first difference; none when the ranks
        only knew the same values differently (one hashed a tensor the other had returned)."""
        values, origins = self._inputs.lines() if self._inputs is not None else ([], [])
        mine = [*self._lines, (_CALL, str(self._call)), *values]
        everyone = gather_lines(mine, self._group)
        everyone_origins = gather_lines(origins, self._group)
        difference = difference_if_any(everyone)
        name, built = self._check.name, self._check.described_lines
        if difference is None:
            skipped = difference_if_any(_all_known(everyone_origins))
            if skipped is not None:
                raise _skipped(name, self._call, None, skipped)
            return
        if difference.label == _CALL:
            raise _skipped(name, self._call, difference, None)
        if difference.label == GENERATOR:
            raise ReplicaMismatchError(
                f"{name}, call {self._call}: {difference}: the step's results depend on its "
                "draws and must be the same on every rank. Seed every rank alike "
                "(torch.manual_seed(seed)) and save its state with the checkpoint."
            )
        if difference.label.startswith(HELD):
            raise _held_changed(name, self._call, difference)
        if difference.label.startswith(VALUE):
            assert self._inputs is not None  # only inputs have such lines
            origin = _origin(everyone_origins, difference)
            if origin is not None or difference.label in self._inputs.integer_labels():
                raise _skipped(name, self._call, difference, origin)
            raise _drifted(name, self._call, difference)
        built_alike = all(theirs[:built] == everyone[0][:built] for theirs in everyone)
        if built_alike:
            self._on_argument_mismatch()  # every rank calls it: it may compare more
        raise _mismatch(name, difference, built_alike)


def _all_known(everyone: list[list[Line]]) -> list[list[Line]]:
    """The origins that every rank knows (a tensor returned by one of the step's calls)."""
    keep = [all(lines[k][1] != NEW for lines in everyone) for k in range(len(everyone[0]))]
    return [[line for line, kept in zip(lines, keep) if kept] for lines in everyone]


def _origin(everyone: list[list[Line]], difference: Difference) -> Difference | None:
    """Where the differing leaf comes from, where every rank knows and they differ (a rank
    passed the output of another call)."""
    label = difference.label
    found = [dict(lines).get(label) for lines in everyone]
    if None in found or NEW in found or len(set(found)) == 1:
        return None
    rank = next(r for r, origin in enumerate(found) if origin != found[0])
    return Difference(rank, label, str(found[rank]), str(found[0]))


def _skipped(
    name: str, call: int, value: Difference | None, origin: Difference | None
) -> ScheduleMismatchError:
    """A rank at another call: named by a value (a step count) and where it comes from (the
    output of which call), as far as they are known."""
    said = [f"{value}" if value is not None else None]
    if origin is not None:
        said.append(
            f"it is {origin.theirs} on rank {origin.rank} but {origin.ours} on rank 0"
            if value is not None
            else str(origin)
        )
    what = ": ".join(s for s in said if s).replace(VALUE, "")
    return ScheduleMismatchError(
        f"{name}, call {call} on this rank: the ranks are not at the same call: {what}: a rank "
        "skipped or repeated a call (calls pair off in order: every rank must call the step as "
        "often as the others, passing back the state its last call returned), or changed its "
        "replicated state on its own. Nothing of this call has run; resume all ranks from the "
        f"same checkpoint. ({OPT_OUT}.)"
    )


def _drifted(name: str, call: int, difference: Difference) -> ReplicaMismatchError:
    hint = (
        "Replicas must start from the same values: create them from the same seed and model "
        "code, or call fddp.replicate(tree) before training"
        if call <= 1
        else "A replica that drifted apart was updated from values of its own: does the step "
        "average its gradients with fddp.pmean, and does every rank use the same "
        "hyperparameters?"
    )
    return ReplicaMismatchError(
        f"{name}, call {call}: a replicated argument differs between ranks: {difference}. "
        f"{hint} Nothing of this call has run. ({OPT_OUT}.)"
    )


def _held_changed(name: str, call: int, difference: Difference) -> ReplicaMismatchError:
    return ReplicaMismatchError(
        f"{name}, call {call}: a tensor the step closes over differs between ranks: "
        f"{difference}. It was written in place after the step was compiled (a learning "
        "rate's fill_, a hyperparameter tensor's copy_) on some ranks only: the compiled step "
        "reads it as it is now, so the ranks would train differently. Change it alike on "
        "every rank, or pass it to the step as an argument. Nothing of this call has run. "
        "(check_replicas=False turns this check off, with that of the replicated arguments.)"
    )


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
    ) -> None:
        self.name, self._group, self._options = name, group, options
        self.described_lines = 1 + len(options)  # the request, then how the step was built
        self._own_group = own_group
        self._side: dist.ProcessGroup | None = None
        self._agreed_once = False
        self._lines: dict[tuple[Signature, str, str], Known] = {}
        self.calls = 0  # calls of the step launched on this rank, this one included

    def launch(
        self,
        signature: Signature,
        args: tuple,
        request: str,
        on_argument_mismatch: Callable[[], None] = lambda: None,
        inputs: Inputs | None = None,
        reads: str = READ_AS_TRACED,
    ) -> Pending:
        """Start the check of a call (``request`` says what was called, e.g. ``schedule()``),
        with what the call brings (``inputs``: the replicated arguments, the generator) and
        whether what the step's trace read reads the same (``reads``: a rank that would compile
        again for a changed value while the others run the program would run other
        collectives).

        ``on_argument_mismatch`` runs on every rank when the ranks built the step alike and
        differ in their arguments' signatures, before the error is raised: a check of its own
        that can name the difference better (the replicated arguments' trees) may raise first.
        """
        self.calls += request == "called the step"
        if _runtime.world_size(self._group) == 1:
            return Pending(self, [], None, on_argument_mismatch)
        key = (signature, request, reads)
        known = self._lines.get(key)
        if known is None:
            if len(self._lines) >= _LINES_KEPT:
                self._lines.clear()
            arguments = [*signature.lines(leaf_paths(args)), ("what the trace read", reads)]
            lines = [("the request", request), *self._options, *arguments]
            known = self._lines[key] = Known(lines, digest(lines))
        terms = "" if inputs is None else inputs.terms()
        value = with_inputs(known.value, self.calls, terms)
        return Pending(self, known.lines, value, on_argument_mismatch, inputs)

    def agreed(self) -> None:
        self._agreed_once = True

    def group(self) -> dist.ProcessGroup | None:
        """The step's group until a first check has passed; then, with ``own_group``, the side
        group (made at that point, once every rank knows that this is such a step)."""
        if self._own_group and self._agreed_once and self._side is None:
            self._side = _runtime.side_group(self._group)
        return self._side or self._group
