"""Predicted step time from the captured graph, for the bucket policy's cost model.

The prediction replays the graph in order: each node costs its dispatch plus its FLOPs (torch's
flop counter, on the recorded fake values) or its memory traffic, a bucket's all-reduce starts
when its last gradient is ready and the wire is free, and a node that needs a reduced gradient
waits for it. The machine's figures come measured from the runtime (``fddp._machine``).
"""

from __future__ import annotations

import optree
import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fddp._bucket_policy import Predict
from fddp._machine import Machine
from fddp._schedule import _bucket
from fddp._schedule._graph import is_collective, is_view, is_wait

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


def node_seconds(graph: fx.Graph, machine: Machine) -> list[float]:
    """Predicted seconds of each node of ``graph``, in graph order."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or is_collective(node) or is_wait(node):
            out.append(0.0)  # the bucketed collectives are counted by ``predict``
            continue
        seconds = machine.seconds_per_node
        if not is_view(node):
            flops = _flops(node)
            if flops is not None:
                seconds += flops * machine.seconds_per_flop
            else:
                moved = sum(map(_tensor_bytes, node.all_input_nodes)) + _tensor_bytes(node)
                seconds += moved * machine.seconds_per_byte_moved
        out.append(seconds)
    return out


def predict(seconds: list[float], buckets: list[list[_bucket.Member]], machine: Machine) -> float:
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
    seconds = node_seconds(graph, machine)
    return lambda cap: predict(seconds, _bucket.assign(members, cap, first_cap), machine)
