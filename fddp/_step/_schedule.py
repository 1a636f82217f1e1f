"""What ``schedule()`` shows of a compiled step: its plan, and which outputs are per-rank."""

from __future__ import annotations

import dataclasses

from fddp._compiler._plan import Plan
from fddp._compiler._program import Compiled
from fddp._step._program_facts import describe_source


def plan_of(compiled: Compiled) -> Plan:
    """``compiled``'s plan, with what it overlaps across steps and, after its first call,
    whether each output is replicated or per-rank (and from what)."""
    plan = compiled.program.schedule
    if compiled.program.across_steps is not None:
        plan = dataclasses.replace(plan, across_steps=compiled.program.across_steps.describe())
    varying = compiled.varying_outputs
    if varying is None:
        return plan
    replication = tuple(
        (path, _replication(varying, j)) for j, path in enumerate(compiled.output_paths())
    )
    return dataclasses.replace(plan, replication=replication)


def _replication(varying: dict[int, tuple[str, str]], j: int) -> str:
    return f"per-rank (from {describe_source(varying[j][1])})" if j in varying else "replicated"
