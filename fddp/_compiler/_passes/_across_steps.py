"""Overlap across steps: the last buckets' waits and updates run in the next call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from fddp._compiler import _backend
from fddp._compiler._graph import alias_root, is_collective, is_wait, mutated_inputs, nbytes
from fddp._compiler._passes import _reinplace
from fddp._compiler._passes._overlap import dependencies, dependents
from fddp._ranks._pending import _DONATED, Deferred, PendingTensor, _finished, complete_orphans

# The share of a step's all-reduced bytes, launched last, whose waits and updates are deferred.
DEFERRED_SHARE = 0.5


def deferred_nodes(graph: fx.Graph, share: float = DEFERRED_SHARE) -> set[fx.Node]:
    """The nodes that run in the next call: everything that needs the waits of the last
    collectives launched, up to ``share`` of the bytes (at least one), as long as each of
    them is deferrable (its dependents, through data and in-place writes, launch no
    collective and write no input)."""
    nodes = list(graph.nodes)
    after = dependents(dependencies(nodes))
    waits = {w.args[0]: w for w in nodes if is_wait(w) and _launched_here(w)}
    launches = [n for n in nodes if n in waits]
    total = sum(nbytes(n) for n in launches)
    tail: set[fx.Node] = set()
    taken = 0
    for launch in reversed(launches):
        if tail and taken + nbytes(launch) > share * total:
            break
        closure = _closure(waits[launch], after)
        closure.discard(nodes[-1])  # the output
        if any(is_collective(n) or _writes_an_input(n) for n in closure):
            break
        tail |= closure
        taken += nbytes(launch)
    return tail


def _launched_here(wait: fx.Node) -> bool:
    launch = wait.args[0]
    return isinstance(launch, fx.Node) and is_collective(launch)


def _closure(start: fx.Node, after: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(after[node])
    return seen


def _writes_an_input(node: fx.Node) -> bool:
    return any(alias_root(a).op == "placeholder" for a in mutated_inputs(node))


def _storages(node: fx.Node) -> set[StorageWeakRef]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return {StorageWeakRef(v.untyped_storage()) for v in vals if isinstance(v, torch.Tensor)}


@dataclasses.dataclass
class _Cut:
    """Where a graph splits: the tail nodes, the carried values, which outputs wait."""

    tail: set[fx.Node]
    carried: list[fx.Node]
    ready: list[int]
    deferred: list[int]
    owned: list[bool]  # per carried value: nothing else reads its storage, the tail may write it


def _cut(gm: fx.GraphModule, donated: list[bool], role: dict[fx.Node, str]) -> _Cut | None:
    graph = gm.graph
    tail = deferred_nodes(graph)
    if not tail:
        return None
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outputs = list(nodes[-1].args[0])
    ready = [i for i, x in enumerate(outputs) if not (isinstance(x, fx.Node) and x in tail)]
    deferred = sorted(set(range(len(outputs))) - set(ready))
    carried_set = {a for n in tail for a in n.all_input_nodes if a not in tail}
    carried = sorted(carried_set, key=lambda n: role[n])
    keep: set[StorageWeakRef] = set()
    for node, is_donated in zip(placeholders, donated):
        if not is_donated:
            keep |= _storages(node)
    for node in nodes:
        if node.op == "get_attr":
            keep |= _storages(node)
    for i in ready:
        if isinstance(outputs[i], fx.Node):
            keep |= _storages(outputs[i])
    owned = [bool(_storages(c)) and not (_storages(c) & keep) for c in carried]
    return _Cut(tail, carried, ready, deferred, owned)


def _head_graph(gm: fx.GraphModule, cut: _Cut) -> fx.GraphModule:
    graph, env = fx.Graph(), dict[fx.Node, fx.Node]()
    nodes = list(gm.graph.nodes)
    for node in nodes[:-1]:
        if node not in cut.tail:
            env[node] = graph.node_copy(node, env.__getitem__)
    outputs = list(nodes[-1].args[0])
    graph.output([_mapped(outputs[i], env) for i in cut.ready] + [env[c] for c in cut.carried])
    _launch_deferred_last_first(graph)
    return fx.GraphModule(gm, graph)


def _tail_graph(gm: fx.GraphModule, cut: _Cut) -> fx.GraphModule:
    graph, env = fx.Graph(), dict[fx.Node, fx.Node]()
    for i, node in enumerate(cut.carried):
        env[node] = graph.placeholder(f"carried_{i}")
        env[node].meta = dict(node.meta)
    nodes = list(gm.graph.nodes)
    for node in nodes[:-1]:
        if node in cut.tail:
            env[node] = graph.node_copy(node, env.__getitem__)
    outputs = list(nodes[-1].args[0])
    graph.output([env[outputs[i]] for i in cut.deferred])
    return fx.GraphModule(gm, graph)


def _mapped(value: Any, env: dict[fx.Node, fx.Node]) -> Any:
    return env[value] if isinstance(value, fx.Node) else value


def _launch_deferred_last_first(graph: fx.Graph) -> None:
    """Launch the collectives nothing here waits for after all the others, last first.

    They carry the first layers' gradients, produced last by the backward pass and needed
    first by the next forward: in reverse order each arrives in the order that forward needs
    them, which then runs layer by layer while the rest are still on the wire.
    """
    launches = [n for n in graph.nodes if is_collective(n)]
    deferred = [n for n in launches if not any(is_wait(u) for u in n.users)]
    after = launches[-1]
    for launch in reversed(deferred):
        if launch is not after:
            after.append(launch)
            after = launch


@dataclasses.dataclass(eq=False)
class Stage:
    """A program that runs a head now and leaves a tail: the first call's, or a merged one."""

    head: Callable[[list], list]
    tail: Callable[[list], list]
    tail_source: fx.GraphModule  # the tail before reinplacing, for merging into the next call
    head_graph: fx.GraphModule
    ready: list[int]
    deferred: list[int]
    like: list[torch.Tensor]  # per deferred output, its traced value (shape, strides, dtype)
    owned: list[bool]  # per carried value: the tail may write it
    key: tuple  # what a merged program that consumes this tail depends on

    def run(self, inputs: list, owner: object, where: str) -> list:
        values = self.head(inputs)
        ready, carried = values[: len(self.ready)], values[len(self.ready) :]
        deferred = Deferred(self.tail, carried, (owner, self), where)
        results: list[Any] = [None] * (len(self.ready) + len(self.deferred))
        for i, v in zip(self.ready, ready):
            results[i] = v
        for k, i in enumerate(self.deferred):
            results[i] = PendingTensor(self.like[k], deferred, k)
        return results


