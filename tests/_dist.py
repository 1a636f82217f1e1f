"""Multi-rank tests: named checks on N gloo ranks, each rank a fresh process, with a
hard timeout; and the subprocess jobs (scripts, torchrun) that tests launch beside them.

The one pattern for a multi-rank test: a module-level dict of named checks, run in one spawn by
a module-scoped fixture (:func:`run_checks`), and one test per check (or per group of checks)
that reads its results by name. Each rank reports each check's outcome as soon as it is known,
so a check that raises, hangs or kills its rank fails the tests that read it and no other::

    CHECKS = {"psum": check_psum, "broadcast": functools.partial(check_broadcast, src=1)}

    @pytest.fixture(scope="module")
    def runs():
        return run_checks(CHECKS, world_size=2)

    def test_psum(runs):
        assert runs["psum"] == [3.0, 3.0]  # one value per rank

:func:`run_ranks` (one function on every rank, its return values) is the building block; a
test that expects the whole run to fail (the harness's own tests) calls it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import importlib
import multiprocessing
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from pathlib import Path
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

    Each rank is a new process, forked from a server process that has imported torch and fddp
    once for the whole test session (``FDDP_TESTS_SPAWN=1``: a fresh interpreter per rank,
    multiprocessing ``spawn``), with the torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port,
    ``OMP_NUM_THREADS=1``, then ``env``) set before ``fn`` is unpickled there; it calls
    ``fddp.init()`` and then ``fn``, and exits through the interpreter's normal shutdown (exit
    handlers included). The parent never blocks without a deadline: if a rank raises, the
    others are killed (after a short grace period in which they may report their own errors)
    and an ``AssertionError`` shows each failing rank's traceback; if the ranks have not all
    returned *and exited* within ``timeout`` seconds (start and exit handlers included), the
    stacks of the unfinished ranks are dumped, every rank is killed, and the ``AssertionError``
    names them. A rank whose process exits with a non-zero status after returning fails the run
    too. What the ranks print is included in failure messages and echoed to this process's
    stdout otherwise.

    ``fn`` and ``args`` are pickled, so ``fn`` must be a module-level function (under pytest a
    test module is importable in the child by its bare name) and the return values must be
    picklable. A rank imports its test module and traces its steps afresh, so group the checks
    that need the same world size into one run: see :func:`run_checks`.

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
    return _Run(_payload(fn, args), world_size, timeout, dict(env or {})).run()


def _payload(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"run_ranks: cannot pickle {fn!r} and its arguments for the spawned ranks ({e}). "
            "Pass a module-level function of an importable module, and picklable arguments."
        ) from e


def run_checks(
    checks: Mapping[str, Callable[[], Any]],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> CheckResults:
    """Run named checks one after another in one spawn of ``world_size`` ranks.

    Every run costs a second or more (each rank imports its test module and traces its steps
    afresh), so a test file groups its multi-rank checks per world size. Each check is a
    module-level zero-argument function (bind arguments with ``functools.partial``) that every
    rank runs in the given order, so the checks' collectives line up across ranks. A check that
    raises is recorded with its traceback and the next one runs; each rank sends each outcome
    as soon as it has it, so a check that hangs (no check finishes for ``timeout`` seconds) or
    kills its process costs only itself and the checks after it. Write checks that fail alike
    on every rank (same code, same shapes): a check that raises on one rank only leaves the
    others waiting in its collectives until the timeout.

    Args:
        checks: ``{name: check}``, run in this order.
        world_size: number of ranks.
        timeout: seconds the spawn may go without a check finishing on some rank (each
            outcome restarts it): a hang is found, while a machine loaded enough to stretch
            every check does not run the last checks out of time.
        env: extra environment variables for the ranks.

    Returns:
        :class:`CheckResults`: ``results[name]`` is the list of the check's return values, one
        per rank; reading a check that raised or never finished fails the reading test.

    >>> runs = run_checks({"psum": check_psum, "broadcast": check_broadcast})  # doctest: +SKIP
    >>> runs["psum"]  # doctest: +SKIP
    [3.0, 3.0]
    """
    names = list(checks)
    run = _Run(_payload(_run_named, (dict(checks),)), world_size, timeout, dict(env or {}))
    spawn_error = None
    try:
        run.run()
    except AssertionError as e:
        spawn_error = str(e)
    return CheckResults(names, world_size, run.reports, spawn_error)


@dataclasses.dataclass(frozen=True)
class Raised:
    """What a rank reported instead of a check's result: the exception it raised."""

    error: str  # the exception's type name, e.g. "ValueError"
    message: str
    traceback: str
    seconds: float  # from the check's start to the exception


