"""A resumed run builds the buckets of the run it resumes: the default bucket cap comes from
measured link and compute figures, which differ from run to run (a 6 MiB model measured caps of
2.0 to 8.2 MiB in four runs); on 3 ranks another bucket layout changes the summation order, so
the checkpoint carries the figures and the resumed run is bitwise the uninterrupted one.

Job A trains STEPS steps and checkpoints after SAVE_AT (with ``fddp.save`` and with
``fddp.save_sharded``); jobs B and C are new processes that load one checkpoint each and train
the remaining steps, as a job killed after the checkpoint and restarted would.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from _dist import run_ranks
from _models import mlp_step, regression_batch

import fddp
import fddp.optim as optim

SIZES = (512, 1024, 1024, 8)  # 1.6 M parameters: 6.3 MiB of gradients, a few buckets
STEPS, SAVE_AT = 4, 2
WORLD = 3


def _setup():
    torch.manual_seed(0)
    opt = optim.adamw(1e-3)
    step, params = mlp_step(opt, SIZES)
    return fddp.data_parallel(step), {"params": params, "opt": opt.init(params)}


def _batch(i: int) -> dict:
    return regression_batch(1000 * i + fddp.rank(), 8, SIZES[0], SIZES[-1])


def _digest(params: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(directory: str, resume: str | None) -> dict:
    pstep, state = _setup()
    start = 0
    if resume == "save":
        state = fddp.load(os.path.join(directory, "ckpt.pt"), like=state)
        start = SAVE_AT
    elif resume == "save_sharded":
        state = fddp.load_sharded(os.path.join(directory, "sharded"), state)
        start = SAVE_AT
    params, opt_state = state["params"], state["opt"]
    for i in range(start, STEPS):
        params, opt_state, _ = pstep(params, opt_state, _batch(i))
        if resume is None and i + 1 == SAVE_AT:
            fddp.save(os.path.join(directory, "ckpt.pt"), {"params": params, "opt": opt_state})
            fddp.save_sharded(
                os.path.join(directory, "sharded"), {"params": params, "opt": opt_state}
            )
    plan = pstep.schedule(params, opt_state, _batch(0))
    return {"cap": plan.bucket_cap, "buckets": len(plan.buckets), "digest": _digest(params)}


@pytest.mark.timeout(400)
def test_a_resumed_three_rank_run_is_bitwise_the_uninterrupted_one(tmp_path):
    directory = os.fspath(tmp_path)
    original = run_ranks(_train, WORLD, directory, None, timeout=180)
    assert "chosen by the cost model" in original[0]["cap"]
    assert original[0]["buckets"] > 1, original[0]  # the cap decides the layout
    for resume in ("save", "save_sharded"):
        resumed = run_ranks(_train, WORLD, directory, resume, timeout=180)
        for rank in range(WORLD):
            assert resumed[rank]["cap"] == original[rank]["cap"], resume  # figures and choice
            assert resumed[rank]["digest"] == original[rank]["digest"], resume
