"""What a program's first run teaches: which inputs differ, and what each output is made from."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError
from fddp._compiler._passes._replication import drawn_bit, generator_bit
from fddp._compiler._program import Compiled
from fddp._ranks import _digests, _runtime
from fddp._ranks._agree import find_difference
from fddp._step._call_inputs import (
    GENERATOR,
    GENERATOR_SOURCE,
    RANK_SOURCE,
    generator_state,
    layout_of,
    readable_paths,
)


def describe_source(source: str) -> str:
    return source if source.startswith("the rank") else f"argument leaf {source}"


def sources_of(compiled: Compiled, j: int) -> set[int]:
    """The sources output leaf ``j`` of ``compiled`` is computed from without a collective in
    between: tensor argument indices, :data:`GENERATOR_SOURCE`, :data:`RANK_SOURCE`."""
    outputs = compiled.captured.outputs
    assert outputs is not None  # known after the first call
    kind, v = outputs[j]
    if kind == "arg":
        return {v}
    if kind != "graph":
        return set()
    program, inputs = compiled.program, compiled.captured.inputs
    bits = program.output_dependencies[v]
    found = {s for k, s in enumerate(inputs) if isinstance(s, int) and bits >> k & 1}
    if bits & program.rank_bit:
        found.add(RANK_SOURCE)
    if bits & generator_bit(program.rank_bit):
        found.add(GENERATOR_SOURCE)
    return found


def draws(compiled: Compiled, through_collectives: bool) -> bool:
    """Whether a random draw of the program reaches an output without a collective in
    between, or (``through_collectives``) at all."""
    program = compiled.program
    bit = (drawn_bit if through_collectives else generator_bit)(program.rank_bit)
    return any(bits & bit for bits in program.output_dependencies)


@dataclasses.dataclass
class Facts:
    """What the guard learned of one program: per output leaf its sources and path (once its
    outputs are known), and the sources its replicated outputs need beyond the replicated
    arguments."""

    ref: weakref.ref
    needed: set[int]
    sources: list[frozenset[int]] | None = None
    paths: list[str] | None = None

    def outputs(self, compiled: Compiled, out: Any) -> tuple[list[frozenset[int]], list[str]]:
        if self.sources is None or self.paths is None:
            count = len(compiled.captured.outputs or ())
            interned: dict[frozenset[int], frozenset[int]] = {}
            self.sources = []
            for j in range(count):
                found = frozenset(sources_of(compiled, j))
                self.sources.append(interned.setdefault(found, found))
            self.paths = readable_paths(out)
        return self.sources, self.paths


@dataclasses.dataclass
class ProgramFacts:
    """What one step object (``name``) learns of its programs (``argnums``: its
    ``check_replicas``; ``generator``: whether every random draw must agree, as under the
    invariant mode)."""

    name: str
    group: dist.ProcessGroup | None
    argnums: tuple[int, ...]
    generator: bool
    _facts: dict[int, Facts] = dataclasses.field(default_factory=dict)  # by the program's id

    def of(self, compiled: Compiled) -> Facts:
        """What is known of ``compiled``; at first, under the invariant mode, that its random
        draws must agree."""
        facts = self._facts.get(id(compiled))
        if facts is None or facts.ref() is not compiled:
            if len(self._facts) >= 64:
                self._facts = {k: f for k, f in self._facts.items() if f.ref() is not None}
            needed = {GENERATOR_SOURCE} if self.generator and draws(compiled, True) else set()
            facts = self._facts[id(compiled)] = Facts(weakref.ref(compiled), needed)
        return facts

    def first_run(
        self,
        args: tuple,
        tensors: list[torch.Tensor],
        compiled: Compiled,
        device: torch.device,
        hashed: dict[int, torch.Tensor] | None = None,
    ) -> tuple[list[bool], set[int]]:
        """Before a traced signature's first run: which tensor arguments differ between ranks
        (one small all-gather of digests, the random generator's state with them where the
        program draws from it), and the sources found the same on every rank; the replicated
        arguments must not differ, nor the generator where a random draw reaches an output that
        is otherwise the same on every rank. ``hashed``: digests the call already has (its
        :class:`Inputs`), not computed again."""
        if _runtime.world_size(self.group) <= 1:
            return [False] * len(tensors), set()
        extra = [generator_state(device)] if draws(compiled, self.generator) else []
        sources = [*tensors, *extra]
        hashed = hashed or {}
        rest = [i for i in range(len(sources)) if i not in hashed]
        known = torch.zeros(len(sources), 2, dtype=torch.int64)
        if hashed:
            known[list(hashed)] = torch.stack(list(hashed.values()))
        known[rest] = _digests.digests([sources[i] for i in rest])
        varying = _digests.varying(sources, self.group, known)
        generator_varies = bool(extra) and varying.pop()
        layout = layout_of(args, self.argnums)
        paths = layout.paths
        for i in layout.replicated:
            if varying[i]:
                raise ReplicaMismatchError(
                    f"arguments {list(self.argnums)} of {self.name} differ between "
                    f"ranks: leaf {paths[i]} is not the same on every rank. Replicas must "
                    "start from the same values: create them from the same seed and model "
                    "code, or call fddp.replicate(tree) before training; check_replicas=False "
                    "turns this check off."
                )
        if generator_varies and self._generator_matters(compiled, varying):
            bits = int(_digests.digests(extra)[0, 0]) & (2**64 - 1)
            named = find_difference([(GENERATOR, f"digest {bits:016x}")], self.group)
            raise ReplicaMismatchError(
                f"{self.name}: {named}, and the step's results depend on its draws"
                + (
                    " (under the invariant mode, dropout is drawn from it: the results would "
                    "depend on the world size)"
                    if self.generator
                    else " where they must be the same on every rank"
                )
                + ". Seed every rank alike (torch.manual_seed(seed) before the first call, "
                "and fddp.save/load its state with the checkpoint)."
            )
        same = {i for i, differs in enumerate(varying) if not differs}
        if extra and not generator_varies:
            same.add(GENERATOR_SOURCE)
        return varying, same

    def _generator_matters(self, compiled: Compiled, varying: list[bool]) -> bool:
        """Under the invariant mode, always; otherwise where a random draw reaches an output
        computed from nothing else that differs between ranks."""
        if self.generator:
            return True
        outputs = compiled.captured.outputs or []
        for j in range(len(outputs)):
            sources = sources_of(compiled, j)
            if GENERATOR_SOURCE in sources and not any(
                s == RANK_SOURCE or (s >= 0 and varying[s]) for s in sources
            ):
                return True
        return False