def run_world_sizes(
    checks_for: Callable[[int], Mapping[str, Callable[[], Any]]],
    worlds: tuple[int, ...] = (1, 2, 3, 4),
    *,
    in_process: contextlib.AbstractContextManager[Any] | None = None,
    timeout: float = 120.0,
) -> dict[int, Mapping[str, list[Any]]]:
    """``checks_for(world)`` on each world size: a world of one in this process (inside
    ``in_process``, such as the tests' ``one_thread()``, to run as a spawned rank does), each
    other world in one spawn (:func:`run_checks`). Results by world size, then as
    :func:`run_checks`'s."""
    out: dict[int, Mapping[str, list[Any]]] = {}
    for world in worlds:
        if world == 1:
            with in_process or contextlib.nullcontext():
                out[1] = {name: [check()] for name, check in checks_for(1).items()}
        else:
            out[world] = run_checks(checks_for(world), world, timeout=timeout)
    return out


class CheckResults(Mapping[str, list[Any]]):
    """The outcomes of :func:`run_checks` by check name: ``results[name][rank]``.

    ``results[name]`` fails the calling test (with every rank's traceback, or the spawn's
    failure when a rank never reported) unless the check returned on every rank;
    :meth:`outcomes` gives the raw per-rank outcomes (values or :class:`Raised`) instead, for
    tests that expect a check to raise.
    """

    def __init__(
        self,
        names: list[str],
        world_size: int,
        reports: dict[int, dict[str, tuple[str, Any, float]]],
        spawn_error: str | None,
    ) -> None:
        self._names = names
        self._world_size = world_size
        self._reports = reports
        self.spawn_error = spawn_error

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def outcomes(self, name: str) -> list[Any]:
        """Each rank's result, or a :class:`Raised` for a rank on which the check raised."""
        if name not in self._names:
            raise KeyError(f"no check named {name!r}; the checks are {self._names}")
        missing = [r for r in range(self._world_size) if name not in self._reports.get(r, {})]
        if missing:
            import pytest

            pytest.fail(
                f"check {name!r} did not finish on rank(s) {missing}: the spawn failed before"
                f" it did:\n{self.spawn_error}",
                pytrace=False,
            )
        out = []
        for r in range(self._world_size):
            status, value, _ = self._reports[r][name]
            out.append(value if status == "ok" else Raised(**value))
        return out

    def seconds(self) -> dict[str, float]:
        """How long each check that finished took, on its slowest rank."""
        out: dict[str, float] = {}
        for reports in self._reports.values():
            for name, (_, _, seconds) in reports.items():
                out[name] = max(out.get(name, 0.0), seconds)
        return out

    def __getitem__(self, name: str) -> list[Any]:
        values = self.outcomes(name)
        failed = [(r, v) for r, v in enumerate(values) if isinstance(v, Raised)]
        if failed:
            import pytest

            parts = [f"--- rank {r} ---\n{v.traceback.rstrip()}" for r, v in failed]
            pytest.fail(
                f"check {name!r} raised on rank(s) {[r for r, _ in failed]}:\n" + "\n".join(parts),
                pytrace=False,
            )
        return values


def _run_named(checks: dict[str, Callable[[], Any]]) -> None:
    """Each check in turn on this rank; each outcome sent to the parent as soon as it is known."""
    for name, check in checks.items():
        start = time.monotonic()
        try:
            value = check()
            outcome = ("ok", value, time.monotonic() - start)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # pytest.fail and pytest.raises's failure too
            failed = {"error": type(e).__name__, "message": str(e)}
            seconds = time.monotonic() - start
            failed.update(traceback=traceback.format_exc(), seconds=seconds)
            outcome = ("error", failed, seconds)
        _report(name, outcome)


_report_conn: Connection | None = None  # set in a spawned rank: where _report sends to


