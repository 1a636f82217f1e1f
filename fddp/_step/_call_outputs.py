"""The outputs of a step's last calls: where each came out, and whether every rank has it alike."""

from __future__ import annotations

import collections
import weakref
from typing import Any

import optree
import torch

from fddp._compiler._program import Compiled
from fddp._step._call_inputs import Returned, readable_paths
from fddp._step._program_facts import Facts

_CALLS_REMEMBERED = 8  # outputs of this many last calls are known by their origin


class CallOutputs:
    """The output tensors of a step object's last few calls, known by their origin."""

    def __init__(self) -> None:
        self._known: dict[int, Returned] = {}  # id of an output tensor -> what it is
        self._by_call: collections.deque[list[int]] = collections.deque()  # their ids by call
        self.last: Compiled | None = None  # the program the last call ran
        self.calls = 0  # calls whose outputs were recorded

    def origin_of(self, tensor: torch.Tensor) -> Returned | None:
        """What ``tensor`` is, if it is an output of one of the last calls (None otherwise)."""
        known = self._known.get(id(tensor))
        return None if known is None or known.ref() is not tensor else known

    def record(
        self,
        compiled: Compiled | None,
        out: Any,
        checked: set[int] | None,
        facts: Facts | None,
    ) -> None:
        """Record a call's output tensors: where each came out, and whether it is the same on
        every rank: computed, without a collective in between, only from sources the call
        ``checked`` (None in a world of one: nothing is recorded), by a program the ranks
        compared (``facts``: what is known of it, None for an eager call or a program whose
        per-rank outputs are not known yet)."""
        self.calls += 1
        self.last = compiled
        if checked is None:
            return
        call = self.calls
        varying = None if compiled is None else compiled.varying_outputs
        if facts is None or compiled is None or varying is None:
            sources, paths = None, readable_paths(out)
        else:
            sources, paths = facts.outputs(compiled, out)
        ids = []
        within: dict[int, bool] = {}  # per distinct source set, whether this call checked it
        for j, leaf in enumerate(optree.tree_leaves(out)):
            if not isinstance(leaf, torch.Tensor):
                continue
            replicated = False
            if sources is not None and j not in varying:  # type: ignore[operator]
                found = within.get(id(sources[j]))
                if found is None:
                    found = within[id(sources[j])] = sources[j] <= checked
                replicated = found
            self._known[id(leaf)] = Returned(
                weakref.ref(leaf), j, call, replicated, leaf._version, paths
            )
            ids.append(id(leaf))
        self._forget(ids, call)

    def _forget(self, ids: list[int], call: int) -> None:
        """Keep the outputs of the last few calls only."""
        self._by_call.append(ids)
        if len(self._by_call) > _CALLS_REMEMBERED:
            for k in self._by_call.popleft():
                known = self._known.get(k)
                if known is not None and known.call <= call - _CALLS_REMEMBERED:
                    del self._known[k]
