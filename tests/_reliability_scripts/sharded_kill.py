"""Two ranks save a sharded checkpoint, then save again while one of them is SIGKILLed.

``python sharded_kill.py MODE DIR`` as one rank of 2 (torchrun environment);
test_checkpoint_sharded.py launches it. The ranks take 3 Adam steps with ``shard_state``
(moments differ per rank), save ``DIR/ckpt`` (the previous checkpoint) and ``DIR/reference``
(the same state, to compare with), take 3 more steps and save again, during which one rank
kills itself with SIGKILL from inside DCP's ``FileSystem.create_stream`` (as the OOM killer
would), at a place ``MODE`` fixes:

- ``open``: rank 1, as it opens its shard file, saving to ``DIR/ckpt``;
- ``write``: rank 0 (the coordinator), at the write that would take its shard file past
  ``KILL_AFTER_BYTES``, saving to ``DIR/ckpt``;
- ``new``: a world of one (run it without the torchrun environment): the process, at that
  write, saving its first checkpoint to ``DIR/new``.

The surviving rank prints ``fddp-kill: {"type": ..., "rank_failure": ..., "message": ...}``
for the exception ``save_sharded`` raised (``"type": null`` if it returned) and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

import fddp
import fddp.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_checkpoint import _FullDisk

KILL_AFTER_BYTES = 3000
VICTIM = {"open": 1, "write": 0}


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1.0, 1.0, 3001), "b": torch.zeros(7)}


def optimizer():
    return optim.shard_state(optim.adam(0.01))


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KillAfter(_FullDisk):
    """A file that SIGKILLs this process when a write would pass ``room`` bytes."""

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError:
            sigkill()
            raise


def kill_in_shard_file(mode: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, stream_mode):
        shard = "w" in stream_mode and str(path).endswith(".distcp")
        if shard and mode == "open":
            sigkill()  # before the file is created or truncated
        with real(self, path, stream_mode) as stream:
            yield _KillAfter(stream, KILL_AFTER_BYTES) if shard else stream

    FileSystem.create_stream = create_stream


def main(mode: str, directory: Path) -> None:
    if mode == "new":
        kill_in_shard_file(mode)
        fddp.save_sharded(directory / "new", {"params": params(), "step": 0})
        raise AssertionError("save_sharded returned: the kill did not happen")
    fddp.init(timeout=120)  # the ranks' imports may take long on a busy machine
    rank = fddp.rank()
    opt = optimizer()

    @fddp.data_parallel(trace=False)
    def step(p, s, x):
        grads = fddp.grad(lambda p: ((p["w"] * x).sum() + p["b"].sum() * x.mean()) ** 2)(p)
        updates, s = opt.update(grads, s, p)
        return optim.apply_updates(p, updates), s

    p = params()
    s = fddp.data_parallel(lambda p: opt.init(p), trace=False)(p)
    for i in range(6):
        if i == 3:
            fddp.save_sharded(directory / "ckpt", {"params": p, "opt": s, "step": i})
            fddp.save_sharded(directory / "reference", {"params": p, "opt": s, "step": i})
        p, s = step(p, s, torch.linspace(0.0, 1.0, 3001) * (i + 1 + rank))
    if rank == VICTIM[mode]:
        kill_in_shard_file(mode)
    outcome: dict = {"type": None, "rank_failure": False, "message": ""}
    try:
        fddp.save_sharded(directory / "ckpt", {"params": p, "opt": s, "step": 6})
    except Exception as e:
        outcome = {
            "type": type(e).__name__,
            "rank_failure": isinstance(e, fddp.RankFailureError),
            "message": str(e).splitlines()[0],
        }
    print("fddp-kill: " + json.dumps(outcome), flush=True)
    os._exit(0)  # the process group is broken: skip its shutdown


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
