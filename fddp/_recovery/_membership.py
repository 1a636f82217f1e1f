"""Who is in the group: each member's heartbeat, and the survivors' agreement after a failure."""

from __future__ import annotations

import atexit
import threading
import time

import torch.distributed as dist

from fddp._base._errors import RankFailureError

_POLL_S = 0.005
WAITING = -1  # the committed step a replacement registers until it holds the members' state


class Membership:
    """This member's id, the group's members and generation, and the store they agree through.

    Each member counts up ``{prefix}/alive/{id}`` every ``settle / 8`` seconds from a thread: a
    member whose count stops (killed, stopped) is taken for gone by the others.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        uid: int,
        members: tuple[int, ...],
        *,
        settle: float,
        timeout: float,
    ) -> None:
        self.store, self.prefix, self.uid = store, prefix, uid
        self.members = members
        self.generation = 0
        self._settle, self._timeout = settle, timeout
        self._stopped = threading.Event()
        self._beat = threading.Thread(
            target=_heartbeat,
            args=(store.clone(), f"{prefix}/alive/{uid}", settle / 8, self._stopped),  # type: ignore[attr-defined]
            name="fddp-recoverable-heartbeat",
            daemon=True,
        )
        self._beat.start()
        # stopped before the interpreter is torn down: a daemon thread still inside a store
        # call then would find its C++ store destroyed under it (the process aborts)
        atexit.register(self.stop)

    def advance(self, members: tuple[int, ...]) -> None:
        """Go on to the next generation, with ``members``."""
        self.members, self.generation = members, self.generation + 1

    def stop(self) -> None:
        """Stop beating (the others then take this member for gone)."""
        self._stopped.set()
        self._beat.join(timeout=self._settle)

    def agree(self, committed: int, timed_out: bool) -> dict[int, int]:
        """The members of the next generation and their committed step counts, the same on
        every survivor of this one (see :meth:`_roster`).

        Raises:
            RankFailureError: this member was left out (expelled), or the store was lost.
        """
        try:
            roster = self._roster(committed, timed_out)
        except dist.DistError as error:
            doing = f"agreeing on the members after generation {self.generation}"
            raise store_lost(error, doing) from error
        if self.uid not in roster:
            raise RankFailureError(
                f"recoverable: this member ({self.uid}) was expelled from the group after a "
                f"failure in generation {self.generation}: it reached the failed step more than "
                f"settle= ({self._settle:g} s) after the others had given up on it, or it was "
                "stopped meanwhile; the others went on without it. A straggler is expelled so "
                "that one slow process does not stop the job: start it again as a replacement "
                "(fddp.recoverable(..., join=True) with a new id; python -m fddp.run does that "
                "with --max-replacements), or raise timeout= if the member is slow by design."
            )
        return roster

    def _roster(self, committed: int, timed_out: bool) -> dict[int, int]:
        """Register ``{prefix}/g{gen}/in/{id}`` = the committed step count (and whether a
        collective timed out here), then wait while a member that has not registered still
        beats: up to ``timeout``, and only ``settle`` after a member that timed out registered
        (the others are then stragglers: they were already ``timeout`` late). Propose the
        registered members; the first proposal stored is everyone's."""
        base = f"{self.prefix}/g{self.generation}"
        self.store.set(f"{base}/in/{self.uid}", f"{committed}:{int(timed_out)}")
        roster_key = f"{base}/roster"
        start = time.monotonic()
        beats = {u: (-1, start) for u in self.members}
        registered: dict[int, str] = {}
        stragglers_since = None
        while not self.store.check([roster_key]) and time.monotonic() < start + self._timeout:
            for u in self.members:
                if u not in registered and self.store.check([f"{base}/in/{u}"]):
                    registered[u] = self.store.get(f"{base}/in/{u}").decode()
            now = time.monotonic()
            if stragglers_since is None and any(v.endswith(":1") for v in registered.values()):
                stragglers_since = now
            if stragglers_since is not None and now - stragglers_since >= self._settle:
                break
            waiting = [u for u in self.members if u not in registered and self._beats(u, beats)]
            if not waiting:
                break
            time.sleep(_POLL_S)
        proposal = ",".join(f"{u}:{v.split(':')[0]}" for u, v in registered.items())
        agreed = self.store.compare_set(roster_key, "", proposal).decode()
        return {int(u): int(c) for u, c in (item.split(":") for item in agreed.split(","))}

    def _beats(self, u: int, beats: dict[int, tuple[int, float]]) -> bool:
        """Whether member ``u`` beat within the last ``settle`` seconds."""
        count, since = beats[u]
        now = self.store.add(f"{self.prefix}/alive/{u}", 0)
        if now != count:
            beats[u] = (now, time.monotonic())
            return True
        return time.monotonic() - since < self._settle


def store_lost(error: BaseException, doing: str) -> RankFailureError:
    """The error of a member that needs the store and cannot reach it."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return RankFailureError(
        f"recoverable: the store was lost while {doing} ({type(error).__name__}: {first}). "
        "The process that hosted it (python -m fddp.run, or your launcher) is gone: training "
        "went on without it while nothing had to be agreed, but the members cannot agree on "
        "who is left, or admit a replacement, without it. Restart the job from its last "
        "checkpoint."
    )


def timed_out(error: BaseException) -> bool:
    """Whether the collective failure at the root of ``error`` is a timeout (a peer that was
    slow or stuck) rather than a closed link (a peer that died or left)."""
    root: BaseException = error
    while isinstance(root, RankFailureError) and root.__cause__ is not None:
        root = root.__cause__
    first = (str(root).strip().splitlines() or [""])[0].lower()
    return "timed out" in first or "timeout" in first


def _heartbeat(store: dist.Store, key: str, interval: float, stop: threading.Event) -> None:
    """Count up ``key`` every ``interval`` seconds until ``stop`` is set."""
    while not stop.wait(interval):
        try:
            store.add(key, 1)
        except RuntimeError:  # the store is gone: nothing can be agreed without it anyway
            return