def _report(name: str, outcome: tuple[str, Any, float]) -> None:
    assert _report_conn is not None, "_report runs inside a rank spawned by run_ranks"
    try:
        message = pickle.dumps(("report", name, outcome))
    except Exception as e:
        error = {"error": type(e).__name__, "message": f"cannot pickle the result: {e}"}
        error.update(traceback="", seconds=0.0)
        message = pickle.dumps(("report", name, ("error", error, outcome[2])))
    _report_conn.send_bytes(message)


def raised(call: Callable[[], Any]) -> tuple[str, str]:
    """What ``call()`` raised on this rank: the exception's type and first line, or ("ok", "")."""
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e).split("\n")[0]
    return "ok", ""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, taken together before any process binds one."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


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
    log_path: str,
    env: dict[str, str],
    conn: Connection,
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
    global _report_conn
    _report_conn = conn
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
        # run_checks: rank -> check name -> (status, value, seconds), as each rank reports it
        self.reports: dict[int, dict[str, tuple[str, Any, float]]] = {}
        self.errors: dict[int, str] = {}
        self.first_error_at = 0.0
        self.logs: list[str] = []
        self.procs: list[Any] = []  # multiprocessing.Process or _ForkedRank: same methods
        self.deadline = 0.0  # set when the ranks start; each check's outcome moves it on

    def run(self) -> list[Any]:
        if not _SPAWN:
            _fork_server()  # started once per test session, before this run's deadline counts
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="fddp-ranks-") as tmp:
            self.logs = [os.path.join(tmp, f"rank{r}.log") for r in range(self.world_size)]
            conns: dict[Connection, int] = {}
            self.deadline = time.monotonic() + self.timeout
            try:
                for r in range(self.world_size):
                    args = (r, self.world_size, port, self.payload, self.logs[r], self.env)
                    recv, proc = _start_rank(args, f"fddp-rank{r}")
                    self.procs.append(proc)
                    conns[recv] = r
                self._collect(conns, self.deadline)
                if self.errors:
                    self._kill_all()
                    raise AssertionError(self._error_message())
                self._join(self.deadline)
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
                rank = pending[conn]
                try:
                    message = pickle.loads(conn.recv_bytes())
                    if message[0] == "report":  # one check's outcome; the rank goes on
                        self.reports.setdefault(rank, {})[message[1]] = message[2]
                        if not self.errors:  # progress: the time limit starts again
                            deadline = max(deadline, time.monotonic() + self.timeout)
                            self.deadline = deadline
                        continue
                    status, value = message
                except EOFError:
                    self.procs[rank].join(timeout=1.0)
                    code = self.procs[rank].exitcode
                    status, value = "error", f"process ended (status {code}) without a result"
                del pending[conn]
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
            f"timeout: no progress for {self.timeout:g} s: rank(s) {ranks} {what} "
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


# --- how a rank process starts: forked from a server that has imported torch and fddp ---------

# Imported once by the fork server, so that no rank imports them again (about 2 s of CPU per
# rank otherwise). Not Dynamo, nor torch.distributed.nn, which Dynamo imports: a rank imports
# those after fddp.init(), as a fresh script does (see fddp/_ranks/_shutdown.py), and exits
# through the interpreter's normal shutdown.
DYNAMO_FREE_IMPORTS = (  # what Dynamo imports that has nothing to do with torch.distributed
    "numpy",
    "sympy",
    "torch.fx.experimental.symbolic_shapes",
    "torch._subclasses.fake_tensor",
    "torch._decomp",
    "torch._guards",
    "torch._logging",
    "torch.fx.experimental.proxy_tensor",
    "torch._prims",
    "torch._refs",
)
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed._functional_collectives",
    "fddp",
    "fddp.optim",
    "optree",
    "pytest",
    *DYNAMO_FREE_IMPORTS,
)
# FDDP_TESTS_SPAWN=1: every rank a fresh interpreter (multiprocessing spawn), importing all again.
_SPAWN = os.environ.get("FDDP_TESTS_SPAWN") == "1"
SERVER_START_TIMEOUT_S = 300.0


