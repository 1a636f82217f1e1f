"""Overlap pass: where work runs relative to the collectives."""

from __future__ import annotations

import collections
import itertools
import operator
from typing import cast

import torch
from torch import fx

from fddp._base._annotations import BUCKET, EXACT_SUM, PARAM_GATHER, REMAT_RECOMPUTED
from fddp._compiler._graph import (
    alias_root,
    c10d,
    in_place_writes,
    is_collective,
    is_wait,
    mutated_inputs,
    ready_node,
)


def _unpack_chain(wait: fx.Node) -> list[fx.Node]:
    """The wait and the bucket nodes that only unpack its result (cast, divide, split, view)."""
    bucket = wait.meta.get(BUCKET)
    chain, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if bucket is not None and user.meta.get(BUCKET) == bucket and user not in chain:
                chain.append(user)
                frontier.append(user)
    return chain


def sink_waits(graph: fx.Graph) -> None:
    """Move every wait, with its unpacking nodes, to just before the first node that needs it."""
    for wait in [n for n in graph.nodes if is_wait(n)]:
        chain = sorted(_unpack_chain(wait))
        members = set(chain)
        consumers = [u for n in chain for u in n.users if u not in members]
        if not consumers:
            continue
        first = min(consumers)
        for node in chain:
            first.prepend(node)


def hoist_launches(graph: fx.Graph) -> None:
    """Move each collective to just after its inputs are ready (and their last in-place write)."""
    writes = in_place_writes(graph)  # moving a launch adds no writer
    for launch in [n for n in graph.nodes if is_collective(n)]:
        ready = max(ready_node(writes, s, launch) for s in launch.all_input_nodes)
        if ready.next is not launch:
            ready.append(launch)


_CHEAP = {"add", "sub", "mul", "div", "neg", "view", "reshape", "t", "_unsafe_view", "clone"}
_CHEAP |= {"cat", "constant_pad_nd"}  # packing a bucket for shard_state's reduce-scatter


def _cheap(node: fx.Node) -> bool:
    target = node.target
    return (
        isinstance(target, torch._ops.OpOverload)
        and target._opname in _CHEAP
        and not mutated_inputs(node)
    )


def _exact_sum(node: fx.Node) -> bool:
    """A node of the invariant mode's reduction of one leaf up to its sum's all-reduce: traced
    so (``EXACT_SUM``), or a bucket made only of its exponents' all-reduces."""
    return bool(node.meta.get(EXACT_SUM) or node.meta.get("custom", {}).get(EXACT_SUM))


