"""Clean process exit after fddp.init(): stop gloo's worker threads before the interpreter does."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
import types
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger("fddp")

# Why exit could abort (torch 2.13 CPU; gdb on the core dumps): a gloo worker thread
# ("pt_gloo_runloop") drops its reference to a finished collective after the Python thread that
# waited on it has moved on. The collective's tensors own their Python objects, so dropping them
# takes the GIL; once Py_FinalizeEx has begun, CPython ends such a thread with pthread_exit, whose
# forced unwind hits a noexcept destructor: std::terminate, SIGABRT. destroy_process_group()
# joins those threads when it drops the last reference to the gloo backend, but
# torch.distributed.nn.functional (imported by torch._dynamo, so by torch.func.grad and funcol)
# binds `group=group.WORLD` as a default argument when imported after init, and that reference
# kept the backend and its threads alive until the interpreter was already finalizing.

_WORKER_THREAD_NAME = "pt_gloo_runloop"
IDLE_WAIT_S = 2.0
_IDLE_POLL_S = 0.005
_IDLE_POLLS = 3

_registered = False
_before_destroy: list[tuple[str, Callable[[], None]]] = []  # (what it does, the function)


def before_destroy(what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit before the process group is destroyed (e.g. to finish collectives
    still in flight); ``what`` names it in the warning if it fails."""
    if all(f is not fn for _, f in _before_destroy):
        _before_destroy.append((what, fn))


def register() -> None:
    """Install the exit handler once per process; :func:`fddp.init` calls this."""
    global _registered
    if not _registered:
        atexit.register(_shutdown)
        _registered = True


def _shutdown() -> None:
    """Destroy the process groups and make sure no gloo worker can need the GIL afterwards.

    Runs as an ``atexit`` handler, so while the interpreter is still whole: destroying the last
    reference to a gloo backend joins its worker threads with the GIL released, and any
    reference a worker still drops takes the GIL normally.
    """
    if dist.is_initialized():
        for what, fn in _before_destroy:
            try:
                fn()
            except Exception:
                logger.warning("fddp: %s failed at exit", what, exc_info=True)
        try:
            dist.destroy_process_group()
        except Exception:
            logger.warning("fddp: destroy_process_group failed at exit", exc_info=True)
    _release_default_group_arguments()
    if _worker_threads():
        # A group is still referenced: perhaps by a reference cycle, else by user code.
        gc.collect()
    if _worker_threads() and not _wait_until_workers_idle(IDLE_WAIT_S):
        logger.warning(
            "fddp: gloo worker threads were still busy %.1f s after the process group was "
            "destroyed at exit; a collective may still be running",
            IDLE_WAIT_S,
        )


def _release_default_group_arguments() -> None:
    """Replace the process groups that torch.distributed.nn binds as defaults by ``None``.

    ``None`` means the default group there, as it does everywhere in torch.distributed.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for value in list(vars(module).values()):
        if isinstance(value, types.FunctionType) and value.__defaults__:
            defaults = value.__defaults__
            if any(isinstance(d, dist.ProcessGroup) for d in defaults):
                value.__defaults__ = tuple(
                    None if isinstance(d, dist.ProcessGroup) else d for d in defaults
                )


def _worker_threads() -> list[str]:
    """Ids of this process's live gloo worker threads (Linux; elsewhere none are seen)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    workers = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _WORKER_THREAD_NAME:
                    workers.append(tid)
        except OSError:
            continue
    return workers


def _thread_state(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "gone"


def _wait_until_workers_idle(timeout_s: float) -> bool:
    """Sleep (GIL released) until every gloo worker has been asleep for a few polls in a row.

    A worker that still has to drop a finished collective is runnable, or blocked on the GIL
    that this sleep frees; an idle one sleeps on its work queue.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(_IDLE_POLL_S)
        states = [_thread_state(tid) for tid in _worker_threads()]
        quiet = quiet + 1 if all(s in ("S", "gone") for s in states) else 0
        if quiet >= _IDLE_POLLS:
            return True
    return False