def _start_rank(args: tuple, name: str) -> tuple[Connection, Any]:
    """Start one rank running ``_child(*args, conn)``; its result end and its process."""
    if _SPAWN:
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(*args, send), name=name)
        proc.start()
        send.close()
        return recv, proc
    read_fd, write_fd = os.pipe()
    try:
        pid = _fork_server().fork(args, write_fd)
    finally:
        os.close(write_fd)
    return Connection(read_fd, writable=False), _ForkedRank(pid)


def _script(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """Run ``python ARGV`` in this forked process, as a fresh interpreter would run it (its
    output to ``log_path``; an uncaught exception or ``sys.exit`` ends the process with the
    status a script's would have)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


def _serve(fd: int) -> None:
    """The fork server's loop: fork a rank or a script per request, report each exit status."""
    conn = Connection(fd)
    for module in _PRELOAD:
        importlib.import_module(module)
    assert "torch._dynamo" not in sys.modules and "torch.distributed.nn" not in sys.modules
    # What exists now is shared by every rank and lives until it exits: out of the collector's
    # reach, a rank's collections and its interpreter's shutdown do not walk it all again.
    gc.freeze()
    conn.send(("ready", os.getpid()))
    children: set[int] = set()
    while True:
        if conn.poll(0.02):
            try:
                request_id, kind, args = conn.recv()
            except EOFError:  # the tests are over (or were killed): no rank outlives them
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            result_fd = reduction.recv_handle(conn) if kind == "rank" else None
            pid = os.fork()
            if pid == 0:
                conn.close()
                if result_fd is not None:
                    _child(*args, Connection(result_fd, readable=False))
                else:
                    _script(*args)
                sys.exit(0)  # unwinds out of the loop: the interpreter's normal exit
            if result_fd is not None:
                os.close(result_fd)
            children.add(pid)
            conn.send(("forked", request_id, pid))
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


class _ForkServer:
    """The tests' end of the fork server: requests forks, learns exit statuses (thread-safe)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # lives as long as the server: closed (and removed) when this process exits
        self._log = tempfile.NamedTemporaryFile(prefix="fddp-fork-server-", suffix=".log")  # noqa: SIM115
        here = str(Path(__file__).resolve().parent)
        code = (
            f"import sys; sys.path[:0] = {[here, *sys.path]!r}; "
            f"import _dist; _dist._serve({theirs.fileno()})"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._forked: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit status
        self._next_request = 0
        self.alive = True
        if not self._conn.poll(SERVER_START_TIMEOUT_S):
            self._proc.kill()
            raise AssertionError(f"the fork server did not start:\n{self._server_log()}")
        try:
            self._conn.recv()  # ("ready", pid)
        except EOFError:
            raise AssertionError(f"the fork server failed:\n{self._server_log()}") from None
        threading.Thread(target=self._read, name="fddp-fork-server", daemon=True).start()

    def _server_log(self) -> str:
        self._log.flush()
        return _read_tail(self._log.name)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                with self._changed:
                    self.alive = False
                    self._changed.notify_all()
                return
            with self._changed:
                if message[0] == "forked":
                    self._forked[message[1]] = message[2]
                else:
                    self._exits[message[1]] = message[2]
                self._changed.notify_all()

    def fork(self, args: tuple, result_fd: int | None = None) -> int:
        """Fork a rank running ``_child(*args)`` (reporting to ``result_fd``) or, without
        ``result_fd``, a script run by ``_script(*args)``; its pid."""
        with self._send_lock:
            request_id = self._next_request
            self._next_request += 1
            self._conn.send((request_id, "rank" if result_fd is not None else "script", args))
            if result_fd is not None:
                reduction.send_handle(self._conn, result_fd, self._proc.pid)
        with self._changed:
            done = self._changed.wait_for(
                lambda: request_id in self._forked or not self.alive, SERVER_START_TIMEOUT_S
            )
            if not done or request_id not in self._forked:
                raise AssertionError(f"the fork server did not fork a rank:\n{self._server_log()}")
            return self._forked.pop(request_id)

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive, timeout)
            return self._exits.get(pid)


_server: _ForkServer | None = None
_server_lock = threading.Lock()


def _fork_server() -> _ForkServer:
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = _ForkServer()
        return _server


class _ForkedScript:
    """A script forked by the fork server, with the methods of ``subprocess.Popen`` that
    :class:`Job` uses."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
        self._server = _fork_server()
        self.pid = self._server.fork((argv, env, cwd, log_path))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
        return self.returncode


class _ForkedRank:
    """A rank forked by the fork server, with the methods of ``multiprocessing.Process`` that
    :class:`_Run` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._server = _fork_server()

    @property
    def exitcode(self) -> int | None:
        return self._server.exit_status(self.pid, 0)

    def is_alive(self) -> bool:
        return self.exitcode is None and self._server.alive

    def join(self, timeout: float | None = None) -> None:
        self._server.exit_status(self.pid, timeout)

    def _signal(self, signum: int) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def _read_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - OUTPUT_TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text if size <= OUTPUT_TAIL_CHARS else "[...]" + text


# --- subprocess jobs: scripts and torchrun launches, started together, with one deadline -------

ROOT = Path(__file__).resolve().parent.parent


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment for a script of the repository: ``fddp`` importable from the
    checkout, ``OMP_NUM_THREADS=1`` (ranks share the cores), then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def torchrun(*options: str) -> list[str]:
    """The command line of ``torchrun OPTIONS`` with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", *options]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


class Job:
    """Processes started together (the ranks or torchrun nodes of one job), with one deadline.

    Each process writes stdout and stderr to its own file in ``tmp``. :meth:`wait` returns once
    the chosen processes have exited, or at the deadline; :meth:`stop` kills every process tree
    left. Nothing waits past the deadline, so no test can hang on a job. With ``forked``, each
    command (``python SCRIPT ARGS...``) runs in a process forked from the fork server, which
    has imported torch and fddp already, instead of a fresh interpreter.
    """

    def __init__(
        self,
        name: str,
        commands: list[tuple[list[str], dict[str, str]]],
        tmp: Path,
        timeout: float = 150.0,
        *,
        forked: bool = False,
    ) -> None:
        self.name = name
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.logs = [Path(tmp) / f"{name}.{i}.log" for i in range(len(commands))]
        self.procs: list[Any] = []  # subprocess.Popen, or _ForkedScript: the same methods
        self.ended_at: list[float | None] = [None] * len(commands)  # time.time() of each exit
        for (argv, env), log in zip(commands, self.logs, strict=True):
            if forked and not _SPAWN:  # python SCRIPT ARGS..., forked from the fork server
                assert argv[0] == sys.executable, argv
                self.procs.append(_ForkedScript(argv[1:], env, str(ROOT), str(log)))
                continue
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

    @classmethod
    def ranks(
        cls,
        name: str,
        tmp: Path,
        argv: list[str],
        *,
        world_size: int = 2,
        port: int | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 150.0,
        forked: bool = False,
    ) -> Job:
        """``python ARGV`` as each rank of a ``world_size``-rank job (the torchrun environment,
        without torchrun)."""
        port = free_port() if port is None else port
        env = env or {}
        commands = [
            ([sys.executable, *argv], script_env(**torchrun_env(r, world_size, port), **env))
            for r in range(world_size)
        ]
        return cls(name, commands, tmp, timeout, forked=forked)

    def wait(self, which: list[int] | None = None) -> Job:
        which = list(range(len(self.procs))) if which is None else which
        while time.monotonic() < self.deadline:
            for i in which:
                if self.ended_at[i] is None and self.procs[i].poll() is not None:
                    self.ended_at[i] = time.time()
            if all(self.ended_at[i] is not None for i in which):
                break
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for pid in process_tree(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def returncodes(self) -> list[int | None]:
        """Each process's exit status; None for one that is still running (or was killed at
        the deadline)."""
        return [
            p.returncode if t is not None else None
            for p, t in zip(self.procs, self.ended_at, strict=True)
        ]

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def describe(self) -> str:
        parts = [f"job {self.name}: return codes {self.returncodes()} (None: killed or running)"]
        for i in range(len(self.procs)):
            tail = self.output(i)[-OUTPUT_TAIL_CHARS:]
            parts.append(f"--- process {i} output (tail) ---\n{tail}")
        return "\n".join(parts)

    def assert_succeeded(self) -> None:
        self.wait()
        assert self.returncodes() == [0] * len(self.procs), self.describe()
