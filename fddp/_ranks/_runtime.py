"""Process-group runtime: init, rank and world size, replicate and shard."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base._errors import RankFailureError
from fddp._base._tree import leaves_with_paths, pack_bytes, unpack_bytes
from fddp._ranks import _shutdown
from fddp._ranks._agree import find_difference

logger = logging.getLogger("fddp")

DEFAULT_TIMEOUT_S = 300.0
_timeout_s: float | None = None  # set by init(); None when the user made the group
_joined = False  # a default group existed: after it is destroyed, only init() makes another
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(*, timeout: float | datetime.timedelta | None = None, backend: str | None = None) -> None:
    """Join the default process group; idempotent.

    Under ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``) this creates the default group from the environment: gloo on CPU, and
    ``cpu:gloo,cuda:nccl`` when every local rank has a CUDA device. With no launcher it makes a
    world of one, so a script written for many ranks runs with plain ``python``.

    Called again, or after the group was made by an earlier implicit call (``fddp.rank()``,
    a first step) or by ``torch.distributed.init_process_group``, an explicit ``timeout`` is
    applied to the existing group. After ``torch.distributed.destroy_process_group()``, only an
    explicit ``fddp.init()`` makes a new group; anything else raises instead of silently
    joining a new one.

    Args:
        timeout: seconds (or a timedelta) after which a collective that waits on a dead or stuck
            rank raises instead of hanging. Defaults to 300 s.
        backend: override the backend string passed to ``init_process_group``.

    >>> import fddp
    >>> fddp.init()
    >>> fddp.world_size() >= 1
    True
    """
    _join(timeout, backend, explicit=True)


def _join(
    timeout: float | datetime.timedelta | None, backend: str | None, *, explicit: bool
) -> None:
    global _timeout_s, _joined
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if dist.is_initialized():
        _joined = True
        _shutdown.register()  # a group made by dist.init_process_group needs the handler too
        if timeout is not None:
            _set_timeout(timeout)
        return
    if _joined and not explicit:
        raise RuntimeError(
            "the default process group was destroyed (torch.distributed.destroy_process_group()) "
            "and fddp will not silently join a new one. Call fddp.init() again to make a new "
            "group before calling fddp functions or steps, or stop using them after destroying it."
        )
    timeout = timeout or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    _timeout_s = timeout.total_seconds()
    launched = all(v in os.environ for v in _LAUNCHER_VARS)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if launched:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _joined = True
    _shutdown.register()
    log_rank0(
        "fddp.init: world of %d, backend %s, timeout %.0f s",
        dist.get_world_size(),
        backend,
        timeout.total_seconds(),
    )


def _set_timeout(timeout: datetime.timedelta) -> None:
    """Apply ``timeout`` to the existing default group (a private torch API since 2.2)."""
    global _timeout_s
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_pg_timeout is None:
        raise RuntimeError(
            f"fddp.init(timeout={timeout.total_seconds():g}): the process group already exists "
            "and this torch cannot change its timeout. Call fddp.init(timeout=...) before "
            "anything else that uses the group (fddp.rank(), fddp.shard(), a first step)."
        )
    set_pg_timeout(timeout)
    _timeout_s = timeout.total_seconds()


def ensure_group() -> None:
    """Make sure the default group exists (joining it as :func:`init` would with defaults)."""
    if not dist.is_initialized():
        _join(None, None, explicit=False)


_side_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A second gloo group of ``group``'s ranks, one per group for the whole process, for small
    checks that must not queue behind collectives in flight on ``group``. Collective the first
    time: every rank of ``group`` calls it at the same point."""
    parent = group if group is not None else dist.group.WORLD
    assert parent is not None  # ensure_group() made the default group
    if parent not in _side_groups:
        ranks = dist.get_process_group_ranks(parent)
        _side_groups[parent] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _side_groups[parent]


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure to hear from another rank (gloo or NCCL)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text
        for s in ("gloo/transport", "Connection closed", "Connection reset", "NCCL", "pair closure")
    )


