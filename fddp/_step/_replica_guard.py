"""Replicated inputs stay replicated: what must agree on each call, and the evidence that does."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from fddp._compiler._program import Compiled
from fddp._ranks import _digests, _runtime
from fddp._ranks._signature import Signature
from fddp._step._call_inputs import (
    GENERATOR_SOURCE,
    Inputs,
    Layout,
    Returned,
    generator_state,
    layout_of,
    tensor_paths,
)
from fddp._step._call_outputs import CallOutputs
from fddp._step._fed_back import FedBack
from fddp._step._held_tensors import moved
from fddp._step._program_facts import ProgramFacts
from fddp._step._replicated_trees import compare_trees


class ReplicaGuard:
    """The replication checks of one step object (``argnums``: its ``check_replicas``;
    ``generator``: whether every random draw must agree, as under the invariant mode)."""

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        argnums: tuple[int, ...],
        *,
        generator: bool = False,
    ) -> None:
        self._name, self._group, self._argnums = name, group, argnums
        self._generator = generator
        self._layouts: dict[Signature, Layout] = {}
        self._programs = ProgramFacts(name, group, argnums, generator)
        self._outputs = CallOutputs()
        self._fed_back = FedBack(name, argnums)
        self._first_checked: set[int] = set()  # what a program's first run found the same

    def layout(self, signature: Signature, args: tuple) -> Layout:
        found = self._layouts.get(signature)
        if found is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            found = self._layouts[signature] = layout_of(args, self._argnums)
        return found

    def inputs(
        self,
        signature: Signature,
        args: tuple,
        tensors: list[torch.Tensor],
        compiled: Compiled | None,
        device: torch.device,
        *,
        eager: bool = False,
    ) -> Inputs | None:
        """What this call brings to the agreement (None in a world of one; ``compiled``: the
        program the call will run, None before its first compile or in an ``eager`` step,
        which under the invariant mode brings the generator's state on every call). The replicated
        arguments' leaves, and what the replicated outputs fed back into them were computed
        from (learned on earlier calls of ``compiled``), each hashed unless it is the unchanged
        replicated output of a call (one hash per new tensor, none for a step's own state);
        the tensors ``compiled`` holds by reference, hashed where written since the ranks last
        agreed on them (none with ``check_replicas=False``)."""
        self._first_checked = set()
        if _runtime.world_size(self._group) <= 1:
            return None
        layout = self.layout(signature, args)
        needed = self._needed(layout, tensors, compiled)
        more = needed - set(layout.replicated) - set(layout.per_rank)
        replicated = [*layout.replicated, *sorted(i for i in more if i >= 0)]
        layout = dataclasses.replace(layout, replicated=replicated)
        origins: dict[int, Returned] = {}
        unproven = []
        for i in [*replicated, *layout.per_rank]:
            known = self._outputs.origin_of(tensors[i])
            if known is None:
                unproven.append(i)
                continue
            origins[i] = known
            if i in layout.per_rank:
                continue
            if not known.replicated or known.version != tensors[i]._version:
                unproven.append(i)
        hashed_indices = [i for i in unproven if i not in layout.per_rank]
        found = _digests.digests([tensors[i] for i in hashed_indices])
        hashed = dict(zip(hashed_indices, found))
        generator = None
        if GENERATOR_SOURCE in needed or (self._generator and eager):
            generator = generator_state(device)
        held = moved(compiled) if compiled is not None and self._argnums else None
        return Inputs(layout, tensors, hashed, origins, generator, held)

    def _needed(
        self, layout: Layout, tensors: list[torch.Tensor], compiled: Compiled | None
    ) -> set[int]:
        """The sources this call's replicated outputs need beyond the replicated arguments:
        learned from the last call of the same program, whose outputs that come back in them
        were computed from these."""
        if compiled is None or compiled.varying_outputs is None:
            return set()
        program: Compiled = compiled
        facts = self._programs.of(program)
        needed = facts.needed
        if self._outputs.last is not program or facts.sources is None:
            return needed
        todo = [*layout.replicated, *(i for i in needed if i >= 0)]
        seen = set(todo)
        merged: set[int] = set()  # the source sets taken in (a foreach update's outputs share one)
        while todo:
            i = todo.pop()
            known = self._outputs.origin_of(tensors[i]) if 0 <= i < len(tensors) else None
            if known is None or known.call != self._outputs.calls:
                continue
            sources = facts.sources[known.output]
            if id(sources) in merged:
                continue
            merged.add(id(sources))
            for source in sources - seen:
                seen.add(source)
                needed.add(source)
                if source >= 0:
                    todo.append(source)
        return needed

    def after_call(self, compiled: Compiled | None, inputs: Inputs | None, out: Any) -> None:
        """Record the call's output tensors (:meth:`CallOutputs.record`), each the same on
        every rank where computed only from sources this call checked (``inputs``, and what
        its program's first run found the same)."""
        checked, facts = None, None
        if inputs is not None and inputs.held is not None:
            inputs.held.settled()
        if inputs is not None:
            generator = () if inputs.generator is None else (GENERATOR_SOURCE,)
            checked = {*inputs.layout.replicated, *generator} | self._first_checked
            if compiled is not None and compiled.varying_outputs is not None:
                facts = self._programs.of(compiled)
        self._first_checked = set()
        self._outputs.record(compiled, out, checked, facts)

    def before_run(
        self,
        compiled: Compiled,
        args: tuple,
        tensors: list[torch.Tensor],
        device: torch.device,
        inputs: Inputs | None,
    ) -> None:
        """The checks due before a traced call runs: on its program's first run, those of
        :meth:`ProgramFacts.first_run`; on every run, :meth:`FedBack.refuse`."""
        if compiled.varying_tensors is None:
            hashed = None if inputs is None else inputs.hashed
            compiled.varying_tensors, self._first_checked = self._programs.first_run(
                args, tensors, compiled, device, hashed
            )
        self._fed_back.refuse(args)

    def after_run(self, compiled: Compiled, args: tuple, out: Any, inputs: Inputs | None) -> None:
        """After a traced call: its per-rank output leaves (learned after its program's first
        run), to refuse them next time, and what every output is (:meth:`after_call`)."""
        if compiled.varying_outputs is None:
            assert compiled.varying_tensors is not None  # learned before the first run
            compiled.varying_outputs = compiled.output_sources(
                compiled.varying_tensors, tensor_paths(args)
            )
        self._fed_back.remember(compiled.varying_outputs, out)
        self.after_call(compiled, inputs, out)

    def compare_trees(self, args: tuple) -> None:
        """:func:`compare_trees` of this step's replicated arguments; collective."""
        compare_trees(self._name, self._group, self._argnums, args)
