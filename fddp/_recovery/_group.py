"""A generation's process group: formed from the store under its own prefix, abandoned at once."""

from __future__ import annotations

import datetime
import gc

import torch.distributed as dist

from fddp._ranks import _runtime


def form(
    store: dist.Store,
    prefix: str,
    generation: int,
    members: tuple[int, ...],
    uid: int,
    backend: str,
    timeout: float,
    compile_timeout: float,
) -> None:
    """Join generation ``generation``'s default group (``members`` in rank order) under the
    store prefix ``{prefix}/g{generation}/pg``: a fresh prefix, so that no address a member of
    an earlier generation published is read again. Forming it waits ``timeout`` for the
    members; its collectives then wait ``compile_timeout`` until :func:`set_timeout`."""
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{prefix}/g{generation}/pg", store),
        rank=members.index(uid),
        world_size=len(members),
        timeout=datetime.timedelta(seconds=timeout),
    )
    _runtime.ensure_group()
    set_timeout(compile_timeout)


def set_timeout(seconds: float) -> None:
    """How long the default group's collectives wait for a peer from now on (kept where this
    torch cannot change it)."""
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_pg_timeout is not None:
        set_pg_timeout(datetime.timedelta(seconds=seconds))


def abandon() -> None:
    """Abort every process group of this process and forget them: their links close, so a
    peer still waiting in a collective on one of them fails at once instead of at its timeout
    (``destroy_process_group`` alone leaves the links open while anything, such as the default
    arguments of ``torch.distributed.nn.functional``, still holds the group)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        dist.destroy_process_group()
    else:
        abort()
    gc.collect()  # the last reference to a gloo group closes its links
