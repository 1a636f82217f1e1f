"""Where fully sharded parameters are gathered, and for how long a gathered bucket lives."""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch
from torch import fx

from fddp._base._annotations import FORWARD, LEAF_PATH, PARAM_GATHER, PARAM_GATHER_KEPT
from fddp._compiler._graph import is_collective, is_view, is_wait, mutated_inputs
from fddp._compiler._passes._overlap import bound_sharding_collectives

PREFETCH = 1  # gathers in flight ahead of the one being waited for
# Each in flight holds a whole bucket of gradients (and, on gloo, receives one); one overlaps
# a layer's backward as FSDP2's does, and the MLP of benchmarks/step_memory.py peaks 6 MiB
# lower than with two, at the same step time.
REDUCE_SCATTERS_IN_FLIGHT = 1
INSTANCE = "fddp_gather_instance"  # on every node of one gather: (bucket key, span index)
SPANS = "fddp_gather_spans"  # on a gather's launch: how many gathers its bucket has


def _tag(node: fx.Node, key: str) -> object:
    return node.meta.get("custom", {}).get(key)


def drop_unused_collectives(graph: fx.Graph) -> int:
    """Remove collectives whose result nobody reads (an all-gather of updates that a fully
    sharded step never needs); every rank compiles the same graph, so all drop the same."""
    dropped = 0
    for wait in [n for n in graph.nodes if is_wait(n) and not n.users]:
        launch = wait.args[0]
        if not isinstance(launch, fx.Node) or not is_collective(launch):
            continue
        if len(launch.users) != 1 or mutated_inputs(launch):
            continue
        graph.erase_node(wait)
        graph.erase_node(launch)
        dropped += 1
    if dropped:
        graph.eliminate_dead_code()
    return dropped


