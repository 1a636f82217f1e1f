"""The group across generations: regrouped after a failure (again if one strikes meanwhile) and
when replacements are admitted, with the state handed to whoever lacks it."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fddp._base._errors import RankFailureError
from fddp._ranks import _runtime
from fddp._recovery import _group
from fddp._recovery._admission import Admissions, wait_for_admission
from fddp._recovery._membership import WAITING, Membership, timed_out
from fddp._recovery._undo import generator_states, set_generator_states

_LOSSLESS_REGROUPS = 2  # regroups in a row in which every member registered, before giving up


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery: the step that was redone, the members before and after, and its cost.

    Attributes:
        step: the step (0-based count of committed steps) whose first attempt failed.
        generation: the generation of the group formed by this recovery.
        members: the members (ids given as ``rank`` to :func:`recoverable`) after it.
        lost: the members left out (dead, stuck, expelled as stragglers, or too late to
            register), over every regroup of this recovery (a failure while regrouping
            regroups again).
        seconds: from catching the failure to the new group holding the agreed state.
        cause: the first line of the error that started it.
    """

    step: int
    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...]
    seconds: float
    cause: str


@dataclasses.dataclass
class Progress:
    """What this member has committed: the step count and its loss, and whether it still
    waits for the members' state (a replacement before its first call)."""

    step: int = 0
    loss: torch.Tensor | None = None
    receiving: bool = False
    result: tuple[Any, Any, Any] | None = None  # a call's result committed by the others

    def committed(self) -> int:
        return WAITING if self.receiving else self.step


def is_failure(error: BaseException) -> bool:
    """Whether ``error`` is a peer's failure (or a lost store) that a regroup may get past."""
    return isinstance(error, RankFailureError) or _runtime.is_peer_failure(error)