@contextlib.contextmanager
def peer_failures(where: str | Callable[[], str], start: float | None = None) -> Iterator[None]:
    """Within the block, a collective's failure to hear from another rank (see
    :func:`is_peer_failure`) is raised as :func:`peer_failure` of ``where`` (a callable: asked
    when it fails), timed from ``start`` (default: the block's start)."""
    start = time.monotonic() if start is None else start
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, RankFailureError) or not is_peer_failure(e):
            raise
        named = where() if callable(where) else where
        raise peer_failure(e, named, time.monotonic() - start) from e


def peer_failure(error: BaseException, where: str, seconds: float) -> RankFailureError:
    """A :class:`RankFailureError` that says what to do, to raise ``from error``."""
    timeout = f"{_timeout_s:g} s" if _timeout_s is not None else "the process group's timeout"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return RankFailureError(
        f"{where}: a collective failed on rank {dist.get_rank()} after {seconds:.1f} s: "
        f"{first_line}\nAnother rank has died (seen at once) or is stuck (seen after {timeout}, "
        "set with fddp.init(timeout=...)). Its own log holds the cause: under torchrun, the "
        "'Root Cause' section. If no rank failed, one of them spent longer than the timeout "
        "between two collectives (evaluation or checkpointing on rank 0 only, a slow first "
        "capture): raise the timeout. To go on, restart from the last checkpoint "
        "(examples/elastic.py shows how)."
    )


def log_rank0(message: str, *args: object) -> None:
    """Log at INFO on the ``fddp`` logger, from rank 0 only (quiet unless INFO is enabled)."""
    if logger.isEnabledFor(logging.INFO) and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(message, *args)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); calls :func:`init` if needed.

    >>> import fddp
    >>> fddp.rank()
    0
    """
    ensure_group()
    return dist.get_rank(group)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world); calls :func:`init` if needed.

    >>> import fddp
    >>> fddp.world_size()
    1
    """
    ensure_group()
    return dist.get_world_size(group)


def local_device() -> torch.device:
    """The device this rank computes on: its CUDA device under nccl, else the CPU."""
    ensure_group()
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def step_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where a step computes: its first floating-point argument's device, else this rank's."""
    device = next((t.device for t in tensors if t.is_floating_point()), None)
    return device or local_device()


def replicate(tree: Any, src: int = 0, *, group: dist.ProcessGroup | None = None) -> Any:
    """Return ``tree`` with every leaf equal to rank ``src``'s value, on every rank.

    ``src`` is a rank within ``group`` (default: the world), as in :func:`fddp.broadcast`.

    Tensor leaves travel in one coalesced broadcast per device (packed as bytes, so mixed dtypes
    share it); other leaves (ints, strings) are taken from ``src`` too. The tree structure and
    the tensor shapes and dtypes must be the same on every rank; if not, every rank raises a
    ``ValueError`` naming the ranks and the first difference. The input is not modified.

    >>> import fddp, torch
    >>> params = fddp.replicate({"w": torch.ones(2)})
    >>> params["w"]
    tensor([1., 1.])
    """
    n = world_size(group)
    if not 0 <= src < n:
        raise ValueError(f"replicate: src={src} is not a rank of the group, which has {n} ranks.")
    if n == 1:
        return tree
    paths, leaves, spec = leaves_with_paths(tree)
    layout = [
        (f"leaf {p}", f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else "a value")
        for p, x in zip(paths, leaves)
    ] + [("the tree structure", str(spec))]
    difference = find_difference(layout, group)
    if difference is not None:
        raise ValueError(
            f"fddp.replicate: the tree differs between ranks ({difference}). Build the same "
            "parameter tree on every rank (same model code and config) before replicating it."
        )
    out: list[Any] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    if any(not isinstance(x, torch.Tensor) for x in leaves):  # the same on every rank
        dist.broadcast_object_list(out, group=group, group_src=src)
    by_device: dict[torch.device, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            by_device.setdefault(leaf.device, []).append(i)
    for device, idx in by_device.items():
        flat = pack_bytes([leaves[i] for i in idx]).to(device)
        dist.broadcast(flat, group=group, group_src=src)
        for i, t in zip(idx, unpack_bytes(flat, [leaves[i] for i in idx])):
            out[i] = t
    return optree.tree_unflatten(spec, out)
