"""What this machine's link and compute cost, measured once per process group for every rank."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

_PROBE_BYTES = (4 * 2**10, 96 * 2**10)
_PROBE_WARMUP = (5, 1)  # the first all-reduces set up connections and put the ranks in step
_PROBE_REPEATS = (15, 3)


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


# The figures a cost estimate takes where none were measured (remat's memory budget weighs what a
# recompute costs before the link is timed): 100 GFLOP/s, 10 GB/s of memory traffic and 2 us a
# dispatch (about one CPU core), and a 1 GB/s link.
DEFAULT = Machine(
    latency=50e-6,
    seconds_per_byte=1e-9,
    seconds_per_flop=1e-11,
    seconds_per_byte_moved=1e-10,
    seconds_per_node=2e-6,
)

# What a real link or processor can take, in seconds: a figure outside its range (zero, negative,
# not finite, absurd) would divide by zero or overflow in the cost model.
_BOUNDS = {
    "latency": (0.0, 60.0),
    "seconds_per_byte": (1e-15, 1e-3),  # 1 PB/s to 1 kB/s
    "seconds_per_flop": (1e-18, 1e-3),
    "seconds_per_byte_moved": (1e-15, 1e-3),
    "seconds_per_node": (1e-10, 1.0),
}


def invalid_figure(machine: Machine) -> str | None:
    """The first figure of ``machine`` that no machine can have, as ``name=value``; None if
    all are sane."""
    for name, (low, high) in _BOUNDS.items():
        value = getattr(machine, name)
        if not (math.isfinite(value) and low <= value <= high):
            return f"{name}={value!r}"
    return None


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
    for size, warmup, repeats in zip(_PROBE_BYTES, _PROBE_WARMUP, _PROBE_REPEATS):
        buffer = torch.zeros(size // 4, device=device)
        for _ in range(warmup):
            dist.all_reduce(buffer, group=group)
        reduce = functools.partial(dist.all_reduce, buffer, group=group)
        fastest.append(_best_seconds(reduce, device, repeats))
    return line_through(*fastest)


def probe_bytes() -> int:
    """The bytes each rank all-reduces to measure the link."""
    return sum(
        size * (warmup + repeats)
        for size, warmup, repeats in zip(_PROBE_BYTES, _PROBE_WARMUP, _PROBE_REPEATS)
    )


def line_through(small_seconds: float, large_seconds: float) -> tuple[float, float]:
    """Latency and seconds per byte from the best times of the small and the large probe.

    Where noise made the large probe no slower than the small one (a loaded machine), the slope
    says nothing: the large probe's whole time is taken as transfer, the slowest link its time
    allows, instead of a link of unbounded bandwidth.
    """
    small, large = _PROBE_BYTES
    per_byte = (large_seconds - small_seconds) / (large - small)
    if per_byte <= 0:
        per_byte = large_seconds / large
    return max(small_seconds - per_byte * small, 0.0), per_byte


def _compute(device: torch.device) -> tuple[float, float, float]:
    n = 384 if device.type == "cpu" else 4096  # an accelerator's launch would hide a small one
    a = torch.full((n, n), 0.5, device=device)
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


_restored: weakref.WeakKeyDictionary[dist.ProcessGroup, set[torch.device]] = (
    weakref.WeakKeyDictionary()
)


def _key(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group the figures are kept under: ``group``, or the world for None."""
    return group if group is not None else dist.group.WORLD


def measured(group: dist.ProcessGroup | None, device: torch.device) -> Machine:
    """:func:`measure` once per process group and device (collective the first time)."""
    key = _key(group)
    assert key is not None  # the caller checked that there are several ranks
    per_device = _measured.setdefault(key, {})
    if device not in per_device:
        per_device[device] = measure(group, device)
    return per_device[device]


def recorded(group: dist.ProcessGroup | None = None) -> list[list[float | str]]:
    """The figures measured for ``group`` (default: the world) as plain values, one row
    ``[device, world size, *figures]`` per device, for a checkpoint to carry; [] if none."""
    key = _key(group)
    if not dist.is_initialized() or key is None or key not in _measured:
        return []
    world = dist.get_world_size(key)
    return [
        [str(device), world, *dataclasses.astuple(machine)]
        for device, machine in _measured[key].items()
    ]


def restore(records: object, group: dist.ProcessGroup | None = None) -> None:
    """Take figures that :func:`recorded` wrote for a group of this size where none are
    measured yet: a resumed run chooses its bucket caps as the run it resumes did, so on 3 or
    more ranks it also sums every gradient in the same order. Rows that do not fit (another
    world size, a malformed row) are skipped; rows whose figures no machine can have (zero,
    negative, not finite, absurd: a crafted or damaged manifest) are skipped with a warning,
    and the figures are measured afresh at the next compile."""
    key = _key(group)
    if not dist.is_initialized() or key is None or not isinstance(records, list):
        return
    world = dist.get_world_size(key)
    fields = len(dataclasses.fields(Machine))
    per_device = _measured.setdefault(key, {})
    for row in records:
        if not (isinstance(row, list) and len(row) == 2 + fields and row[1] == world):
            continue
        try:
            device, machine = torch.device(row[0]), Machine(*(float(x) for x in row[2:]))
        except (RuntimeError, TypeError, ValueError, OverflowError):
            continue
        bad = invalid_figure(machine)
        if bad is not None:
            warnings.warn(
                f"ignoring the link and compute figures recorded for {device}: {bad} is not "
                "a figure a machine can have (a damaged or edited checkpoint manifest); they "
                "will be measured afresh at the next compile, so the bucket caps may differ "
                "from the run that wrote the checkpoint.",
                stacklevel=3,
            )
            continue
        if device not in per_device:
            per_device[device] = machine
            _restored.setdefault(key, set()).add(device)


def restored(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether the figures for ``group`` and ``device`` came from a checkpoint (:func:`restore`)."""
    key = _key(group)
    return key is not None and device in _restored.get(key, ())