def build_stage(gm: fx.GraphModule, donated: list[bool], role: dict[fx.Node, str]) -> Stage | None:
    """Cut ``gm`` (scheduled, not reinplaced) into a runnable head and tail; None if no wait
    can be deferred. ``role`` names each node by the step value it stands for, so that the
    carried values of every program cut from the same step come in the same order."""
    cut = _cut(gm, donated, role)
    if cut is None:
        return None
    head = _head_graph(gm, cut)
    placeholders = [n for n in head.graph.nodes if n.op == "placeholder"]
    _reinplace.reinplace(head.graph, {n for n, d in zip(placeholders, donated) if d})
    tail = _tail_graph(gm, cut)
    tail_placeholders = [n for n in tail.graph.nodes if n.op == "placeholder"]
    _reinplace.reinplace(tail.graph, {n for n, o in zip(tail_placeholders, cut.owned) if o})
    outputs = list(list(gm.graph.nodes)[-1].args[0])
    return Stage(
        head=_backend.fx_runner(head),
        tail=_backend.fx_runner(tail),
        tail_source=_tail_graph(gm, cut),
        head_graph=head,
        ready=cut.ready,
        deferred=cut.deferred,
        like=[outputs[i].meta["val"] for i in cut.deferred],
        owned=cut.owned,
        key=(tuple(role[c] for c in cut.carried), tuple(cut.owned)),
    )


def merge(
    tail: fx.GraphModule, step: fx.GraphModule, feed: dict[int, int], emit: list[int]
) -> tuple[fx.GraphModule, dict[fx.Node, str]]:
    """The program that runs ``tail`` and then ``step``, where ``step``'s placeholder ``i`` is
    ``tail``'s output ``feed[i]``; it returns ``step``'s outputs and then ``tail``'s outputs
    ``emit``. Each tail node is sunk to just before its first use. Also returns each node's
    role (see :func:`build_stage`)."""
    graph = fx.Graph()
    tail_env: dict[fx.Node, fx.Node] = {}
    step_env: dict[fx.Node, fx.Node] = {}
    role: dict[fx.Node, str] = {}
    tail_nodes = list(tail.graph.nodes)
    step_nodes = list(step.graph.nodes)
    step_placeholders = [n for n in step_nodes if n.op == "placeholder"]
    order = {n.name: f"{i:08d}" for i, n in enumerate(step_nodes)}
    for node in tail_nodes:
        if node.op == "placeholder":
            tail_env[node] = graph.node_copy(node)
    for i, node in enumerate(step_placeholders):
        if i not in feed:
            step_env[node] = graph.node_copy(node)
            role[step_env[node]] = order[node.name]
    moved = []
    for node in tail_nodes[:-1]:
        if node.op != "placeholder":
            tail_env[node] = graph.node_copy(node, tail_env.__getitem__)
            moved.append(tail_env[node])
    tail_outputs = [tail_env[x] for x in tail_nodes[-1].args[0]]
    for i, t in feed.items():
        step_env[step_placeholders[i]] = tail_outputs[t]
        role.setdefault(tail_outputs[t], order[step_placeholders[i].name])
    for node in step_nodes[:-1]:
        if node.op != "placeholder":
            step_env[node] = graph.node_copy(node, step_env.__getitem__)
            role[step_env[node]] = order[node.name]
    step_outputs = [_mapped(x, step_env) for x in step_nodes[-1].args[0]]
    graph.output(step_outputs + [tail_outputs[j] for j in emit])
    _sink(graph, moved)
    for node in graph.nodes:
        role.setdefault(node, "~" + node.name)  # tail intermediates are never carried twice
    merged = fx.GraphModule(step, graph)
    _propagate_fake_values(merged)
    return merged, role


