"""One member of a recoverable training run that may kill or stop itself inside a step.

``python worker.py RANK WORLD PORT OUT`` trains a small MLP with ``fddp.recoverable`` for
``STEPS`` steps over a ``TCPStore`` client of ``127.0.0.1:PORT`` (hosted by the test), and
writes its final parameters, optimizer state and what the step reported to ``OUT``.

``FDDP_TEST_KILL="rank:step:point,..."`` (read here only, by the test hook) makes member
``rank`` SIGKILL itself in step ``step`` at ``point``: ``forward`` (in the forward pass, no
all-reduce launched yet), ``backward`` (in the last micro-batch's backward pass of the first
layer, after the first bucket's all-reduce was launched: the others are inside it), ``tail``
(in the optimizer update, after the all-reduce finished) or ``stop`` (SIGSTOP in the forward
pass: a hung rank). The hook is a custom operator in the loss, so it runs inside the
compiled step.

More settings, all read here: ``FDDP_TEST_TIMEOUT`` and ``FDDP_TEST_SETTLE`` (seconds),
``FDDP_TEST_DONATE`` (donate the state), ``FDDP_TEST_MICRO`` (micro-batches; set, member 0
also records how the step refuses sharded and DiLoCo state), ``FDDP_TEST_INVARIANT``
(invariant mode), ``FDDP_TEST_JOIN`` (start as a replacement), ``FDDP_TEST_WAIT_JOIN_AT``
(every member waits for the replacement to register before that step), ``FDDP_TEST_ADMIT_EVERY``
(recoverable's ``admit_every``), ``FDDP_TEST_VERBOSE`` (a line per step).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
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
UID = int(sys.argv[1])
JOIN = bool(os.environ.get("FDDP_TEST_JOIN"))  # a replacement, started later


def _hit(point: str) -> None:
    wanted = KILLS.get((UID, _now["step"]))
    if wanted is None or (wanted != point and not (wanted == "stop" and point == "forward")):
        return
    counts = _now["counts"]
    counts[point] = counts.get(point, 0) + 1
    if counts[point] < _now["targets"].get(point, 1):
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
    h = kill_point(batch["x"] @ params["w1"] + params["b1"], "forward")
    out = torch.tanh(h) @ params["w2"] + params["b2"]
    return F.mse_loss(out, batch["y"])


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    world, port, out = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
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
        store=store,
        rank=UID,
        world_size=world,
        micro_batches=micro_batches,
        timeout=float(os.environ.get("FDDP_TEST_TIMEOUT", "3")),
        settle=float(os.environ.get("FDDP_TEST_SETTLE", "1.0")),
        bucket_cap_mb=1e-4,
        first_bucket_cap_mb=1e-4,
        join=JOIN,
        invariant=bool(os.environ.get("FDDP_TEST_INVARIANT")),
        donate=bool(os.environ.get("FDDP_TEST_DONATE")),
        admit_every=int(os.environ.get("FDDP_TEST_ADMIT_EVERY", "1")),
    )
    params = initial_params()
    opt_state = opt.init(params)
    wait_at = int(os.environ.get("FDDP_TEST_WAIT_JOIN_AT", "-1"))
    for step in range(rstep.step, STEPS):
        if step == wait_at:  # every member waits here until the replacement has registered
            store.wait(["fddp-recoverable/join/1"])  # the key of the first registration
        _now["step"], _now["counts"] = step, {}
        k = -(-micro_batches // len(rstep.members))
        _now["targets"] = {"backward": k}
        params, opt_state, loss = rstep(params, opt_state, global_batch(step, micro_batches))
        if os.environ.get("FDDP_TEST_VERBOSE"):
            print(f"{UID}: step {step} gen {rstep.generation} {time.time():.2f}", flush=True)
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
        },
        out,
    )
    rstep.close()


if __name__ == "__main__":
    main()
