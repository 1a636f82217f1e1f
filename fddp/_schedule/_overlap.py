"""Overlap pass: launch each collective as early as its input allows, wait as late as possible.

Functional collectives return at once and block only in ``wait_tensor``, so every compute node
placed between a launch and its wait runs while the collective is in flight.
"""

from __future__ import annotations

import torch
from torch import fx

from fddp._schedule._graph import (
    in_place_writes,
    is_collective,
    is_wait,
    mutated_inputs,
    positions,
    ready_position,
)


def _unpack_chain(wait: fx.Node) -> list[fx.Node]:
    """The wait and the bucket nodes that only unpack its result (cast, divide, split, view)."""
    bucket = wait.meta.get("fddp_bucket")
    chain, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if bucket is not None and user.meta.get("fddp_bucket") == bucket and user not in chain:
                chain.append(user)
                frontier.append(user)
    return chain


def sink_waits(graph: fx.Graph) -> None:
    """Move every wait, with its unpacking nodes, to just before the first node that needs it."""
    for wait in [n for n in graph.nodes if is_wait(n)]:
        pos = positions(graph)
        chain = sorted(_unpack_chain(wait), key=pos.__getitem__)
        members = set(chain)
        consumers = [u for n in chain for u in n.users if u not in members]
        if not consumers:
            continue
        first = min(consumers, key=pos.__getitem__)
        for node in chain:
            first.prepend(node)


def hoist_launches(graph: fx.Graph) -> None:
    """Move each collective to just after its inputs are ready (and their last in-place write)."""
    for launch in [n for n in graph.nodes if is_collective(n)]:
        pos, writes = positions(graph), in_place_writes(graph)
        sources = [a for a in launch.all_input_nodes]
        ready = max(ready_position(pos, writes, s, launch) for s in sources)
        if ready < pos[launch] - 1:
            list(graph.nodes)[ready].append(launch)


_CHEAP = {"add", "sub", "mul", "div", "neg", "view", "reshape", "t", "_unsafe_view", "clone"}


def _cheap(node: fx.Node) -> bool:
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        and target._opname in _CHEAP
        and not mutated_inputs(node)
    )


def hoist_gradient_sums(graph: fx.Graph) -> None:
    """Move the cheap ops that finish each all-reduced value up to right after their inputs.

    A gradient summed over microbatches is finished by an ``add`` that the trace places after
    the whole last backward pass; hoisted to where its last term is produced, its bucket can
    launch during that backward instead of after it.
    """
    sources = [n.args[0] for n in graph.nodes if is_collective(n) and n.args]
    cone: set[fx.Node] = set()
    stack = [s for s in sources if isinstance(s, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in cone and _cheap(node):
            cone.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(cone, key=positions(graph).__getitem__):
        pos, writes = positions(graph), in_place_writes(graph)
        ready = max(ready_position(pos, writes, a, node) for a in node.all_input_nodes)
        if ready < pos[node] - 1:
            list(graph.nodes)[ready].append(node)


def overlap(graph: fx.Graph) -> None:
    hoist_launches(graph)
    sink_waits(graph)
