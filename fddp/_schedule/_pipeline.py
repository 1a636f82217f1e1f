"""The pass pipeline from a captured aten graph to a runnable step, in DESIGN.md's order:
replication analysis, bucket, overlap, reinplace, describe, build."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from fddp._schedule import (
    _across_steps,
    _backend,
    _bucket,
    _cost,
    _gate,
    _overlap,
    _plan,
    _reinplace,
    _replication,
)
from fddp._schedule._capture import Captured


@dataclasses.dataclass(frozen=True)
class Options:
    bucket_cap_bytes: int | None  # None: automatic, see _bucket.auto_cap
    first_bucket_cap_bytes: int
    comm_dtype: torch.dtype | None
    compile: bool | str
    overlap_steps: bool = False


@dataclasses.dataclass
class Program:
    """A scheduled graph ready to run, with its plan, its collective sequence, and for each
    graph output the placeholders it depends on without a collective in between (see
    ``_replication.dependencies``)."""

    graph: fx.GraphModule
    schedule: _plan.Plan
    sequence: list[str]
    run: _backend.Runner
    output_dependencies: list[int]
    rank_bit: int
    across_steps: _across_steps.AcrossSteps | None = None  # overlap_steps=True, if any wait
    gated: bool = False  # a gate settles the call's signature check before the first collective


def schedule_graph(
    captured: Captured, options: Options, donated: set[int], machine: _cost.Machine | None = None
) -> Program:
    """Bucket, overlap and reinplace the captured graph, then build its runner.

    ``donated`` holds the indices (into the step's flat tensor arguments) whose storage the
    program may overwrite; ``machine``, the measurements the default bucket cap is chosen from
    (None in a world of one: a sixteenth of the gradient bytes).
    """
    gm = captured.graph
    graph = gm.graph
    output_dependencies, rank_bit = _replication.dependencies(graph)
    _overlap.hoist_gradient_sums(graph)
    members = _bucket.find_members(graph)
    cap, cap_reason = _bucket_cap(graph, members, options, machine)
    buckets = _bucket.assign(members, cap, options.first_bucket_cap_bytes)
    in_place = options.compile in (False, None, "fx")
    bucket_nodes = _bucket.rewrite(graph, buckets, options.comm_dtype, functional=not in_place)
    if in_place:
        _bucket.pack_concatenations_in_place(graph)
    _overlap.overlap(graph)
    across_steps = None
    gated = in_place and _gate.insert(graph)  # Inductor cannot compile a Python call
    if in_place:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        is_donated = [isinstance(s, int) and s in donated for s in captured.inputs]
        if options.overlap_steps:
            gm.recompile()
            across_steps = _across_steps.AcrossSteps(gm, is_donated)
            across_steps = across_steps if across_steps.active else None
        _reinplace.reinplace(graph, {n for n, d in zip(placeholders, is_donated) if d})
    graph.lint()
    gm.recompile()
    plan = _plan.describe(graph, bucket_nodes, captured.seconds, captured.method)
    plan = dataclasses.replace(plan, bucket_cap=cap_reason if members else "")
    runner = _backend.build(gm, options.compile)
    sequence = _plan.collective_sequence(graph)
    return Program(gm, plan, sequence, runner, output_dependencies, rank_bit, across_steps, gated)


def _bucket_cap(
    graph: fx.Graph,
    members: list[_bucket.Member],
    options: Options,
    machine: _cost.Machine | None,
) -> tuple[int, str]:
    """The cap in bytes for the buckets after the first, and a line that says where it came
    from."""
    first = options.first_bucket_cap_bytes
    if options.bucket_cap_bytes is not None:
        cap = options.bucket_cap_bytes
        return cap, f"bucket cap {cap / _cost.MIB:g} MiB, set by bucket_cap_mb"
    if machine is None or not members:
        cap = _bucket.auto_cap(members, first)
        return cap, f"bucket cap {cap / _cost.MIB:g} MiB, a sixteenth of the gradient bytes"
    choice = _cost.choose_cap(graph, members, first, machine)
    return choice.cap, str(choice)
