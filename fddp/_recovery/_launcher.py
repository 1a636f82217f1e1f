"""``python -m fddp.run``: torchrun's flags and elastic's pieces, with a policy that keeps the
survivors running, replaces dead workers and hosts the store recoverable jobs agree through."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import PContext, SignalException, start_processes
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.utils import macros
from torch.distributed.launcher.api import LaunchConfig

from fddp._recovery._admission import admitted_key
from fddp._recovery._environment import PREFIX, worker_env

T = TypeVar("T")
_KEYS = "fddp-run"  # the launchers' own keys in the store
_STOP_S = 10  # how long a replacement that was never admitted gets to exit after SIGTERM


def parser() -> argparse.ArgumentParser:
    """torchrun's parser, with ``--max-replacements`` and ``--tee 3`` (prefixed lines) by
    default."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m fddp.run"
    parser.description = (
        "Start the workers of a job whose steps are fddp.recoverable: torchrun's flags, but a "
        "worker's death leaves the others running, up to --max-replacements new workers "
        "take the dead ones' places, and this process hosts the store they agree through. "
        "Exits 0 when a worker finished training, whoever died on the way."
    )
    parser.add_argument(
        "--max-replacements",
        "--max_replacements",
        type=int,
        default=0,
        help="How many dead workers of the job are replaced by new ones (default 0).",
    )
    parser.set_defaults(tee="3")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Launch the job described by ``argv`` (``sys.argv[1:]`` by default); its exit status."""
    p = parser()
    args = p.parse_args(argv)
    if args.max_restarts:
        p.error(
            "--max-restarts restarts every worker (torchrun's checkpoint path); fddp.run keeps "
            "the survivors running and replaces the dead: use --max-replacements."
        )
    if args.max_replacements < 0:
        p.error("--max-replacements must be >= 0.")
    one_node = torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    static = args.rdzv_backend == "static" and not args.rdzv_endpoint and not args.master_port
    if args.standalone or (static and one_node):  # as torchrun: a rendezvous on this host
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    args.master_port = args.master_port or 29500
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the store must be ours
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    if not isinstance(entrypoint, str):
        p.error("--run-path runs the script in this process; fddp.run needs worker processes.")
    return Job(config, entrypoint, entry_args, args.max_replacements).run()


@dataclasses.dataclass
class _Worker:
    uid: int
    local_rank: int
    context: PContext
    process: subprocess.Popen
    admitted: bool  # a member of the group (a replacement once the members admitted it)
    code: int | None = None
    stopped: bool = False  # stopped by this launcher: a replacement nobody could admit


class Job:
    """This node's workers: started, watched, replaced; the job's end decided."""

    def __init__(
        self, config: LaunchConfig, entrypoint: str, args: list[Any], max_replacements: int
    ) -> None:
        self._config, self._entrypoint, self._args = config, entrypoint, args
        self._max_replacements = max_replacements
        self._workers: list[_Worker] = []
        self._finished = False  # a worker (of any node) exited 0: training is done
        self._store_lost = False

    def run(self) -> int:
        c = self._config
        rendezvous = rendezvous_registry.get_rendezvous_handler(
            RendezvousParameters(
                backend=c.rdzv_backend,
                endpoint=c.rdzv_endpoint,
                run_id=c.run_id,
                min_nodes=c.min_nodes,
                max_nodes=c.max_nodes,
                local_addr=c.local_addr,
                **c.rdzv_configs,
            )
        )
        info = rendezvous.next_rendezvous()  # node 0's handler hosts the workers' store
        assert info.bootstrap_store_info is not None
        self._node, self._world = info.rank, info.world_size * c.nproc_per_node
        self._address = (
            info.bootstrap_store_info.master_addr,
            info.bootstrap_store_info.master_port,
        )
        self._store = dist.TCPStore(*self._address, is_master=False)
        first = self._node * c.nproc_per_node
        try:
            self._start([(first + i, i) for i in range(c.nproc_per_node)], attempt=0)
            self._store.add(f"{_KEYS}/members", c.nproc_per_node)
            while any(w.code is None for w in self._workers) or not self._job_over():
                time.sleep(c.monitor_interval)
                self._poll()
        except SignalException as e:
            _say(f"{e.sigval.name}: stopping every worker")
            for w in self._workers:
                w.context.close(e.sigval)
            return 128 + int(e.sigval)
        finally:
            for context in {id(w.context): w.context for w in self._workers}.values():
                context.close()  # its processes are gone: this prints the rest of their output
            rendezvous.shutdown()
        _say("training finished" if self._finished else "no worker finished training")
        return 0 if self._finished else 1

    def _start(self, workers: list[tuple[int, int]], attempt: int) -> None:
        """Start workers ``(id, local rank)`` (replacements when ``attempt`` > 0)."""
        c = self._config
        envs = {
            i: worker_env(
                uid=uid,
                local_rank=local,
                world_size=self._world,
                local_world_size=c.nproc_per_node,
                node=self._node,
                store_address=self._address,
                run_id=c.run_id,
                join=attempt > 0,
                attempt=attempt,
            )
            for i, (uid, local) in enumerate(workers)
        }
        context = start_processes(
            name=c.role,
            entrypoint=self._entrypoint,
            args={
                i: tuple(macros.substitute(self._args, str(w[1]))) for i, w in enumerate(workers)
            },
            envs=envs,
            logs_specs=c.logs_specs,  # type: ignore[arg-type]
            log_line_prefixes={i: f"[rank{uid}]:" for i, (uid, _) in enumerate(workers)},
            numa_options=c.numa_options,
        )
        assert isinstance(context, SubprocessContext)
        for i, (uid, local) in enumerate(workers):
            process = context.subprocess_handlers[i].proc
            self._workers.append(_Worker(uid, local, context, process, admitted=attempt == 0))

    def _poll(self) -> None:
        live = [w for w in self._workers if w.code is None]
        for w in live:
            if not w.admitted and self._ask(functools.partial(self._admitted, w.uid), False):
                w.admitted = True
                self._ask(lambda: self._store.add(f"{_KEYS}/members", 1), 0)
        for w in live:
            code = w.process.poll()
            if code is None:
                continue
            w.code = code
            if w.admitted:
                self._ask(lambda: self._store.add(f"{_KEYS}/members", -1), 0)
            if code == 0:
                self._finished = True
                self._ask(lambda: self._store.set(f"{_KEYS}/finished", "1"), None)
                continue
            _say(f"rank {w.uid} (pid {w.process.pid}) {_ended(code)}")
            if not self._finished:
                self._replace(w)
        if self._job_over():
            for w in self._workers:
                if w.code is None and not w.admitted:
                    w.stopped = True
                    w.context.close(signal.SIGTERM, timeout=_STOP_S)

    def _admitted(self, uid: int) -> bool:
        return self._store.check([admitted_key(PREFIX, uid)])

    def _job_over(self) -> bool:
        """Training finished somewhere, or no member is left anywhere (or the store is lost
        and none is left here)."""
        self._finished = self._finished or self._ask(
            lambda: self._store.check([f"{_KEYS}/finished"]), False
        )
        members = self._ask(lambda: self._store.add(f"{_KEYS}/members", 0), None)
        if members is None:
            members = sum(w.admitted and w.code is None for w in self._workers)
        return self._finished or members <= 0

    def _replace(self, dead: _Worker) -> None:
        """Start a worker in ``dead``'s place (its local rank, a new id) if the job allows."""
        if not self._max_replacements:
            return
        n = self._ask(lambda: self._store.add(f"{_KEYS}/replacements", 1), None)
        if n is None or n > self._max_replacements:
            return
        uid = self._world + n - 1
        _say(f"starting rank {uid} in place of rank {dead.uid} (replacement {n})")
        self._start([(uid, dead.local_rank)], attempt=n)

    def _ask(self, question: Callable[[], T], otherwise: T) -> T:
        """The store's answer; ``otherwise`` once the store is lost (its host is gone)."""
        if self._store_lost:
            return otherwise
        try:
            return question()
        except dist.DistError as e:
            self._store_lost = True
            _say(f"the store is lost ({type(e).__name__}); no more replacements")
            return otherwise


def _ended(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with {code}"


def _say(text: str) -> None:
    print(f"fddp.run: {text}", file=sys.stderr, flush=True)
