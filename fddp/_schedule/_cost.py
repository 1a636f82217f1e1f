"""The default bucket cap, chosen from a cost model of this machine and this step.

Measured once per process group, at the first compile of a step on it: the link (the best of
a few all-reduces of a small and of a large buffer give a latency and a time per byte) and the
compute (a matmul, a large elementwise op, many tiny ops). Rank 0's figures are broadcast, so
every rank predicts the same times and picks the same cap. The prediction replays the captured
graph in order: each node costs its dispatch plus its FLOPs or its memory traffic, a bucket's
all-reduce starts when its last gradient is ready and the wire is free, and a node that needs a
reduced gradient waits for it.

The rule of thumb is a sixteenth of the gradient bytes, but no bucket smaller than five
latencies' worth of transfer. The predictions override it only where they differ by more than
the model's resolution (5 %): then the cap nearest the rule of thumb among the fastest wins.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from collections.abc import Callable

import optree
import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import flop_registry

from fddp._schedule import _bucket
from fddp._schedule._graph import is_collective, is_view, is_wait

MIB = 2**20
_CANDIDATE_CAPS = tuple(int(m * MIB) for m in (0.25, 0.5, 1, 2, 4, 8, 16, 25))
_PROBE_BYTES = (64 * 2**10, 4 * MIB)
_PROBE_WARMUP = 3
_PROBE_REPEATS = 7
_RESOLUTION = 0.05  # predictions closer than this are not told apart
_LATENCIES_PER_BUCKET = 5  # the rule of thumb's smallest bucket transfers this long
_NODES_PER_BUCKET = 6  # empty, launch, wait, split and views that each bucket adds


@dataclasses.dataclass(frozen=True)
class Machine:
    """Rank 0's measurements, the same on every rank."""

    latency: float  # seconds per all-reduce, whatever its size
    seconds_per_byte: float  # all-reduce time per byte of the buffer
    seconds_per_flop: float
    seconds_per_byte_moved: float  # a memory-bound op, per byte read or written
    seconds_per_node: float  # dispatching one small op

    def __str__(self) -> str:
        return (
            f"all-reduce {self.latency * 1e6:.0f} us + {1 / self.seconds_per_byte / 1e9:.2f} GB/s, "
            f"compute {1 / self.seconds_per_flop / 1e9:.1f} GFLOP/s, "
            f"{1 / self.seconds_per_byte_moved / 1e9:.1f} GB/s, "
            f"{self.seconds_per_node * 1e6:.1f} us/op"
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _link(group: dist.ProcessGroup | None, device: torch.device) -> tuple[float, float]:
    """Latency and seconds per byte of an all-reduce: the line through the best times of a small
    and a large one."""
    fastest = []
    for size in _PROBE_BYTES:
        buffer = torch.zeros(size // 4, device=device)
        for _ in range(_PROBE_WARMUP):  # connections, buffers, and the ranks in step
            dist.all_reduce(buffer, group=group)
        reduce = functools.partial(dist.all_reduce, buffer, group=group)
        fastest.append(_best_seconds(reduce, device, _PROBE_REPEATS))
    small, large = _PROBE_BYTES
    per_byte = max((fastest[1] - fastest[0]) / (large - small), 1e-13)
    return max(fastest[0] - per_byte * small, 0.0), per_byte


def _compute(device: torch.device) -> tuple[float, float, float]:
    n = 384 if device.type == "cpu" else 4096  # an accelerator's launch would hide a small one
    a = torch.full((n, n), 0.5, device=device)  # not randn: the user's RNG stays untouched
    flop = _best_seconds(lambda: a @ a, device, 5) / (2 * n**3)
    big = torch.full((2**21,), 0.5, device=device)
    moved = _best_seconds(lambda: big + big, device, 5) / (3 * big.numel() * 4)
    tiny = torch.zeros(8, device=device)
    ops = 200

    def many_tiny() -> None:
        for _ in range(ops):
            tiny.add(tiny)

    per_node = _best_seconds(many_tiny, device, 3) / ops
    return flop, moved, per_node


def measure(group: dist.ProcessGroup | None, device: torch.device) -> Machine:
    """Time the link and the compute; collective: every rank of ``group`` calls it."""
    latency, per_byte = _link(group, device)
    flop, moved, per_node = _compute(device)
    figures = torch.tensor([latency, per_byte, flop, moved, per_node], dtype=torch.float64)
    figures = figures.to(device)
    dist.broadcast(figures, group=group, group_src=0)
    return Machine(*(float(x) for x in figures.cpu()))


_measured: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[torch.device, Machine]] = (
    weakref.WeakKeyDictionary()
)


def measured(group: dist.ProcessGroup | None, device: torch.device) -> Machine:
    """:func:`measure` once per process group and device (collective the first time)."""
    key = group if group is not None else dist.group.WORLD
    assert key is not None  # the caller checked that there are several ranks
    per_device = _measured.setdefault(key, {})
    if device not in per_device:
        per_device[device] = measure(group, device)
    return per_device[device]


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


@dataclasses.dataclass(frozen=True)
class Choice:
    cap: int
    preferred: int  # the rule-of-thumb cap the model had to beat
    predicted: dict[int, float]  # cap -> predicted seconds
    machine: Machine

    def __str__(self) -> str:
        fastest = min(self.predicted.values())
        table = ", ".join(
            f"{cap / MIB:.4g} MiB {seconds / fastest:.3f}"
            for cap, seconds in sorted(self.predicted.items())
        )
        return (
            f"bucket cap {self.cap / MIB:.3g} MiB, chosen by the cost model from {self.machine} "
            f"(predicted step {self.predicted[self.cap] * 1e3:.1f} ms; relative to the fastest: "
            f"{table}; rule of thumb {self.preferred / MIB:.3g} MiB)"
        )


def preferred_cap(members: list[_bucket.Member], first_cap: int, machine: Machine) -> int:
    """A sixteenth of the gradient bytes (``_bucket.auto_cap``), but no smaller than a bucket
    whose transfer takes five times the link's latency."""
    floor = _LATENCIES_PER_BUCKET * machine.latency / machine.seconds_per_byte
    return min(_bucket.DDP_CAP_BYTES, max(_bucket.auto_cap(members, first_cap), int(floor)))


def candidate_caps(members: list[_bucket.Member], first_cap: int) -> list[int]:
    """The caps worth predicting: up to the one that puts everything after the first bucket
    in one bucket."""
    total = _bucket.total_bytes(members)
    caps = {max(first_cap, c) for c in _CANDIDATE_CAPS if c < total}
    caps.add(max(first_cap, min(total, _bucket.DDP_CAP_BYTES)))
    return sorted(caps)


def choose_cap(
    graph: fx.Graph, members: list[_bucket.Member], first_cap: int, machine: Machine
) -> Choice:
    """The rule-of-thumb cap unless the model predicts another to be faster by more than its
    resolution; then, of the caps within that resolution of the fastest, the one nearest the
    rule of thumb."""
    seconds = node_seconds(graph, machine)
    preferred = preferred_cap(members, first_cap, machine)
    predicted = {
        cap: predict(seconds, _bucket.assign(members, cap, first_cap), machine)
        for cap in sorted({*candidate_caps(members, first_cap), preferred})
    }
    fastest = min(predicted.values())
    near = [c for c, s in predicted.items() if s <= fastest * (1 + _RESOLUTION)]
    cap = min(near, key=lambda c: abs(math.log(c / preferred)))
    return Choice(cap, preferred, predicted, machine)
