"""The compiled programs of one step, by input signature and what their traces read, least
recently used dropped first."""

from __future__ import annotations

import collections
import warnings
from typing import Generic, Protocol, TypeVar

from fddp._base._errors import RetraceWarning
from fddp._ranks import _runtime
from fddp._ranks._signature import Signature, leaf_paths

RETRACE_WARNING_AFTER = 3  # retraces caused by one leaf or value before it is named in a warning


class _Checked(Protocol):
    def changed(self) -> str | None:
        """What the trace read that reads differently now, None when nothing does."""


Program = TypeVar("Program", bound=_Checked)


class ProgramCache(Generic[Program]):
    """Programs by signature, at most ``size`` of them; a signature may hold several, each
    reused only while what its trace read is unchanged (``Program.changed``)."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._programs: collections.OrderedDict[Signature, list[Program]] = (
            collections.OrderedDict()
        )
        self._last: Signature | None = None
        self.changed: str | None = None  # why the last lookup found no program, if a value
        self._by_leaf: collections.Counter[str] = collections.Counter()
        self._warned: set[str] = set()
        self.retraces = 0  # compiles after the first

    def get(self, signature: Signature) -> Program | None:
        programs = self._programs.get(signature)
        if programs is None:
            self.changed = None
            return None
        if len(self._programs) > 1:
            self._programs.move_to_end(signature)  # another key lookup: only where it orders
        self.changed = None
        for i, program in enumerate(programs):
            changed = program.changed()
            if changed is None:
                self.changed = None  # what another program read changed, not this one's
                if i:
                    programs.insert(0, programs.pop(i))
                return program
            if i == 0:
                self.changed = changed
        return None

    def programs(self) -> list[Program]:
        """Every program kept, the most recently used signature's last."""
        return [p for programs in self._programs.values() for p in programs]

    def put(self, signature: Signature, program: Program) -> None:
        self._programs.setdefault(signature, []).insert(0, program)
        while sum(map(len, self._programs.values())) > self._size:
            oldest = next(iter(self._programs))
            self._programs[oldest].pop()
            if not self._programs[oldest]:
                del self._programs[oldest]

    def note_compile(self, signature: Signature, args: tuple) -> None:
        """Count a compile for ``signature``; the first is not a retrace."""
        last, self._last = self._last, signature
        if last is None:
            return
        self.retraces += 1
        changed, self.changed = self.changed, None
        what: str | None
        if changed is not None and signature in self._programs:
            what, reason = changed.partition(" changed")[0], changed
        else:
            path, reason = last.difference(signature, leaf_paths(args))
            what = None if path is None else f"argument leaf {path}"
        _runtime.log_rank0("data_parallel: retracing %s: %s", self._name, reason)
        if what is None:
            return
        self._by_leaf[what] += 1
        if self._by_leaf[what] >= RETRACE_WARNING_AFTER and what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"{self._name} was traced again {self._by_leaf[what]} times because {what} "
                f"keeps changing (last: {reason}). Every new value of a non-tensor argument, "
                "of a value the step's trace read (a module's attribute, a field of an "
                "argument), and every new shape, compiles the step again: pass a changing "
                "number as a tensor (torch.tensor(value)), and pad batches to a few fixed "
                f"shapes. At most {self._size} programs are kept "
                "(data_parallel(..., cache_size=...)).",
                RetraceWarning,
                stacklevel=6,
            )
