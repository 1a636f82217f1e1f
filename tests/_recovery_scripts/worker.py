"""One member of a recoverable training run that may kill, stop or slow itself inside a step.

``python worker.py RANK WORLD PORT OUT`` trains a small MLP with ``fddp.recoverable`` for
``STEPS`` steps over a ``TCPStore`` client of ``127.0.0.1:PORT`` (hosted by the test), and
writes its final parameters, optimizer state and what the step reported to ``OUT``.
``python -m fddp.run ... worker.py DIR`` (or ``python worker.py DIR``, a world of one) takes
the store, its id and the world size from the launcher and writes ``DIR/<id>.pt``; a
``RankFailureError`` is written there too (as ``error``) before it exits 1.

``FDDP_TEST_KILL="rank:step:point,..."`` (read here only, by the test hook) makes member
``rank`` SIGKILL itself in step ``step`` at ``point``: ``forward`` (in the forward pass, no
all-reduce launched yet), ``backward`` (in the last micro-batch's backward pass of the first
layer, after the first bucket's all-reduce was launched: the others are inside it), ``tail``
(in the optimizer update, after the all-reduce finished), ``stop`` (SIGSTOP in the forward
pass: a hung rank) or ``slow`` (a sleep of ``FDDP_TEST_SLOW_S`` seconds in the forward pass: a
straggler). The hook is a custom operator in the loss, so it runs inside the compiled step.
``FDDP_TEST_KILL_IN_REGROUP=rank`` makes member ``rank`` SIGKILL itself as soon as it has
registered as a survivor of generation 0: a second failure while the others wait for the roster
and form the next group with it.

More settings, all read here: ``FDDP_TEST_TIMEOUT`` and ``FDDP_TEST_SETTLE`` (seconds),
``FDDP_TEST_DONATE`` (donate the state), ``FDDP_TEST_MICRO`` (micro-batches; set, member 0
also records how the step refuses sharded and DiLoCo state), ``FDDP_TEST_INVARIANT``
(invariant mode), ``FDDP_TEST_JOIN`` (start as a replacement), ``FDDP_TEST_WAIT_JOIN_AT``
(every member waits for the replacement to register before that step), ``FDDP_TEST_ADMIT_EVERY``
(recoverable's ``admit_every``), ``FDDP_TEST_DROPOUT`` (dropout after the first layer),
``FDDP_TEST_VERBOSE`` (a line per step), ``FDDP_TEST_WAIT_JOINS`` (how many registrations
``FDDP_TEST_WAIT_JOIN_AT`` waits for, default 1), ``FDDP_TEST_PAUSE_AT`` (every member waits
before that step until the file ``go`` exists beside its output). Each member writes its
committed step count to ``<id>.step`` beside its output after each step.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _recovery_scripts.common import (
    LR,
    MICRO_BATCHES,
    STEPS,
    WEIGHT_DECAY,
    global_batch,
    initial_params,
)

import fddp

_now = {"step": -1, "counts": {}, "targets": {}}


def _kills() -> dict[tuple[int, int], str]:
    spec = os.environ.get("FDDP_TEST_KILL", "")
    out = {}
    for item in filter(None, spec.split(",")):
        rank, step, point = item.split(":")
        out[(int(rank), int(step))] = point
    return out


KILLS = _kills()
LAUNCHED = len(sys.argv) == 2  # worker.py DIR: the store and the id come from the launcher
UID = int(os.environ.get("RANK", "0")) if LAUNCHED else int(sys.argv[1])
JOIN = bool(os.environ.get("FDDP_TEST_JOIN"))  # a replacement, started later


def _hit(point: str) -> None:
    wanted = KILLS.get((UID, _now["step"]))
    if wanted is None or (
        wanted != point and not (wanted in ("stop", "slow") and point == "forward")
    ):
        return
    counts = _now["counts"]
    counts[point] = counts.get(point, 0) + 1
    if counts[point] != _now["targets"].get(point, 1):
        return
    if wanted == "slow":
        time.sleep(float(os.environ["FDDP_TEST_SLOW_S"]))
        return
    os.kill(os.getpid(), signal.SIGSTOP if wanted == "stop" else signal.SIGKILL)


@torch.library.custom_op("fddp_test::kill_point", mutates_args=())
def _kill_point(x: torch.Tensor, point: str) -> torch.Tensor:
    _hit(point)
    return x.clone()


@_kill_point.register_fake
def _(x: torch.Tensor, point: str) -> torch.Tensor:
    return torch.empty_like(x)


class _KillPoint(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, point: str) -> torch.Tensor:
        return _kill_point(x, point)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _kill_point(grad, "backward"), None


def kill_point(x: torch.Tensor, point: str) -> torch.Tensor:
    return _KillPoint.apply(x, point)


def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    h = torch.tanh(kill_point(batch["x"] @ params["w1"] + params["b1"], "forward"))
    if os.environ.get("FDDP_TEST_DROPOUT"):  # keyed per micro-batch in invariant mode
        h = F.dropout(h, p=0.25, training=True)
    out = h @ params["w2"] + params["b2"]
    return F.mse_loss(out, batch["y"])


def _kill_in_regroup(store: dist.Store) -> None:
    """SIGKILL this process once it has registered as a survivor of generation 0."""
    while not store.check([f"fddp-recoverable/g0/in/{UID}"]):
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)


def _store() -> dist.Store | None:
    """The test's store (None under the launcher, whose store recoverable finds itself)."""
    if LAUNCHED:
        return None
    port = int(sys.argv[3])
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out = Path(sys.argv[1]) / f"{UID}.pt" if LAUNCHED else Path(sys.argv[4])
    store = _store()
    placement = {} if LAUNCHED else {"store": store, "rank": UID, "world_size": int(sys.argv[2])}
    if store is None and "MASTER_PORT" in os.environ:  # a client of the launcher's store
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        )
    if os.environ.get("FDDP_TEST_KILL_IN_REGROUP") == str(UID):
        threading.Thread(target=_kill_in_regroup, args=(store,), daemon=True).start()
    micro_batches = int(os.environ.get("FDDP_TEST_MICRO", MICRO_BATCHES))
    inner = fddp.optim.adamw(LR, weight_decay=WEIGHT_DECAY)

    def update(grads, state, params):
        # after every bucket's wait: the hook's input needs all the reduced gradients
        mark = kill_point(torch.stack([g.sum() for g in grads.values()]).sum(), "tail")
        grads = {k: v + 0 * mark for k, v in grads.items()}
        return inner.update(grads, state, params)

    opt = fddp.optim.GradientTransformation(inner.init, update)
    rstep = fddp.recoverable(
        loss_fn,
        opt,
        **placement,
        micro_batches=micro_batches,
        timeout=float(os.environ.get("FDDP_TEST_TIMEOUT", "3")),
        compile_timeout=60.0,  # the first step of each generation (a test waits no longer)
        settle=float(os.environ.get("FDDP_TEST_SETTLE", "1.0")),
        bucket_cap_mb=1e-4,
        first_bucket_cap_mb=1e-4,
        join=JOIN or None,
        invariant=bool(os.environ.get("FDDP_TEST_INVARIANT")),
        donate=bool(os.environ.get("FDDP_TEST_DONATE")),
        admit_every=int(os.environ.get("FDDP_TEST_ADMIT_EVERY", "1")),
    )
    torch.manual_seed(0)  # every member's generator alike (a replacement's is handed over)
    params = initial_params()
    opt_state = opt.init(params)
    wait_at = int(os.environ.get("FDDP_TEST_WAIT_JOIN_AT", "-1"))
    joins = os.environ.get("FDDP_TEST_WAIT_JOINS", "1")
    pause_at = int(os.environ.get("FDDP_TEST_PAUSE_AT", "-1"))
    progress = out.parent / f"{UID}.step"
    try:
        for step in range(rstep.step, STEPS):
            if step == wait_at:  # every member waits here until the replacements registered
                store.wait([f"fddp-recoverable/join/{joins}"])  # the key of the last of them
            if step == pause_at:
                while not (out.parent / "go").exists():
                    time.sleep(0.01)
            _now["step"], _now["counts"] = step, {}
            k = -(-micro_batches // len(rstep.members))
            _now["targets"] = {"backward": k}
            params, opt_state, loss = rstep(params, opt_state, global_batch(step, micro_batches))
            progress.write_text(str(rstep.step))
            if os.environ.get("FDDP_TEST_VERBOSE"):
                print(f"{UID}: step {step} gen {rstep.generation} {time.time():.2f}", flush=True)
    except fddp.RankFailureError as error:
        torch.save({"error": str(error), "recovered_steps": rstep.recovered_steps}, out)
        raise
    refused = {}
    if UID == 0 and os.environ.get("FDDP_TEST_MICRO"):
        batch = global_batch(0, micro_batches)
        sharded = fddp.optim.shard_state(fddp.optim.adamw(LR))
        low_comm = fddp.LowCommState(torch.zeros((), dtype=torch.int64), (), (), ())
        for name, state in (("shard_state", sharded.init(params)), ("diloco", low_comm)):
            try:
                rstep(params, state, batch)
            except ValueError as e:
                refused[name] = str(e)
    torch.save(
        {
            "refused": refused,
            "params": params,
            "opt_state": opt_state,
            "loss": loss,
            "generation": rstep.generation,
            "members": rstep.members,
            "recovered_steps": rstep.recovered_steps,
            "lost": [r.lost for r in rstep.recoveries],
            "seconds": [r.seconds for r in rstep.recoveries],
            "rng": torch.get_rng_state(),
        },
        out,
    )
    rstep.close()


if __name__ == "__main__":
    main()
