"""Overlap pass: launch each collective as early as its input allows, wait as late as possible.

Functional collectives return at once and block only in ``wait_tensor``, so every compute node
placed between a launch and its wait runs while the collective is in flight.
"""

from __future__ import annotations

from torch import fx

from fddp._schedule._graph import (
    in_place_writes,
    is_collective,
    is_wait,
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


def overlap(graph: fx.Graph) -> None:
    hoist_launches(graph)
    sink_waits(graph)
