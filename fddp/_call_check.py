"""The per-call agreement: on every call, all ranks run the same step, built with the same
options, on arguments of the same signature.

Without it a rank whose batch alone changed shape would trace the step again while the others
run the cached program, and all would wait for the timeout; on the eager path its collectives
would mix unrelated leaves; a rank built with other options (another bucket cap, another wire
dtype) would issue collectives of other sizes. One all-reduce of a digest of all that is
launched as the call starts and settled (waited for, an error on every rank if the ranks
differ) once, before anything else crosses ranks or is written into a donated argument: at the
scheduled graph's gate on a cached call, at once before a compile or a first call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from fddp import _runtime
from fddp._agree import Difference, DigestCheck, Line, digest, first_difference, gather_lines
from fddp._errors import ScheduleMismatchError
from fddp._signature import Signature, leaf_paths

_LINES_KEPT = 64  # signatures whose lines are kept for the next calls


class Pending:
    """A launched check; :meth:`settle` waits for it once and raises if the ranks differ."""

    def __init__(
        self,
        check: CallCheck,
        lines: list[Line],
        value: int | None,
        on_argument_mismatch: Callable[[], None],
    ) -> None:
        """Launch the all-reduce of ``value``, the digest of ``lines``; None: nothing to check
        (a world of one)."""
        self._check, self._lines = check, lines
        self._on_argument_mismatch = on_argument_mismatch
        self._group = check.group()
        self._in_flight = None if value is None else DigestCheck(value, self._group)

    def settle(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        if in_flight.same():
            self._check.agreed()
            return
        everyone = gather_lines(self._lines, self._group)
        built = self._check.described_lines
        if all(theirs[:built] == everyone[0][:built] for theirs in everyone):
            self._on_argument_mismatch()  # every rank calls it: it may compare more
        raise _mismatch(self._check.name, first_difference(everyone))


def _mismatch(name: str, difference: Difference) -> ScheduleMismatchError:
    if difference.label == "the request":
        return ScheduleMismatchError(
            f"{name}: rank {difference.rank} {difference.theirs} while rank 0 "
            f"{difference.ours}. Compiling the step for new arguments is a collective: call "
            "schedule() and graph() on every rank at the same point, or after a first call "
            "with these arguments (then they need no other rank)."
        )
    if difference.label.startswith(("option", "the step")):
        return ScheduleMismatchError(
            f"{name}: ranks built the step differently: {difference}. Every rank must wrap "
            "the same step function with the same data_parallel options."
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
        self._lines: dict[tuple[Signature, str], tuple[list[Line], int]] = {}

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
        if _runtime.world_size(self._group) == 1:
            return Pending(self, [], None, on_argument_mismatch)
        key = (signature, request)
        known = self._lines.get(key)
        if known is None:
            if len(self._lines) >= _LINES_KEPT:
                self._lines.clear()
            arguments = signature.lines(leaf_paths(args))
            lines = [("the request", request), *self._options, *arguments]
            known = self._lines[key] = (lines, digest(lines))
        lines, value = known
        return Pending(self, lines, value, on_argument_mismatch)

    def agreed(self) -> None:
        self._agreed_once = True

    def group(self) -> dist.ProcessGroup | None:
        """The step's group until a first check has passed; then, with ``own_group``, the side
        group (made at that point, once every rank knows that this is such a step)."""
        if self._own_group and self._agreed_once and self._side is None:
            self._side = _runtime.side_group(self._group)
        return self._side or self._group
