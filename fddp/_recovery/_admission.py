"""Replacements: a new process registers in the store, the members admit it at a step boundary."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch.distributed as dist

from fddp._recovery._membership import Membership, store_lost

logger = logging.getLogger("fddp")
_WAIT_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Admission:
    """What a replacement learns when it is admitted: the generation it joins, at which
    committed step, the members (itself last), how many registrations the members have taken
    and the largest group they keep (``capacity``)."""

    generation: int
    step: int
    members: tuple[int, ...]
    taken: int
    capacity: int

    def encode(self) -> str:
        members = ",".join(map(str, self.members))
        return f"{self.generation}:{self.step}:{members}:{self.taken}:{self.capacity}"

    @staticmethod
    def decode(text: str) -> Admission:
        generation, step, members, taken, capacity = text.split(":")
        ids = tuple(int(u) for u in members.split(","))
        return Admission(int(generation), int(step), ids, int(taken), int(capacity))


def admitted_key(prefix: str, uid: int) -> str:
    """The store key a replacement's admission is written to (read by ``fddp.run`` too)."""
    return f"{prefix}/admitted/{uid}"


def wait_for_admission(store: dist.Store, prefix: str, uid: int) -> Admission:
    """A replacement: register under the id ``uid`` and wait until the members admit it."""
    try:
        index = store.add(f"{prefix}/joins", 1)
        store.set(f"{prefix}/join/{index}", str(uid))
        key = admitted_key(prefix, uid)
        while not store.check([key]):
            time.sleep(_WAIT_POLL_S)
        return Admission.decode(store.get(key).decode())
    except dist.DistError as error:
        raise store_lost(error, f"replacement {uid} waited to be admitted") from error


class Admissions:
    """The members' side: every ``admit_every`` steps the first member looks for registered
    replacements and schedules those that fit (the group never grows past ``capacity``, the
    first generation's size) ``2 * admit_every`` steps later: by then every member has read the
    schedule at a boundary before it. At that step every member forms the next generation with
    them. A lost store stops admissions; training goes on."""

    def __init__(self, store: dist.Store, prefix: str, admit_every: int, capacity: int) -> None:
        self._store, self._prefix = store, prefix
        self._every, self.capacity = admit_every, capacity
        self.taken = 0  # registrations taken so far (the same count on every member)
        self._at: tuple[int, tuple[int, ...]] | None = None  # (step, ids) once scheduled
        self._lost = False

    def forget(self) -> None:
        """Drop a schedule made in a failed generation (the next one schedules it again)."""
        self._at = None

    def due(self, membership: Membership, step: int) -> tuple[int, ...]:
        """The replacements to admit before committed step ``step`` (none: empty)."""
        if self._lost or (self._at is None and step % self._every):
            return ()
        try:
            return self._due(membership, step)
        except dist.DistError as error:
            self._lost = True
            logger.warning(
                "fddp.recoverable: the store cannot be reached (%s): training goes on, but no "
                "replacement can be admitted, and a failure will end the job",
                error,
            )
            return ()

    def _due(self, membership: Membership, step: int) -> tuple[int, ...]:
        store, base = self._store, f"{self._prefix}/g{membership.generation}"
        room = self.capacity - len(membership.members)
        if self._at is None and membership.uid == membership.members[0] and room > 0:
            registered = store.add(f"{self._prefix}/joins", 0)
            if registered > self.taken:
                last = min(registered, self.taken + room)
                ids = [
                    store.get(f"{self._prefix}/join/{i}").decode()
                    for i in range(self.taken + 1, last + 1)
                ]
                store.compare_set(f"{base}/admit", "", f"{step + 2 * self._every}:{','.join(ids)}")
        if self._at is None and store.check([f"{base}/admit"]):
            at, listed = store.get(f"{base}/admit").decode().split(":")
            self._at = (int(at), tuple(int(u) for u in listed.split(",")))
        if self._at is None or self._at[0] != step:
            return ()
        joining, self._at = self._at[1], None
        self.taken += len(joining)
        return joining

    def announce(self, membership: Membership, step: int, joining: tuple[int, ...]) -> None:
        """Tell each of ``joining`` that it is admitted (the first member writes it)."""
        if membership.uid != membership.members[0]:
            return
        admission = Admission(
            membership.generation, step, membership.members, self.taken, self.capacity
        )
        for u in joining:
            self._store.set(admitted_key(self._prefix, u), admission.encode())
