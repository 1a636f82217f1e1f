"""The errors fddp raises for mistakes it can name; each message says what to do."""

from __future__ import annotations


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different values for something that must be the same everywhere."""


class ScheduleMismatchError(RuntimeError):
    """Ranks would run different collectives (other shapes, other programs); running them
    would hang or mix unrelated values."""


class RankFailureError(RuntimeError):
    """A collective failed because another rank died, is stuck, or was slower than the timeout."""


class SaveArrivalError(RankFailureError, ValueError):
    """Not every rank entered a ``rank0_only`` :func:`fddp.save`: usually a save under
    ``if rank == 0:`` (a ValueError, the caller's mistake), else a rank that died or hangs (a
    :class:`RankFailureError`)."""


class CaptureError(RuntimeError):
    """The step could not be captured as one graph."""

    make_fx_error: BaseException | None  # what make_fx raised, if it was tried
    dynamo_error: BaseException  # what Dynamo raised


class RetraceWarning(UserWarning):
    """A step is traced again and again because one argument leaf keeps changing."""


class PrintWhileTracingWarning(UserWarning):
    """print() in a traced step ran once, on fake tensors, while the step was captured."""


class UsageError(Exception):
    """A mistake fddp names itself while the step runs: raised as it is, never retried through
    another capture path or reported as a capture failure."""


class UsageTypeError(UsageError, TypeError):
    pass


class UsageValueError(UsageError, ValueError):
    pass
