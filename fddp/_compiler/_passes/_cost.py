"""Predicted step time from the captured graph, for the bucket policy's cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import optree
import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fddp._collectives._bucket_policy import CapPolicy, Choice, Predict
from fddp._compiler._graph import is_collective, is_view, is_wait
from fddp._compiler._passes import _bucket
from fddp._ranks._machine import Machine

_NODES_PER_BUCKET = 6  # empty, launch, wait, split and views that each bucket adds


def _fake_value(arg: fx.node.Argument) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _tensor_bytes(node: fx.Node) -> int:
    leaves = optree.tree_leaves(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _flops(node: fx.Node) -> float | None:
    """The node's FLOPs where torch's flop counter knows its op, else None."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in flop_registry:
        return None
    args, kwargs = optree.tree_map(
        _fake_value, (node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node)
    )
    try:
        return flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val"))
    except Exception:  # an overload the counter does not know
        return None


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the prediction needs of a graph, free of any machine's figures: per node whether it
    costs a dispatch, its FLOPs and the bytes it moves (the FLOPs win where both are known),
    and the all-reduces to bucket. Plain values: a program in the persistent cache keeps its
    profile, so a restarted run chooses its cap as a fresh compile would."""

    dispatched: tuple[bool, ...]
    flops: tuple[float, ...]
    moved: tuple[int, ...]
    reductions: tuple[_bucket.Reduction, ...]

    def seconds(self, machine: Machine) -> list[float]:
        """Predicted seconds of each node, in graph order."""
        return [
            _seconds(figures, machine)
            for figures in zip(self.dispatched, self.flops, self.moved, strict=True)
        ]

    def predictor(self, first_cap: int, machine: Machine) -> Predict:
        """A function from a cap to the predicted seconds of the step with that cap's buckets."""
        seconds = self.seconds(machine)
        reductions = list(self.reductions)
        return lambda cap: predict(seconds, _bucket.assign(reductions, cap, first_cap), machine)


def _figures(node: fx.Node) -> tuple[bool, float, int]:
    """Whether ``node`` costs a dispatch, its FLOPs and the bytes it moves (counted only where
    its FLOPs are unknown); collectives and waits cost nothing here (``predict`` counts the
    bucketed ones)."""
    counted = node.op == "call_function" and not is_collective(node) and not is_wait(node)
    flops = _flops(node) if counted and not is_view(node) else None
    moved = 0
    if counted and not is_view(node) and flops is None:
        moved = sum(map(_tensor_bytes, node.all_input_nodes)) + _tensor_bytes(node)
    return counted, float(flops or 0.0), moved


def _seconds(figures: tuple[bool, float, int], machine: Machine) -> float:
    dispatched, flops, moved = figures
    if not dispatched:
        return 0.0
    return (
        machine.seconds_per_node
        + flops * machine.seconds_per_flop
        + moved * machine.seconds_per_byte_moved
    )


def profile(graph: fx.Graph, members: list[_bucket.Member]) -> Profile:
    """The graph's :class:`Profile`."""
    figures = [_figures(node) for node in graph.nodes]
    return Profile(
        tuple(f[0] for f in figures),
        tuple(f[1] for f in figures),
        tuple(f[2] for f in figures),
        tuple(_bucket.Reduction.of(m) for m in members),
    )


def node_seconds(graph: fx.Graph, machine: Machine) -> list[float]:
    """Predicted seconds of each node of ``graph``, in graph order."""
    return profile(graph, []).seconds(machine)


def seconds_of(nodes: Iterable[fx.Node], machine: Machine) -> float:
    """Predicted seconds of running ``nodes``, each counted as in :func:`node_seconds`."""
    return sum(_seconds(_figures(node), machine) for node in nodes)


def predict(
    seconds: list[float], buckets: Sequence[Sequence[_bucket.Reduction]], machine: Machine
) -> float:
    """Seconds of the step when ``buckets`` are reduced: compute and wire as two queues."""
    launches: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    sizes = []
    for i, bucket in enumerate(buckets):
        launches.setdefault(max(m.ready for m in bucket), []).append(i)
        waits.setdefault(min(m.first_use for m in bucket), []).append(i)
        sizes.append(_bucket.total_bytes(bucket))
    arrival = [0.0] * len(buckets)
    now = wire_free = 0.0
    for position, cost in enumerate(seconds):
        for i in waits.get(position, ()):
            now = max(now, arrival[i])
        now += cost
        for i in launches.get(position, ()):
            now += _NODES_PER_BUCKET * machine.seconds_per_node
            wire_free = max(now, wire_free) + machine.latency + sizes[i] * machine.seconds_per_byte
            arrival[i] = wire_free
    return max(now, wire_free)


def predictor(
    graph: fx.Graph, members: list[_bucket.Member], first_cap: int, machine: Machine
) -> Predict:
    """A function from a cap to the predicted seconds of the step with that cap's buckets."""
    return profile(graph, members).predictor(first_cap, machine)


def choose_cap(
    profile: Profile, policy: CapPolicy, machine: Machine | None, agreed: int | None = None
) -> Choice:
    """The bucket cap for a graph of ``profile`` (the cost model needs a ``machine``), or the
    ``agreed`` one: the cap of the programs the persistent cache holds, which the ranks take
    from rank 0 (``fddp._compiler._cache._persistent.agreed_cap``)."""
    machine = machine if profile.reductions else None
    predict = profile.predictor(policy.first, machine) if machine else None
    choice = policy.choose(_bucket.total_bytes(profile.reductions), machine, predict)
    if agreed is None or agreed == choice.cap:
        return choice
    return Choice(
        agreed,
        "kept from the programs this step cached (fddp.set_cache_dir), which the cost model "
        "chose when they were compiled",
    )
