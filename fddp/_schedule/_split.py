"""Bucket-ordered tail: split per-leaf work by bucket so the optimizer overlaps communication.

After the backward pass, a functional optimizer runs ``_foreach_*`` ops over every leaf at
once, so its first op needs every bucket's result and nothing it does can hide the all-reduces
still in flight. Splitting each foreach op by the bucket its leaves' gradients come from, then
ordering the graph by the last bucket each node needs, lets the update of bucket ``k`` run
while buckets ``k+1...`` are still on the wire: the step waits only for the last bucket and
its share of the update. DDP cannot do this: its optimizer starts after ``backward()`` returns.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from fddp._schedule._graph import alias_root, is_wait, mutated_inputs

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
    """For every node, the highest launch-order index of a wait it depends on (or -1).

    For foreach ops the value is per element in ``elements``: element ``i`` of the result
    depends only on element ``i`` of its list arguments.
    """
    wait_index = _wait_index(graph)
    need: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, i = node.args
            if _is_foreach(source):
                need[node] = max(_element_need(source, i, need), need.get(source, NO_BUCKET))
                continue
        inputs = [need[a] for a in node.all_input_nodes]
        if _is_foreach(node):
            lists = {id(x) for j in _list_args(node) for x in node.args[j]}
            inputs = [need[a] for a in node.all_input_nodes if id(a) not in lists]
        need[node] = max([wait_index.get(node, NO_BUCKET), *inputs])
    return need


def _element_need(node: fx.Node, i: int, need: dict[fx.Node, int]) -> int:
    return max(need[node.args[j][i]] for j in _list_args(node))


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
            groups.setdefault(_element_need(node, i, need), []).append(i)
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


def order_by_bucket(graph: fx.Graph) -> None:
    """Stable-sort nodes by the last bucket they need, respecting every dependency.

    Dependencies include in-place writes: a write comes after the earlier readers and writer of
    the storage it writes, and later readers come after it.
    """
    need = _buckets_needed(graph)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    key: dict[fx.Node, int] = {}
    last_writer: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        written = {alias_root(a) for a in mutated_inputs(node)}
        roots = {alias_root(a) for a in node.all_input_nodes}
        deps = list(node.all_input_nodes)
        for root in roots:
            deps.extend([last_writer[root]] if root in last_writer else [])
            if root in written:
                deps.extend(readers.get(root, []))
        key[node] = max([need[node], *(key[d] for d in deps)])
        for root in roots:
            if root in written:
                last_writer[root], readers[root] = node, []
            else:
                readers.setdefault(root, []).append(node)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    body.sort(key=lambda n: (key[n], pos[n]))
    heads = [n for n in nodes if n.op == "placeholder"]
    if not body:
        return
    if heads:
        heads[-1].append(body[0])
    else:
        nodes[0].prepend(body[0])
    for before, node in itertools.pairwise(body):
        before.append(node)