def _sink(graph: fx.Graph, moved: list[fx.Node]) -> None:
    """Move each of ``moved`` (in reverse) to just before its first user."""
    pos = {n: float(i) for i, n in enumerate(graph.nodes)}
    for node in reversed(moved):
        first = min(node.users, key=pos.__getitem__)
        before = first.prev
        if before is node:
            continue
        first.prepend(node)
        pos[node] = (pos[before] + pos[first]) / 2
        if not pos[before] < pos[node] < pos[first]:
            pos = {n: float(i) for i, n in enumerate(graph.nodes)}


def _propagate_fake_values(gm: fx.GraphModule) -> None:
    """Fresh fake values for every node: the tail's copies must not share storages with the
    step's own nodes they were copied from (reinplacing reads aliasing from them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    with mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = node.meta["val"]
                inputs.append(
                    torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                )
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class AcrossSteps:
    """Runs a step whose deferred tail completes in the next call (or when touched).

    ``step`` is the scheduled graph before reinplacing; ``donated[i]`` says whether its
    placeholder ``i`` may be overwritten. :attr:`active` is False when no wait can be deferred.
    """

    def __init__(
        self,
        step: fx.GraphModule,
        donated: list[bool],
        cache_size: int = 4,
    ) -> None:
        self.where = "the data_parallel step"
        self._step = copy_graph(step)
        self._donated = donated
        self._cache_size = cache_size
        order = {n: f"{i:08d}" for i, n in enumerate(self._step.graph.nodes)}
        self._first = build_stage(self._step, donated, order)
        self._merged: dict[tuple, Stage] = {}
        self.merged_builds = 0

    @property
    def active(self) -> bool:
        return self._first is not None

    def __call__(self, inputs: list) -> list:
        assert self._first is not None
        complete_orphans()
        results = self._deferred_call(inputs)
        if results is None:
            results = self._first.run([_finished(x) for x in inputs], self, self.where)
        return results

    def _deferred_call(self, inputs: list) -> list | None:
        """The merged program's results when ``inputs`` hold this step's pending outputs."""
        live = {i: x for i, x in enumerate(inputs) if _pending_here(x, self)}
        sources = {id(x._deferred): x._deferred for x in live.values()}
        if len(sources) != 1:
            return None
        (deferred,) = sources.values()
        with deferred.lock:
            return None if deferred.done else self._merged_call(inputs, live, deferred)

    def describe(self) -> str:
        """One line for the schedule: what is deferred."""
        assert self._first is not None
        launches = [n for n in self._first.head_graph.graph.nodes if is_collective(n)]
        later = [n for n in launches if not any(is_wait(u) for u in n.users)]
        mib = sum(map(nbytes, later)) / 2**20
        total = sum(map(nbytes, launches)) / 2**20
        return (
            f"overlap across steps: the last {len(later)} of {len(launches)} collectives "
            f"({mib:.2f} of {total:.2f} MiB) launched last-first, their waits and updates in "
            "the next call"
        )

    def _merged_call(
        self, inputs: list, live: dict[int, PendingTensor], deferred: Deferred
    ) -> list:
        producer = deferred.key[1]
        assert deferred.carried is not None
        feed = {i: x._index for i, x in live.items()}
        kept = {x._index for i, x in live.items() if not self._donated[i]}
        emit = [k for k in range(len(producer.deferred)) if k in kept or k not in feed.values()]
        key = (producer.key, tuple(sorted(feed.items())), tuple(emit))
        stage = self._merged.get(key)
        if stage is None:
            stage = self._build_merged(producer, feed, emit)
            self._merged[key] = stage
            while len(self._merged) > self._cache_size:
                self._merged.pop(next(iter(self._merged)))
        rest = [_finished(x) for i, x in enumerate(inputs) if i not in feed]
        with deferred.consuming():
            results = stage.run(deferred.carried + rest, self, self.where)
        count = len(results) - len(emit)
        finished: list[Any] = [_DONATED] * len(producer.deferred)
        for j, k in enumerate(emit):
            finished[k] = results[count + j]
        deferred.finish(finished)
        return results[:count]

    def _build_merged(self, producer: Stage, feed: dict[int, int], emit: list[int]) -> Stage:
        merged, role = merge(producer.tail_source, self._step, feed, emit)
        kept = [d for i, d in enumerate(self._donated) if i not in feed]
        stage = build_stage(merged, producer.owned + kept, role)
        assert stage is not None  # the step's own deferrable waits are deferrable here too
        self.merged_builds += 1
        return stage


def _pending_here(x: Any, runner: AcrossSteps) -> bool:
    """A pending output of ``runner`` whose tail has not run."""
    if not isinstance(x, PendingTensor) or x._deferred.done:
        return False
    return x._deferred.key[0] is runner
