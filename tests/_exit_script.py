"""A small 2-rank training script that ends without any cleanup; test_shutdown.py runs it.

As a rank (``python tests/_exit_script.py`` with the torchrun environment) it trains a few steps
with ``torch.func.grad``, ``all_reduce`` and functional collectives and returns;
``FDDP_EXIT_SCRIPT_END`` picks another ending: ``raise`` (every rank raises after training),
``exit3`` (``sys.exit(3)``) or ``raise_early`` (rank 0 raises before the last collective).

``python tests/_exit_script.py --forked-launches PARALLEL TIMEOUT END...`` runs one 2-rank
launch per END (``plain`` for the plain ending), PARALLEL at a time, each rank forked from this
process, and prints one JSON list of ``{"launch", "end", "rank", "status", "stdout",
"stderr"}``. A forked rank skips importing torch (seconds per process) but otherwise lives like
a script: it runs :func:`main`, then the interpreter exits normally (an uncaught exception's
traceback, ``sys.exit``'s status), exit handlers included.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _dist import DYNAMO_FREE_IMPORTS, free_port, torchrun_env  # this script runs from tests/

import fddp

WORLD_SIZE = 2
_OUTPUT_TAIL_CHARS = 4000


def _report_gloo_workers() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    print(f"gloo workers after exit handlers: {names.count('pt_gloo_runloop')}", flush=True)


def _loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ params["w"]) + params["b"]).pow(2).mean()


def main(end: str | None = None) -> None:
    """Train a few steps on every rank, then end as ``end`` (default: the environment's
    ``FDDP_EXIT_SCRIPT_END``) says."""
    if os.path.isdir("/proc/self/task"):
        atexit.register(_report_gloo_workers)  # registered first, so it runs after fddp's
    if end is None:
        end = os.environ.get("FDDP_EXIT_SCRIPT_END", "")
    fddp.init()
    torch.manual_seed(0)
    params = {"w": torch.randn(16, 32), "b": torch.randn(32)}
    x = torch.randn(8, 16) + fddp.rank()
    for step in range(5):
        grads = torch.func.grad(_loss)(params, x)
        for name, g in grads.items():
            if end == "raise_early" and step == 4 and fddp.rank() == 0:
                raise RuntimeError("rank 0 fails before the last collective")
            dist.all_reduce(g)
            g = funcol.wait_tensor(funcol.all_reduce(g, "sum", dist.group.WORLD))
            params[name] = params[name] - 0.01 * g / (2 * fddp.world_size())
    print(f"rank {fddp.rank()} trained, loss {float(_loss(params, x)):.6f}", flush=True)
    if end == "raise":
        raise RuntimeError(f"rank {fddp.rank()} fails after training")
    if end == "exit3":
        sys.exit(3)


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        return f.read()[-_OUTPUT_TAIL_CHARS:].decode(errors="replace")


def _forked_launches(parallel: int, timeout: float, ends: list[str]) -> None:
    # Imported before forking so that each forked rank does not import them again: what Dynamo
    # (imported by torch.func.grad in main, after fddp.init) imports that has nothing to do with
    # torch.distributed. Dynamo itself and torch.distributed.nn stay out (see below).
    for module in DYNAMO_FREE_IMPORTS:
        importlib.import_module(module)
    # A fresh script imports these only after fddp.init(), which is what pins the process group
    # (see fddp/_ranks/_shutdown.py); forked ranks must start from the same state.
    assert "torch._dynamo" not in sys.modules and "torch.distributed.nn" not in sys.modules
    # What exists now is shared by every forked rank and lives until it exits: out of the
    # collector's reach, a rank's collections and its interpreter's shutdown do not walk (and
    # copy) it all again; the process group and everything after fddp.init() are collected
    # as in a fresh script.
    gc.freeze()
    tmp = tempfile.mkdtemp(prefix="fddp-exit-")
    results = []
    for first in range(0, len(ends), parallel):
        children: dict[int, tuple[int, int, str]] = {}
        for launch in range(first, min(len(ends), first + parallel)):
            port = free_port()
            for rank in range(WORLD_SIZE):
                log = os.path.join(tmp, f"launch{launch}-rank{rank}")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for fd, stream in ((1, "out"), (2, "err")):
                        os.dup2(os.open(f"{log}.{stream}", os.O_WRONLY | os.O_CREAT), fd)
                    os.environ.update(torchrun_env(rank, WORLD_SIZE, port))
                    main("" if ends[launch] == "plain" else ends[launch])
                    sys.exit(0)  # unwinds to the top: the interpreter's normal exit
                children[pid] = (launch, rank, log)
        deadline = time.monotonic() + timeout
        while children and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
            launch, rank, log = children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            results.append(_result(launch, ends[launch], rank, code, log))
        for pid, (launch, rank, log) in children.items():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            result = _result(launch, ends[launch], rank, None, log)
            result["stderr"] += f"\n[killed after {timeout:g} s]"
            results.append(result)
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results))


def _result(launch: int, end: str, rank: int, status: int | None, log: str) -> dict:
    out, err = _tail(f"{log}.out"), _tail(f"{log}.err")
    return {
        "launch": launch,
        "end": end,
        "rank": rank,
        "status": status,
        "stdout": out,
        "stderr": err,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--forked-launches"]:
        _forked_launches(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:])
    else:
        main()
