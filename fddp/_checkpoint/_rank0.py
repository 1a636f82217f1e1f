"""A ``rank0_only`` save on every rank: all arrive, agree on per-rank values, rank 0 writes."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from fddp._base._errors import SaveArrivalError, UsageValueError
from fddp._base._types import TensorTree
from fddp._checkpoint import _format, _like
from fddp._ranks import _agree, _digests, _runtime

__all__ = ["save_from_rank0"]

# How long rank 0 waits for the other ranks to enter a rank0_only save before it calls the save
# a mistake (`if rank == 0: fddp.save(...)`); independent of the, much longer, collective timeout.
_ARRIVAL_TIMEOUT_S = 10.0
# A method that returns True: a tree holding an instance of the class holds values saved beside
# it that differ per rank (fddp.LowCommState: the inner parameters between synchronizations).
_PER_RANK_MARK = "saved_with_per_rank_values"
_WHERE = "fddp.save"

_saves = 0  # rank0_only saves this process has entered: each one's keys in the store
_saves_lock = threading.Lock()


def save_from_rank0(
    path: str, payload: dict[str, Any], tree: TensorTree, paths: list[str], leaves: list[Any]
) -> None:
    """Write ``payload`` (of ``tree``, flattened to ``paths`` and ``leaves``) from rank 0, on
    every rank: the call returns on every rank once the file is in place, and an error on
    rank 0 is raised on every rank."""
    global _saves
    with _saves_lock:  # one save at a time, so that every rank numbers them alike
        number, _saves = _saves, _saves + 1
        with _runtime.peer_failures(_WHERE):
            _save(path, payload, number, tree, _replica_lines(tree, paths, leaves))


def _save(
    path: str, payload: dict[str, Any], number: int, tree: TensorTree, lines: list[_agree.Line]
) -> None:
    _check_arrival(path, number)
    # Every rank is in this save: a group that already failed (a peer died or timed out
    # earlier) fails here at once, before rank 0 replaces the file.
    dist.barrier()
    if dist.get_rank() == 0:  # every rank has read the verdict of _check_arrival
        _forget(number)
    difference = _agree.find_difference(lines)
    if difference is not None:
        raise _per_rank_values_error(path, tree, difference)
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            _format.write(path, payload)
        except BaseException as e:  # raised on every rank, once all know
            error = e
    # Doubles as the barrier: no rank returns before rank 0 has finished.
    _agree.raise_everywhere(
        error,
        peer=lambda e, r: RuntimeError(f"rank {r} failed to save checkpoint {path}: {e}"),
    )


def _check_arrival(path: str, number: int) -> None:
    """Make sure every rank has entered this save, through the process group's store.

    Each rank other than 0 sets a key and waits (up to the store's timeout: rank 0 may come
    late, e.g. after evaluating alone) for rank 0's verdict. Rank 0 waits only
    ``_ARRIVAL_TIMEOUT_S`` for those keys: a rank missing then most likely skipped ``save``
    (``if rank == 0: fddp.save(...)``) and is blocked in its next collective, where waiting
    the full collective timeout would only end in misleading errors on both ranks. No
    collective is started before every rank is known to be here, so a rank that gives up
    leaves the group usable. Without a store (a group made without one), nothing is checked.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"fddp/save/{number}/"
    arrived = [f"{prefix}arrived/{r}" for r in range(1, world)]
    if rank != 0:
        store.set(arrived[rank - 1], "1")
        store.wait([f"{prefix}verdict"], store.timeout)  # type: ignore[attr-defined]
        verdict = store.get(f"{prefix}verdict").decode()
        if verdict != "go":
            raise SaveArrivalError(
                f"fddp.save({path!r}) on rank {rank}: rank 0 stopped waiting before this rank "
                f"came: {verdict}"
            )
        return
    timeout = store.timeout  # type: ignore[attr-defined]  # a property torch's stub lacks
    wait_s = min(_ARRIVAL_TIMEOUT_S, timeout.total_seconds())
    deadline, pause = time.monotonic() + wait_s, 0.001
    # Polled: a store.wait that times out logs socket warnings from C++.
    while not store.check(arrived) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    missing = [r for r, key in enumerate(arrived, start=1) if not store.check([key])]
    if missing:
        ranks = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        message = (
            f"{ranks} did not call fddp.save within {wait_s:g} s of rank 0. With "
            "rank0_only=True (the default) every rank calls fddp.save with the same arguments: "
            "rank 0 writes the file and the others wait until it is in place. Call it on every "
            "rank, not under `if rank == 0:`; to write from one rank alone pass "
            f"rank0_only=False. (If {ranks} did call fddp.save, it came later or has died or "
            "hung: see its own log.) Nothing was written."
        )
        store.set(f"{prefix}verdict", message)
        raise SaveArrivalError(f"fddp.save({path!r}) on rank 0: {message}")
    store.set(f"{prefix}verdict", "go")
    for key in arrived:
        store.delete_key(key)


def _forget(number: int) -> None:
    """Delete the last key of save ``number`` from the store, once every rank has read it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    store.delete_key(f"fddp/save/{number}/verdict")


def _marked(x: Any) -> bool:
    mark = getattr(x, _PER_RANK_MARK, None)
    return callable(mark) and mark() is True


def _replica_lines(tree: TensorTree, paths: list[str], leaves: list[Any]) -> list[_agree.Line]:
    """What a ``rank0_only`` save compares across ranks: whether the tree holds a marked state
    (see ``_PER_RANK_MARK``) and, if it does, a digest of every leaf's value."""
    marked = _like.found(tree, _marked)
    lines: list[_agree.Line] = [("a state with per-rank values beside it", marked or "none")]
    if marked:
        lines += _digests.leaf_lines(paths, leaves)
    return lines


def _per_rank_values_error(
    path: str, tree: TensorTree, difference: _agree.Difference
) -> UsageValueError:
    return UsageValueError(
        f"fddp.save({path!r}): {difference}. The tree holds {_like.found(tree, _marked)}, beside "
        "which values are per-rank (a low-communication step's inner parameters and optimizer "
        "state between synchronizations), and rank0_only=True (the default) would write rank "
        "0's values only, which every rank would then load. Save each rank's own file: "
        'fddp.save(f"ckpt-{fddp.rank()}", tree, rank0_only=False), each rank loading its own; '
        "or save only what is the same on every rank (the LowCommState: its params are the "
        "last synchronized ones), e.g. right after a synchronization (without fragments, when "
        "int(state.step) % step.every == 0). Nothing was written."
    )
