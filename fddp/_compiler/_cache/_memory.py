"""The compiled programs of one step, one per input signature, least recently used dropped first."""

from __future__ import annotations

import collections
import warnings
from typing import Generic, TypeVar

from fddp._base._errors import RetraceWarning
from fddp._ranks import _runtime
from fddp._ranks._signature import Signature, leaf_paths

RETRACE_WARNING_AFTER = 3  # retraces caused by one leaf before it is named in a warning

Program = TypeVar("Program")


class ProgramCache(Generic[Program]):
    """Programs by signature, at most ``size`` of them."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._programs: collections.OrderedDict[Signature, Program] = collections.OrderedDict()
        self._last: Signature | None = None
        self._by_leaf: collections.Counter[str] = collections.Counter()
        self._warned: set[str] = set()
        self.retraces = 0  # compiles after the first

    def get(self, signature: Signature) -> Program | None:
        program = self._programs.get(signature)
        if program is not None and len(self._programs) > 1:
            self._programs.move_to_end(signature)  # another key lookup: only where it orders
        return program

    def put(self, signature: Signature, program: Program) -> None:
        self._programs[signature] = program
        while len(self._programs) > self._size:
            self._programs.popitem(last=False)

    def note_compile(self, signature: Signature, args: tuple) -> None:
        """Count a compile for ``signature``; the first is not a retrace."""
        last, self._last = self._last, signature
        if last is None:
            return
        self.retraces += 1
        path, reason = last.difference(signature, leaf_paths(args))
        _runtime.log_rank0("data_parallel: retracing %s: %s", self._name, reason)
        if path is None:
            return
        self._by_leaf[path] += 1
        if self._by_leaf[path] >= RETRACE_WARNING_AFTER and path not in self._warned:
            self._warned.add(path)
            warnings.warn(
                f"{self._name} was traced again {self._by_leaf[path]} times because argument "
                f"leaf {path} keeps changing (last: {reason}). Every new value of a non-tensor "
                "argument, and every new shape, compiles the step again: pass a changing "
                "number as a tensor (torch.tensor(value)), and pad batches to a few fixed "
                f"shapes. At most {self._size} programs are kept "
                "(data_parallel(..., cache_size=...)).",
                RetraceWarning,
                stacklevel=6,
            )
