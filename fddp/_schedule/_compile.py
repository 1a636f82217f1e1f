"""The pipeline from an aten graph to a runnable step: bucket, overlap, describe, build."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from fddp._schedule import _backend, _bucket, _overlap, _plan, _reinplace, _split
from fddp._schedule._capture import Captured
from fddp._schedule._fingerprint import collective_sequence


@dataclasses.dataclass(frozen=True)
class Options:
    bucket_cap_bytes: int | None  # None: automatic, see _bucket.auto_cap
    first_bucket_cap_bytes: int
    comm_dtype: torch.dtype | None
    compile: bool | str
    overlap: bool = True
    reinplace: bool = True


@dataclasses.dataclass
class Program:
    """A scheduled graph ready to run, with its plan and its collective sequence."""

    graph: fx.GraphModule
    schedule: _plan.Schedule
    sequence: list[str]
    run: _backend.Runner


def schedule_graph(captured: Captured, options: Options, donated: set[int]) -> Program:
    """Bucket, overlap and reinplace the captured graph, then build its runner.

    ``donated`` holds the indices (into the step's flat tensor arguments) whose storage the
    program may overwrite.
    """
    gm = captured.graph
    graph = gm.graph
    if options.overlap:
        _overlap.hoist_gradient_sums(graph)
    members = _bucket.find_members(graph)
    cap = options.bucket_cap_bytes
    if cap is None:
        cap = _bucket.auto_cap(members, options.first_bucket_cap_bytes)
    buckets = _bucket.assign(members, cap, options.first_bucket_cap_bytes)
    in_place = options.compile in (False, None, "fx")
    bucket_nodes = _bucket.rewrite(graph, buckets, options.comm_dtype, functional=not in_place)
    if options.overlap:
        _split.split_foreach(graph)
        _overlap.overlap(graph)
        _split.order_by_bucket(graph)
    if options.reinplace and in_place:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        donated_nodes = {
            node
            for node, source in zip(placeholders, captured.inputs)
            if isinstance(source, int) and source in donated
        }
        _reinplace.reinplace(graph, donated_nodes)
    graph.lint()
    gm.recompile()
    plan = _plan.describe(graph, bucket_nodes, captured.seconds)
    return Program(gm, plan, collective_sequence(graph), _backend.build(gm, options.compile))