def hoist_gradient_sums(graph: fx.Graph) -> None:
    """Move the cheap ops that finish each all-reduced value up to right after their inputs.

    A gradient summed over microbatches is finished by an ``add`` that the trace places after
    the whole last backward pass; hoisted to where its last term is produced, its bucket can
    launch during that backward instead of after it. The invariant mode's reduction of a leaf
    (its exponent's all-reduce, the chunks' fixed-point sum) moves the same way, to where the
    leaf's last chunk is ready.
    """
    sources = [n.args[0] for n in graph.nodes if is_collective(n) and n.args]
    cone: set[fx.Node] = set()
    stack = [s for s in sources if isinstance(s, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in cone and (_cheap(node) or _exact_sum(node)):
            cone.add(node)
            stack.extend(node.all_input_nodes)
    writes = in_place_writes(graph)  # cheap ops write nothing, so moving them keeps these
    start = [n for n in graph.nodes if n.op == "placeholder"][-1:]  # a constant goes first
    for node in sorted(cone):
        anchor = max((ready_node(writes, a, node) for a in node.all_input_nodes), default=None)
        if anchor is None and start:
            anchor = start[0]
        if anchor is not None and anchor.next is not node:
            anchor.append(node)


def overlap(graph: fx.Graph) -> None:
    """After bucketing: split the tail by bucket, launch early, wait late, order by bucket."""
    split_foreach(graph)
    hoist_launches(graph)
    sink_waits(graph)
    order_by_bucket(graph)
    bound_sharding_collectives(graph)


NO_BUCKET = -1


def _wait_index(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each wait's rank in launch order."""
    waits = [n for n in graph.nodes if is_wait(n)]
    launches = {w.args[0]: w for w in waits}
    order = [launches[n] for n in graph.nodes if n in launches]
    return {w: i for i, w in enumerate(order)}


def _is_foreach(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._opname.startswith("_foreach_")


def _list_args(node: fx.Node) -> list[int]:
    return [
        i
        for i, a in enumerate(node.args)
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a)
    ]


def _buckets_needed(graph: fx.Graph) -> dict[fx.Node, int]:
    """For every node, the highest launch-order index of a wait it depends on (or -1); the
    invariant mode's exponent waits, which its reduction needs at once, count as none.

    For foreach ops the value is per element in ``elements``: element ``i`` of the result
    depends only on element ``i`` of its list arguments.
    """
    wait_index = _wait_index(graph)
    need: dict[fx.Node, int] = {}
    list_args: dict[fx.Node, list[int]] = {}  # of each foreach op, found once
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, i = node.args
            if source in list_args:
                element = _element_need(source, i, need, list_args[source])
                need[node] = max(element, need.get(source, NO_BUCKET))
                continue
        inputs = [need[a] for a in node.all_input_nodes]
        if _is_foreach(node):
            list_args[node] = _list_args(node)
            lists = {id(x) for j in list_args[node] for x in node.args[j]}
            inputs = [need[a] for a in node.all_input_nodes if id(a) not in lists]
        own = NO_BUCKET if _exact_sum(node) else wait_index.get(node, NO_BUCKET)
        need[node] = max([own, *inputs])
    return need


def _element_need(node: fx.Node, i: int, need: dict[fx.Node, int], lists: list[int]) -> int:
    """The need of element ``i`` of foreach op ``node``, whose list arguments are ``lists``."""
    return max(need[cast("list[fx.Node]", node.args[j])[i]] for j in lists)


def split_foreach(graph: fx.Graph) -> int:
    """Split each foreach op whose elements need different buckets; returns how many split."""
    need = _buckets_needed(graph)
    split = 0
    for node in list(graph.nodes):
        if not _is_foreach(node) or not _list_args(node):
            continue
        if any(u.target is not operator.getitem for u in node.users):
            continue
        lists = _list_args(node)
        length = len(node.args[lists[0]])
        if any(len(node.args[j]) != length for j in lists):
            continue
        groups: dict[int, list[int]] = {}
        for i in range(length):
            groups.setdefault(_element_need(node, i, need, lists), []).append(i)
        if len(groups) < 2:
            continue
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        for g, idx in sorted(groups.items()):
            args = tuple([a[i] for i in idx] if j in lists else a for j, a in enumerate(node.args))
            with graph.inserting_before(node):
                part = graph.call_function(node.target, args, dict(node.kwargs))
            part.meta = {k: v for k, v in node.meta.items() if k != "val"}
            val = node.meta.get("val")
            if isinstance(val, (list, tuple)):
                part.meta["val"] = [val[i] for i in idx]
            need[part] = max(g, need[node])
            for new_i, i in enumerate(idx):
                if i in getitems:
                    getitems[i].args = (part, new_i)
        graph.erase_node(node)
        split += 1
    return split


def dependencies(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """What must run before each node: its inputs and, through in-place writes, the earlier
    readers and writer of a storage it writes and the last writer of one it reads."""
    deps: dict[fx.Node, list[fx.Node]] = {}
    last_writer: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        written = {alias_root(a) for a in mutated_inputs(node)}
        roots = {alias_root(a) for a in node.all_input_nodes}
        deps[node] = list(node.all_input_nodes)
        for root in roots:
            deps[node].extend([last_writer[root]] if root in last_writer else [])
            if root in written:
                deps[node].extend(readers.get(root, []))
        for root in roots:
            if root in written:
                last_writer[root], readers[root] = node, []
            else:
                readers.setdefault(root, []).append(node)
    return deps


def dependents(deps: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
    """The inverse of :func:`dependencies`: what must run after each node."""
    after: dict[fx.Node, list[fx.Node]] = {n: [] for n in deps}
    for node, before in deps.items():
        for d in before:
            after[d].append(node)
    return after


def order_by_bucket(graph: fx.Graph) -> None:
    """Stable-sort nodes by the last bucket they need, respecting every dependency.

    Dependencies include in-place writes: a write comes after the earlier readers and writer of
    the storage it writes, and later readers come after it. A node the remat pass recomputes
    reads only forward values, but stays in the backward where that pass put it: it sorts no
    earlier than the node before it (else a wait in the forward, such as a gather of sharded
    parameters, would pull the recomputation back into the forward).
    """
    need = _buckets_needed(graph)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    deps = dependencies(nodes)
    key: dict[fx.Node, int] = {}
    before = NO_BUCKET
    for node in nodes:
        key[node] = max([need[node], *(key[d] for d in deps[node])])
        if REMAT_RECOMPUTED in node.meta.get("custom", {}):
            key[node] = max(key[node], before)
        before = key[node]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    body.sort(key=lambda n: (key[n], pos[n]))
    _reorder(nodes, body)


def _reorder(nodes: list[fx.Node], body: list[fx.Node]) -> None:
    """Put ``body`` (every node but placeholders and the output) in this order."""
    heads = [n for n in nodes if n.op == "placeholder"]
    if not body:
        return
    if heads:
        heads[-1].append(body[0])
    else:
        nodes[0].prepend(body[0])
    for before, node in itertools.pairwise(body):
        before.append(node)


# Collectives whose buffers are each a whole bucket while the result kept is 1/N of one (a
# reduce-scatter) or whose result is consumed at once (an all-gather of updated shards); on
# gloo both are all-to-alls.
SHARDING_COLLECTIVES = {
    c10d.reduce_scatter_tensor.default,
    c10d.all_gather_into_tensor.default,
    c10d.all_to_all_single.default,
}
SHARDING_IN_FLIGHT = 2
# What finishes a sharding collective's result: views, the local sum of a reduce-scatter, the
# mean's division, a cast, and adding all-gathered updates to the parameters.
_FINISHING = {
    *("view", "_unsafe_view", "reshape", "slice", "split_with_sizes", "squeeze"),
    *("sum", "div", "div_", "mul", "_to_copy", "add", "add_", "_foreach_add", "_foreach_add_"),
}


def _finishes(node: fx.Node) -> bool:
    if node.op != "call_function" or is_collective(node):
        return False
    target = node.target
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and target._opname in _FINISHING


def _gathers_parameters(node: fx.Node) -> bool:
    """A gather of fully sharded parameters: ``_param_gathers`` places those."""
    return PARAM_GATHER in node.meta.get("custom", {})


def bound_sharding_collectives(graph: fx.Graph, limit: int = SHARDING_IN_FLIGHT) -> None:
    """At most ``limit`` reduce-scatters and all-gathers in flight (ZeRO-2's memory bound).

    Waited for late, every bucket's reduce-scatter buffers (the whole bucket sent, on gloo the
    whole bucket received too) would be alive at the end of the backward pass, and every
    all-gather's at the end of the step: twice the gradients' bytes on top of the unsharded
    step's peak. Before launching another, the oldest in flight is waited for and its result
    finished (summed to this rank's shard, or added to the parameters), so its buffers die.
    """
    nodes = list(graph.nodes)
    if not any(n.target in SHARDING_COLLECTIVES and not _gathers_parameters(n) for n in nodes):
        return
    deps = dependencies(nodes)
    users = dependents(deps)
    done: set[fx.Node] = {n for n in nodes if n.op == "placeholder"}
    order: list[fx.Node] = []
    in_flight: collections.deque[fx.Node] = collections.deque()

    def run(node: fx.Node) -> None:
        order.append(node)
        done.add(node)

    def finish(launch: fx.Node) -> None:
        waits = [u for u in launch.users if is_wait(u) and u not in done]
        if len(waits) != 1 or not all(d in done for d in deps[waits[0]]):
            return
        run(waits[0])
        frontier = waits
        while frontier:
            for user in users[frontier.pop()]:
                if user not in done and _finishes(user) and all(d in done for d in deps[user]):
                    run(user)
                    frontier.append(user)

    for node in nodes:
        if node in done or node.op == "output":
            continue
        if node.target in SHARDING_COLLECTIVES and not _gathers_parameters(node):
            while len(in_flight) >= limit:
                finish(in_flight.popleft())
            in_flight.append(node)
        run(node)
    _reorder(nodes, [n for n in order if n.op != "placeholder"])
