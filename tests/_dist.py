"""Run a test function on N gloo ranks, each in a freshly spawned process, with a hard timeout."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

OUTPUT_TAIL_CHARS = 6000
ERROR_GRACE_S = 3.0
STACK_DUMP_WAIT_S = 1.0
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a fresh ``world_size``-process gloo group.

    Each rank is a new process (multiprocessing ``spawn``) with the torchrun environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` on a free port, ``OMP_NUM_THREADS=1``, then ``env``) set before ``fn`` and
    torch are imported there; it calls ``fddp.init()`` and then ``fn``. The parent never blocks
    without a deadline: if a rank raises, the others are killed (after a short grace period in
    which they may report their own errors) and an ``AssertionError`` shows each failing rank's
    traceback; if the ranks have not all returned *and exited* within ``timeout`` seconds
    (spawn, imports and exit handlers included), the stacks of the unfinished ranks are dumped,
    every rank is killed, and the ``AssertionError`` names them. A rank whose process exits with
    a non-zero status after returning fails the run too. What the ranks print is included in
    failure messages and echoed to this process's stdout otherwise.

    ``fn`` and ``args`` are pickled, so ``fn`` must be a module-level function (under pytest a
    test module is importable in the child by its bare name) and the return values must be
    picklable. Every spawn imports torch (one to two seconds per rank), so group the checks
    that need the same world size into one spawn: see :func:`run_checks`.

    Args:
        fn: module-level function run on every rank.
        world_size: number of ranks.
        *args: positional arguments for ``fn`` (picklable).
        timeout: seconds for the whole run.
        env: extra environment variables for the ranks.

    Returns:
        ``fn``'s return value on each rank, in rank order.

    >>> def rank_and_size():
    ...     import torch.distributed as dist
    ...     return dist.get_rank(), dist.get_world_size()
    >>> run_ranks(rank_and_size, 2)  # doctest: +SKIP
    [(0, 2), (1, 2)]
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be at least 1, got {world_size}.")
    try:
        payload = pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"run_ranks: cannot pickle {fn!r} and its arguments for the spawned ranks ({e}). "
            "Pass a module-level function of an importable module, and picklable arguments."
        ) from e
    return _Run(payload, world_size, timeout, dict(env or {})).run()


def run_checks(
    checks: Sequence[Callable[[], Any]],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[list[Any]]:
    """Run several checks one after another in one spawn of ``world_size`` ranks.

    Spawning costs seconds (every rank imports torch), so a test file should group its
    multi-rank checks per world size. Each check is a module-level zero-argument function
    (use ``functools.partial`` to bind arguments) that every rank runs in the given order, so
    the checks' collectives line up across ranks. The first check that raises on any rank fails
    the run, and the traceback names it.

    Returns:
        ``results[i][rank]``: the return value of ``checks[i]`` on ``rank``.

    >>> results = run_checks([check_psum, check_broadcast], world_size=2)  # doctest: +SKIP
    >>> psum_results, broadcast_results = results  # doctest: +SKIP
    """
    per_rank = run_ranks(_run_in_order, world_size, list(checks), timeout=timeout, env=env)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(checks))]


def _run_in_order(checks: list[Callable[[], Any]]) -> list[Any]:
    results = []
    for check in checks:
        try:
            results.append(check())
        except BaseException as e:
            name = getattr(check, "__qualname__", None) or repr(check)
            raise RuntimeError(f"check {name} failed") from e
    return results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank of a single-node job on loopback."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _child(
    rank: int,
    world_size: int,
    port: int,
    payload: bytes,
    conn: Connection,
    log_path: str,
    env: dict[str, str],
) -> None:
    """Body of one rank's process: redirect output, set the environment, init, run, report."""
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 (lives until the process exits)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True)
    faulthandler.enable(file=log, all_threads=True)
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, file=log, all_threads=True)
    os.environ.update(torchrun_env(rank, world_size, port), OMP_NUM_THREADS="1")
    os.environ.update(env)
    try:
        fn, args = pickle.loads(payload)
        import fddp

        fddp.init()
        message = pickle.dumps(("ok", fn(*args)))
    except BaseException:
        message = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(message)
    conn.close()


