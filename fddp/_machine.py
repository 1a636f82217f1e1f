"""What this machine's link and compute cost: measured once per process group, the same on every
rank (rank 0's figures, broadcast), for the cost model that chooses bucket sizes.

The link is timed with the best of a few all-reduces of a small and of a large buffer (a latency
and a time per byte); the compute with a matmul, a large elementwise op and many tiny ops. The
probe fills its tensors with constants, so measuring draws nothing from the user's RNG.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

_PROBE_BYTES = (64 * 2**10, 4 * 2**20)
_PROBE_WARMUP = 3
_PROBE_REPEATS = 7


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
    return line_through(*fastest)


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
    world size, a malformed row) are skipped."""
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
            device, figures = torch.device(row[0]), [float(x) for x in row[2:]]
        except (RuntimeError, TypeError, ValueError):
            continue
        if device not in per_device:
            per_device[device] = Machine(*figures)
            _restored.setdefault(key, set()).add(device)


def restored(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether the figures for ``group`` and ``device`` came from a checkpoint (:func:`restore`)."""
    key = _key(group)
    return key is not None and device in _restored.get(key, ())
