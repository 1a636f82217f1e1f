"""One data_parallel step at a time per process, so collectives run in one order on every rank."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from fddp._base._errors import UsageValueError

_inside = threading.local()
_one_step_at_a_time = threading.Lock()


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Run the block as step ``name``; a nested or concurrent step is an error, not a hang."""
    outer = getattr(_inside, "name", None)
    if outer is not None:
        raise UsageValueError(
            f"{name} was called inside the data_parallel step {outer}: nesting data_parallel "
            "is not supported. Call the undecorated inner function inside the outer step (its "
            "collectives are scheduled with the outer step's), or call the steps one after "
            "the other."
        )
    if not _one_step_at_a_time.acquire(blocking=False):
        raise RuntimeError(
            f"{name} was called while another data_parallel step runs in another thread. "
            "Steps issue collectives that must run in the same order on every rank, which "
            "concurrent calls cannot promise: call the steps from one thread (e.g. run "
            "evaluation after the training step returns, not beside it)."
        )
    _inside.name = name
    try:
        yield
    finally:
        _inside.name = None
        _one_step_at_a_time.release()