class Generations:
    """This member's group: who is in it (:class:`Membership`), who joins (:class:`Admissions`)
    and the default process group of the current generation. ``on_leave`` drops what holds the
    old group (its data-parallel steps) before its links are closed."""

    def __init__(
        self,
        membership: Membership,
        admissions: Admissions,
        *,
        backend: str,
        timeout: float,
        compile_timeout: float,
        min_world_size: int,
        on_leave: Callable[[], None],
    ) -> None:
        self.membership, self.admissions = membership, admissions
        self._backend, self._timeout, self._compile_timeout = backend, timeout, compile_timeout
        self._compiling = False  # the first step of this generation has not committed yet
        self._min_world_size, self._on_leave = min_world_size, on_leave
        self._lossless = 0  # regroups in a row in which nobody was lost
        self.recoveries: list[Recovery] = []

    def take_admission(self, progress: Progress) -> None:
        """A replacement: wait until the members admit it, and take its place among them."""
        m = self.membership
        admission = wait_for_admission(m.store, m.prefix, m.uid)
        m.generation, m.members = admission.generation, admission.members
        self.admissions.taken, self.admissions.capacity = admission.taken, admission.capacity
        progress.step, progress.receiving = admission.step, True

    def form(self, *, starting: bool = False) -> None:
        """Form this generation's group: within ``timeout`` (``compile_timeout`` when the job
        is ``starting``: its processes start at their own pace). Its first step traces and
        compiles the step for the new group (a replacement from cold, while the members
        compile warm): until it commits, a collective waits ``compile_timeout`` for a peer."""
        m, slow = self.membership, self._compile_timeout
        forming = slow if starting else self._timeout
        _group.form(m.store, m.prefix, m.generation, m.members, m.uid, self._backend, forming, slow)
        self._compiling = True

    def leave(self) -> None:
        self._on_leave()
        _group.abandon()

    def committed(self) -> None:
        """A step committed: the next lossless regroup is the first in a row, and after this
        generation's first step a peer is waited for ``timeout`` only."""
        self._lossless = 0
        if self._compiling:
            _group.set_timeout(self._timeout)
            self._compiling = False

    def admit(self, progress: Progress, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Before a step: form the next generation with the replacements due now, and hand the
        state to a new member."""
        joining = self.admissions.due(self.membership, progress.step)
        if not (joining or progress.receiving):
            return params, opt_state
        try:
            if joining:
                self.leave()
                self.membership.advance((*self.membership.members, *joining))
                self.admissions.announce(self.membership, progress.step, joining)
                self.form()
            return self._hand_over(progress, params, opt_state, src=0)
        except RuntimeError as error:
            if not is_failure(error):
                raise
            return self.recover(error, progress, params, opt_state)[1:]

    def recover(
        self, error: BaseException, progress: Progress, params: Any, opt_state: Any
    ) -> tuple[bool, Any, Any]:
        """Agree on the survivors, form the next generation's group and bring every member to
        the newest committed state; a failure meanwhile regroups again (one record in
        ``recoveries``). Returns whether this call's step is still to run (False: the others
        had committed it; its result is in ``progress.result``) and the state to run it from."""
        start, cause, lost = time.monotonic(), _first_line(error), []
        m = self.membership
        while True:
            _clear_frames(error)
            self.leave()
            roster = m.agree(progress.committed(), timed_out(error))
            lost += [u for u in m.members if u not in roster]
            self._check(roster, lost, error)
            m.advance(tuple(u for u in m.members if u in roster))
            self.admissions.forget()  # a replacement scheduled before is scheduled again
            try:
                self.form()
                redo, params, opt_state = self._catch_up(roster, progress, params, opt_state)
            except RuntimeError as again:
                if not is_failure(again):
                    raise
                error = again
                continue
            break
        seconds = time.monotonic() - start
        record = Recovery(progress.step, m.generation, m.members, tuple(lost), seconds, cause)
        _runtime.log_rank0(
            "recoverable: generation %d without %s, step %d redone on %d members (%.2f s)",
            m.generation,
            record.lost,
            record.step,
            len(m.members),
            seconds,
        )
        self.recoveries.append(record)
        return redo, params, opt_state

    def _check(self, roster: dict[int, int], lost: list[int], error: BaseException) -> None:
        """Refuse to go on with a group that cannot hold the job (the same verdict everywhere)."""
        if set(roster) == set(self.membership.members):
            self._lossless += 1
            if self._lossless >= _LOSSLESS_REGROUPS:
                raise RankFailureError(
                    f"recoverable: collectives failed {self._lossless} times in a row although "
                    "every member registered as alive: no rank died, but one was slower than "
                    f"timeout= ({self._timeout:g} s) between two collectives each time, or the "
                    "links between members fail while the store is reachable. Raise timeout=."
                ) from error
        if len(roster) < self._min_world_size:
            raise RankFailureError(
                f"recoverable: only {len(roster)} members are left (lost {lost}), fewer than "
                f"min_world_size={self._min_world_size}: the job ends here. Restart it from "
                "its last checkpoint, or lower min_world_size=."
            ) from error
        if max(roster.values()) == WAITING:
            raise RankFailureError(
                f"recoverable: every member that held the training state was lost ({lost}); "
                "the replacements left have nothing to take over. Restart the job from its "
                "last checkpoint."
            ) from error

    def _catch_up(
        self, roster: dict[int, int], progress: Progress, params: Any, opt_state: Any
    ) -> tuple[bool, Any, Any]:
        """When the failure came between one member's commit and another's, or a replacement
        waits for the state, broadcast the newest state (and its loss) from a member that has
        it. Returns whether this member runs the step (again), and its state."""
        newest = max(roster.values())
        if set(roster.values()) == {newest}:
            return True, params, opt_state
        members = self.membership.members
        src = members.index(next(u for u in members if roster[u] == newest))
        loss = [progress.loss]
        dist.broadcast_object_list(loss, group_src=src)
        behind = 0 <= progress.committed() < newest
        params, opt_state = self._hand_over(progress, params, opt_state, src)
        progress.step, progress.loss = newest, loss[0]
        if behind:  # its call's step was committed by others: their result is the call's
            progress.result = (params, opt_state, loss[0])
        return not behind, params, opt_state

    def _hand_over(
        self, progress: Progress, params: Any, opt_state: Any, src: int
    ) -> tuple[Any, Any]:
        """The state and the random generators of member ``src``, on every member."""
        state = (params, opt_state, generator_states())
        params, opt_state, generators = _runtime.replicate(state, src=src)
        set_generator_states(generators)
        progress.receiving = False
        return params, opt_state


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _clear_frames(error: BaseException) -> None:
    """Drop the failed call's frames (they hold the old group's tensors and steps)."""
    for e in (error, error.__cause__, error.__context__):
        if e is not None and e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