def _groups(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    groups: dict[str, list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        key = _tag(node, PARAM_GATHER)
        if isinstance(key, str):
            groups[key].append(node)
    return {k: v for k, v in groups.items() if sum(map(is_collective, v)) == 1}


def _views_of(members: set[fx.Node]) -> list[fx.Node]:
    """The views outside ``members`` of the tensors they hold, in graph order."""
    views: set[fx.Node] = set()
    frontier = list(members)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in members and user not in views and is_view(user):
                views.add(user)
                frontier.append(user)
    return sorted(views)


class _Bucket:
    def __init__(self, key: str, members: list[fx.Node]) -> None:
        self.key, self.members = key, members
        self.kept = bool(_tag(members[0], PARAM_GATHER_KEPT))
        self.launch = next(n for n in members if is_collective(n))
        self.views = _views_of(set(members))
        self.family = set(members) | set(self.views)
        self.uses = sorted({u for n in self.family for u in n.users if u not in self.family})


def _spans(buckets: list[_Bucket]) -> dict[str, list[list[fx.Node]]]:
    """Each bucket's uses cut where the step turns from a forward pass to its backward pass or
    back (the next microbatch) and other buckets are used in between (FSDP2's resharding
    after forward, which is moot for the last layers: their backward follows at once)."""
    users: dict[fx.Node, list[_Bucket]] = collections.defaultdict(list)
    for bucket in buckets:
        for use in bucket.uses:
            users[use].append(bucket)
    spans: dict[str, list[list[fx.Node]]] = {b.key: [] for b in buckets}
    last: dict[str, tuple[int, bool]] = {}
    for k, use in enumerate(sorted(users)):
        forward = bool(_tag(use, FORWARD))
        for bucket in users[use]:
            before, was_forward = last.get(bucket.key, (-1, forward))
            turned = was_forward != forward and before < k - 1
            if bucket.key not in last or (turned and not bucket.kept):
                spans[bucket.key].append([])
            spans[bucket.key][-1].append(use)
            last[bucket.key] = k, forward
    return spans


def _copy_for(graph: fx.Graph, bucket: _Bucket, span: list[fx.Node], index: int) -> None:
    """A second (third...) gather of ``bucket`` for the uses in ``span``, rewired to it."""
    mapping: dict[fx.Node, fx.Node] = {}

    def copy(node: fx.Node) -> fx.Node:
        if node not in mapping:
            for parent in node.all_input_nodes:
                if parent in bucket.family:
                    copy(parent)
            with graph.inserting_before(span[0]):
                mapping[node] = graph.node_copy(node, lambda a: mapping.get(a, a))
            mapping[node].meta[INSTANCE] = (bucket.key, index)
        return mapping[node]

    for node in bucket.members:
        copy(node)
    for use in span:
        for parent in list(use.all_input_nodes):
            if parent in bucket.family:
                use.replace_input_with(parent, copy(parent))


def _launch_chain(members: list[fx.Node], launch: fx.Node) -> list[fx.Node]:
    """The members that prepare the launch, with it, in graph order."""
    chain = {launch}
    for node in reversed(members):
        if node in chain:
            chain.update(p for p in node.all_input_nodes if p in members)
    return [n for n in members if n in chain]


def _movable(chain: list[fx.Node]) -> bool:
    """A launch chain reads only placeholders (the shards) and itself."""
    inside = set(chain)
    return all(p in inside or p.op == "placeholder" for n in chain for p in n.all_input_nodes)


def place(graph: fx.Graph, prefetch: int = PREFETCH) -> None:
    """Gather each bucket once per span of its uses, prefetched ``prefetch`` gathers ahead."""
    buckets = [_Bucket(k, m) for k, m in _groups(graph).items()]
    buckets = [b for b in buckets if b.uses]
    if not buckets:
        return
    spans = _spans(buckets)
    for bucket in buckets:
        for node in bucket.members:
            node.meta[INSTANCE] = (bucket.key, 0)
        for index, span in enumerate(spans[bucket.key][1:], start=1):
            _copy_for(graph, bucket, span, index)
    instances: dict[tuple[str, int], list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        if INSTANCE in node.meta:
            instances[node.meta[INSTANCE]].append(node)
    order = sorted(
        ((spans[key][index][0], key, index) for key, index in instances),
        key=lambda t: t[0],
    )
    backward_from = _backward_starts(sorted({u for key in spans for s in spans[key] for u in s}))
    heads = [n for n in graph.nodes if n.op == "placeholder"]
    start = heads[-1] if heads else None
    for j, (first_use, key, index) in enumerate(order):
        nodes = instances[(key, index)]
        launch = next(n for n in nodes if is_collective(n))
        chain = _launch_chain(nodes, launch)
        in_chain = set(chain)
        rest = [n for n in nodes if n not in in_chain]
        for node in rest:
            first_use.prepend(node)
        if _movable(chain):
            anchor = order[j - prefetch][0] if j >= prefetch else None
            if anchor is not None and first_use in backward_from:  # not across the loss
                anchor = max(anchor, backward_from[first_use])
            if anchor is not None and rest and rest[0] < anchor:  # two first uses at one node
                anchor = rest[0]
            for node in chain:
                if anchor is not None:
                    anchor.prepend(node)
                elif start is not None:
                    start.append(node)
                    start = node
                else:
                    graph.find_nodes(op="output")[0].prepend(node)
        launch.meta[SPANS] = len(spans[key])
    _sink_views(graph)
    sink_allocations(graph)
    bound_sharding_collectives(graph, limit=REDUCE_SCATTERS_IN_FLIGHT)
    one_gather_at_a_time(graph)
    graph.eliminate_dead_code()


def _gathers_params(node: fx.Node) -> bool:
    return is_collective(node) and _tag(node, PARAM_GATHER) is not None


def one_gather_at_a_time(graph: fx.Graph) -> None:
    """Each parameter gather waited for before the next one launches.

    On gloo they are its own all-gather, which corrupts the heap when two run at once (see
    ``fddp._collectives._ops.gather_rows``). The placement above launches each gather after the wait
    of the one before; a gather whose shard the step computes stays where it was traced."""
    in_flight: fx.Node | None = None
    for node in list(graph.nodes):
        if is_wait(node) and node.args[0] is in_flight:
            in_flight = None
        elif _gathers_params(node):
            if in_flight is not None:
                node.prepend(next(u for u in in_flight.users if is_wait(u)))
            in_flight = node


def _fresh(node: fx.Node, sinking: set[fx.Node]) -> bool:
    """A buffer made from nothing (``empty``, ``zeros``) or a view of one."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    inputs = node.all_input_nodes
    if not inputs:
        return not mutated_inputs(node)
    return is_view(node) and all(p in sinking for p in inputs)


def sink_allocations(graph: fx.Graph) -> None:
    """Every fresh buffer and its views just before their first user.

    Ordering the graph by bucket (``_overlap``) runs first whatever needs no collective, as
    the gradient buckets' ``empty`` do; in a fully sharded step the forward pass needs the
    gathers, so every gradient bucket would be allocated before it and live all step."""
    sinking: set[fx.Node] = set()
    for node in graph.nodes:
        if node.users and _fresh(node, sinking):
            sinking.add(node)
    for node in sorted(sinking, reverse=True):
        first = min(node.users)
        if node.next is not first:
            first.prepend(node)


def _backward_starts(uses: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """For each use in a backward pass, the first use of that pass (``uses`` in graph order).

    A gather prefetched from the forward pass for the backward pass would be alive through
    the loss and its gradient, where the activations peak: FSDP2 does not prefetch there
    either."""
    out: dict[fx.Node, fx.Node] = {}
    first: fx.Node | None = None
    for use in uses:
        first = None if _tag(use, FORWARD) else (first or use)
        if first is not None:
            out[use] = first
    return out


def _sink_views(graph: fx.Graph) -> None:
    """Every view of a gathered bucket just before its first user (views cost nothing)."""
    tagged = [n for n in graph.nodes if INSTANCE in n.meta]
    family = set(tagged)
    for view in _views_of(family):
        family.add(view)
    for node in sorted(family, reverse=True):
        if _tag(node, PARAM_GATHER) is not None or not (is_view(node) or INSTANCE not in node.meta):
            continue
        if not node.users:  # a view that the uses rewired to another gather no longer read
            graph.erase_node(node)
            continue
        first = min(node.users)
        if node.next is not first:
            first.prepend(node)


class Described(NamedTuple):
    which: str  # "params 0.3, 2 of 2"
    leaves: tuple[str, ...]
    last_use: fx.Node


def describe(graph: fx.Graph) -> dict[fx.Node, Described]:
    """For the plan, by launch: which gather it is and the last use of what it gathered."""
    instances: dict[tuple[str, int], set[fx.Node]] = collections.defaultdict(set)
    for node in graph.nodes:
        if INSTANCE in node.meta:
            instances[node.meta[INSTANCE]].add(node)
    out = {}
    for (key, index), members in instances.items():
        launch = next((n for n in members if is_collective(n)), None)
        if launch is None:
            continue
        family = members | set(_views_of(members))
        uses = [u for n in family for u in n.users if u not in family]
        leaves = _tag(launch, LEAF_PATH)
        out[launch] = Described(
            f"params {key}, {index + 1} of {launch.meta.get(SPANS, 1)}",
            tuple(leaves) if isinstance(leaves, tuple) else (),
            max(uses) if uses else launch,
        )
    return out