class _Run:
    """One launch of ``world_size`` ranks, supervised from the parent."""

    def __init__(self, payload: bytes, world_size: int, timeout: float, env: dict[str, str]):
        self.payload = payload
        self.world_size = world_size
        self.timeout = timeout
        self.env = env
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.first_error_at = 0.0
        self.logs: list[str] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def run(self) -> list[Any]:
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="fddp-ranks-") as tmp:
            self.logs = [os.path.join(tmp, f"rank{r}.log") for r in range(self.world_size)]
            conns: dict[Connection, int] = {}
            deadline = time.monotonic() + self.timeout
            try:
                for r in range(self.world_size):
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_child,
                        args=(r, self.world_size, port, self.payload, send, self.logs[r], self.env),
                        name=f"fddp-rank{r}",
                    )
                    proc.start()
                    send.close()
                    self.procs.append(proc)
                    conns[recv] = r
                self._collect(conns, deadline)
                if self.errors:
                    self._kill_all()
                    raise AssertionError(self._error_message())
                self._join(deadline)
            finally:
                self._kill_all()
                for c in conns:
                    c.close()
            self._echo_output()
        return [self.results[r] for r in range(self.world_size)]

    def _collect(self, conns: dict[Connection, int], deadline: float) -> None:
        """Receive one message per rank, until all arrive, an error plus grace, or deadline."""
        pending = dict(conns)
        while pending:
            now = time.monotonic()
            if self.errors:
                deadline = min(deadline, self.first_error_at + ERROR_GRACE_S)
            if now >= deadline:
                break
            for conn in wait(list(pending), timeout=deadline - now):
                rank = pending.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    self.procs[rank].join(timeout=1.0)
                    code = self.procs[rank].exitcode
                    status, value = "error", f"process ended (status {code}) without a result"
                if status == "ok":
                    self.results[rank] = value
                else:
                    if not self.errors:
                        self.first_error_at = time.monotonic()
                    self.errors[rank] = value
        if pending and not self.errors:
            self._timed_out(sorted(pending.values()), "did not return")

    def _join(self, deadline: float) -> None:
        """Wait for the ranks to exit (exit handlers run here); a bad exit fails the run."""
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        if alive:
            self._timed_out(alive, "returned but did not exit")
        bad = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode != 0}
        if bad:
            parts = [
                f"rank {r} returned but its process exited with status {code}" + self._output(r)
                for r, code in bad.items()
            ]
            raise AssertionError("\n\n".join(parts))

    def _timed_out(self, ranks: list[int], what: str) -> None:
        if _DUMP_SIGNAL is not None:
            for r in ranks:
                if self.procs[r].is_alive() and self.procs[r].pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.procs[r].pid, _DUMP_SIGNAL)
            time.sleep(STACK_DUMP_WAIT_S)
        self._kill_all()
        finished = [r for r in range(self.world_size) if r not in ranks]
        head = (
            f"timeout after {self.timeout:g} s: rank(s) {ranks} {what} "
            f"(finished: {finished or 'none'}); their stacks (dumped before the kill) and "
            "output follow"
        )
        raise AssertionError("\n\n".join([head] + [f"rank {r}:" + self._output(r) for r in ranks]))

    def _error_message(self) -> str:
        ranks = sorted(self.errors)
        stopped = [
            r for r in range(self.world_size) if r not in self.errors and r not in self.results
        ]
        parts = [f"rank(s) {ranks} raised" + (f"; stopped rank(s) {stopped}" if stopped else "")]
        for r in ranks:
            parts.append(f"--- rank {r} traceback ---\n{self.errors[r].rstrip()}{self._output(r)}")
        return "\n\n".join(parts)

    def _output(self, rank: int) -> str:
        text = _read_tail(self.logs[rank])
        return f"\n--- rank {rank} output ---\n{text.rstrip()}" if text.strip() else ""

    def _echo_output(self) -> None:
        for r in range(self.world_size):
            text = _read_tail(self.logs[r])
            if text.strip():
                print(f"--- rank {r} output ---\n{text.rstrip()}")

    def _kill_all(self) -> None:
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:
            p.terminate()
        for p in alive:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def _read_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - OUTPUT_TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text if size <= OUTPUT_TAIL_CHARS else "[...]" + text
