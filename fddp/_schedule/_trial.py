"""Whether overlapping across steps pays for a step: measured on its first calls, then fixed.

Deferring the last buckets into the next call helps when the wire is the bottleneck (the next
forward runs while they are still being reduced) and costs when it is not (their launches wait
for the end of the backward pass instead of going out as each gradient is ready). Which one a
step is depends on the model, the batch and the link, so it is measured: the first calls run the
plain step, the next ones the deferred step, and the durations of the plain calls are compared
with those of the deferred calls that consume the previous call's tail (each waits for what the
last one left on the wire). Rank 0's measurement decides for every rank, since all must run the
same collectives in the same order.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

PLAIN_CALLS = 4  # calls 0-3 run the plain step; 1-3 are timed
DEFERRED_CALLS = 8  # calls 4-11 defer; those that consume the last call's tail are timed
MARGIN = 0.98  # deferring must save at least 2 % per call to be kept


class Trial:
    """Decides, once, whether a step defers; ``decide`` makes rank 0's choice everyone's.

    The decision falls on the same call on every rank (call ``PLAIN_CALLS + DEFERRED_CALLS``),
    whatever each measured: it runs a collective.
    """

    def __init__(self, decide: Callable[[bool], bool], always: bool) -> None:
        self._decide = decide
        self.choice: bool | None = True if always else None
        self.measured: tuple[float, float | None] | None = None  # plain, merged: s per call
        self._calls = 0
        self._plain: list[float] = []
        self._merged: list[float] = []

    def defer(self) -> bool:
        """Called as each call starts: whether this call defers its last buckets."""
        if self.choice is not None:
            return self.choice
        self._calls += 1
        if self._calls <= PLAIN_CALLS:
            return False
        if self._calls <= PLAIN_CALLS + DEFERRED_CALLS:
            return True
        plain = statistics.median(self._plain[1:])
        # the first merged call builds the merged program; without three more, the outputs
        # were touched between calls, which completes the tail outside the step
        merged = statistics.median(self._merged[1:]) if len(self._merged) > 3 else None
        self.measured = (plain, merged)
        self.choice = self._decide(merged is not None and merged < MARGIN * plain)
        return self.choice

    def record(self, merged: bool | None, seconds: float) -> None:
        """A call's duration: plain (False), consuming the last call's tail (True), or
        neither (None: a deferred call that started from finished inputs)."""
        if self.choice is None and merged is not None:
            (self._merged if merged else self._plain).append(seconds)

    def describe(self) -> str:
        if self.measured is None:
            if self.choice:
                return "deferred on every call (overlap_steps='always')"
            calls = PLAIN_CALLS + DEFERRED_CALLS
            return f"measuring: call {self._calls} of {calls} (plain, then deferred)"
        plain, merged = self.measured
        kept = "deferred" if self.choice else "plain"
        if merged is None:
            return f"{kept}: the outputs were touched between calls while deferring"
        return (
            f"{kept}, chosen on rank 0: {merged * 1e3:.1f} ms per call deferred, "
            f"{plain * 1e3:.1f} plain"
        )
