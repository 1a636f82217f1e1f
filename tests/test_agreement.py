"""Ranks that disagree fail alike, before anything is lost: the per-call agreement covers the
step's options and what was called (a step, schedule()), as well as the arguments; a refused
call leaves donated arguments as they were; steps made again and again share one side group;
pending outputs complete before anything reads their memory. 2 gloo ranks, one spawn."""

from __future__ import annotations

import copy
import errno
import functools
import os

import numpy as np
import torch
import torch.distributed as dist
from _dist import raised, run_checks
from _models import mlp_step, regression_batch

import fddp
import fddp.optim as optim
from fddp._base._errors import UsageValueError
from fddp._ranks import _agree

SIZES = (6, 16, 16, 16, 3)
SMALL_BUCKETS = 300 / 2**20  # a few Linear layers per bucket: several buckets


def _mlp_step():
    opt = optim.sgd(0.1, momentum=0.9)
    step, params = mlp_step(opt, SIZES)
    return step, params, opt.init(params)


def _batch(rows: int = 4) -> dict:
    return regression_batch(fddp.rank(), rows, SIZES[0], SIZES[-1])


def check_bucket_cap_differs() -> tuple[str, str]:
    step, params, state = _mlp_step()
    pstep = fddp.data_parallel(step, bucket_cap_mb=None if fddp.rank() == 0 else 5.0)
    return raised(lambda: pstep(params, state, _batch()))


def check_schedule_on_rank_0_only() -> tuple[str, str]:
    step, params, state = _mlp_step()
    pstep = fddp.data_parallel(step)
    if fddp.rank() == 0:
        return raised(lambda: print(pstep.schedule(params, state, _batch())))
    return raised(lambda: pstep(params, state, _batch()))


def check_comm_dtype_on_one_rank_eagerly() -> tuple[str, str]:
    step, params, state = _mlp_step()
    dtype = torch.bfloat16 if fddp.rank() == 1 else None
    pstep = fddp.data_parallel(step, trace=False, comm_dtype=dtype)
    return raised(lambda: pstep(params, state, _batch()))


def check_refused_call_leaves_donated_arguments() -> dict:
    """A batch of another shape on rank 1 only: rank 0 runs its cached program, whose forward
    would write the new buffers into the donated old ones before the first collective."""
    params = {"w": torch.ones(6, 3)}
    buffers = {"mean": torch.zeros(6)}

    @functools.partial(fddp.data_parallel, donate_argnums=(0, 1), check_replicas=False)
    def step(params, buffers, x):
        mean = buffers["mean"] * 0.9 + 0.1 * x.mean(0)  # BatchNorm-like, in the forward
        grads = fddp.grad(lambda p: ((x @ p["w"]) ** 2).mean())(params)
        return {"w": params["w"] - 0.1 * fddp.pmean(grads)["w"]}, {"mean": mean}

    params, buffers = step(params, buffers, torch.ones(4, 6))
    before = {k: v.clone() for k, v in {**params, **buffers}.items()}
    rows = 4 if fddp.rank() == 0 else 5
    outcome = raised(lambda: step(params, buffers, torch.ones(rows, 6)))
    after = {**params, **buffers}
    return {
        "outcome": outcome,
        "unchanged": sorted(before) == sorted(after)
        and all(torch.equal(before[k], after[k]) for k in before),
    }


def _threads_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def check_overlap_steps_share_one_side_group() -> dict:
    step, params, state = _mlp_step()
    counts = []
    for _ in range(8):
        pstep = fddp.data_parallel(
            step, overlap_steps=True, bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS
        )
        p, s, _ = pstep(params, state, _batch())
        fddp.block_until_ready(pstep(p, s, _batch()))
        counts.append(_threads_and_fds())
    return {"threads": [t for t, _ in counts], "fds": [f for _, f in counts]}


def check_pending_outputs_complete_before_their_memory_is_read() -> dict:
    step, params, state = _mlp_step()
    kw = dict(bucket_cap_mb=SMALL_BUCKETS, first_bucket_cap_mb=SMALL_BUCKETS)
    pstep = fddp.data_parallel(step, overlap_steps=True, **kw)
    reference = fddp.data_parallel(step, **kw)(params, state, _batch())[0]

    def pending_output() -> torch.Tensor:
        out = pstep(params, state, _batch())[0]["0.weight"]
        assert type(out) is not torch.Tensor, "the first layer's update must be deferred"
        return out

    expected = reference["0.weight"]
    via_dlpack = torch.from_numpy(np.from_dlpack(pending_output()).copy())
    copied = copy.deepcopy(pending_output())
    shared = pending_output()
    shared.share_memory_()
    parameter = raised(lambda: torch.nn.Parameter(pending_output()))
    return {
        "dlpack": torch.equal(via_dlpack, expected),
        "deepcopy": type(copied) is torch.Tensor and torch.equal(copied, expected),
        "shared": shared.is_shared() and torch.equal(shared, expected),
        "parameter": parameter,
        "parameter_of_finished": torch.equal(
            torch.nn.Parameter(fddp.block_until_ready(pending_output())).detach(), expected
        ),
    }


def check_capture_fails_on_rank_1_only() -> tuple[str, str]:
    """Rank 1's step cannot be captured (it raises while tracing); rank 0's can."""
    step, params, state = _mlp_step()

    def failing_on_rank_1(params, state, batch):
        if fddp.rank() == 1:
            raise UsageValueError("this step cannot be built on rank 1")
        return step(params, state, batch)

    pstep = fddp.data_parallel(failing_on_rank_1)
    return raised(lambda: pstep(params, state, _batch()))


def check_raise_everywhere() -> dict:
    """_agree.raise_everywhere and gather_or_raise with a failure on rank 1, on both ranks,
    on no rank (lines that differ, then lines that agree)."""
    rank = dist.get_rank()
    full = OSError(errno.ENOSPC, "No space left on device", f"/ckpt/rank{rank}")
    out = {
        "rank_1": raised(lambda: _agree.raise_everywhere(full if rank == 1 else None)),
        "both": raised(lambda: _agree.raise_everywhere(ValueError(f"bad on {rank}"))),
        "differ": str(_agree.raise_everywhere(None, None, [("the batch", f"{rank + 4} rows")])),
        "agree": _agree.raise_everywhere(None, None, [("the batch", "4 rows")]),
        "values": _agree.gather_or_raise(None, {"rank": rank}),
    }
    try:
        _agree.gather_or_raise(full if rank == 1 else None, rank)
    except OSError as e:
        out["errno"] = (e.errno, e.filename, str(e))
    return out


CHECKS = {
    "capture_rank_1": check_capture_fails_on_rank_1_only,
    "raise_everywhere": check_raise_everywhere,
    "bucket_cap": check_bucket_cap_differs,
    "schedule_on_rank_0": check_schedule_on_rank_0_only,
    "comm_dtype_eager": check_comm_dtype_on_one_rank_eagerly,
    "donated": check_refused_call_leaves_donated_arguments,
    "side_group": check_overlap_steps_share_one_side_group,
    "pending": check_pending_outputs_complete_before_their_memory_is_read,
}


@functools.cache
def _results():
    return run_checks(CHECKS, timeout=240)


def test_different_bucket_caps_are_an_error_on_every_rank_before_the_link_is_measured():
    for error, message in _results()["bucket_cap"]:
        assert error == "ScheduleMismatchError", message
        assert "ranks built the step differently: option bucket_cap_mb is 5.0 on rank 1" in message


def test_schedule_on_one_rank_before_the_first_call_is_an_error_on_every_rank():
    for error, message in _results()["schedule_on_rank_0"]:
        assert error == "ScheduleMismatchError", message
        assert "rank 1 called the step while rank 0 called schedule()" in message


def test_comm_dtype_on_one_rank_of_an_eager_step_is_an_error_on_every_rank():
    for error, message in _results()["comm_dtype_eager"]:
        assert error == "ScheduleMismatchError", message
        assert "option comm_dtype is torch.bfloat16 on rank 1 but None on rank 0" in message


def test_a_refused_call_leaves_donated_arguments_as_they_were():
    for rank in _results()["donated"]:
        assert rank["outcome"][0] == "ScheduleMismatchError", rank["outcome"]
        assert "argument leaf [2]" in rank["outcome"][1]
        assert rank["unchanged"]


def test_steps_made_again_and_again_do_not_leak_threads_or_files():
    for rank in _results()["side_group"]:
        # the first step makes the side group (gloo threads, sockets); later ones reuse it
        assert rank["threads"][-1] - rank["threads"][1] <= 1, rank["threads"]
        assert rank["fds"][-1] - rank["fds"][1] <= 2, rank["fds"]


def test_pending_outputs_complete_before_dlpack_deepcopy_and_shared_memory_read_them():
    for rank in _results()["pending"]:
        assert rank["dlpack"] and rank["deepcopy"] and rank["shared"]
        error, message = rank["parameter"]
        assert error == "TypeError" or "TypeError" in error, rank["parameter"]
        assert "fddp.block_until_ready" in message
        assert rank["parameter_of_finished"]


def test_a_capture_error_on_one_rank_is_raised_on_every_rank_as_that_ranks():
    (error_0, message_0), (error_1, message_1) = _results()["capture_rank_1"]
    assert error_1 == error_0, (error_0, error_1)
    assert "this step cannot be built on rank 1" in message_1
    assert message_0 == message_1 + " (on rank 1)", (message_0, message_1)


def test_raise_everywhere_raises_the_failing_ranks_error_on_every_rank():
    for rank, out in enumerate(_results()["raise_everywhere"]):
        note = " (on rank 1)" if rank == 0 else ""
        path = "'/ckpt/rank1'"
        assert out["rank_1"] == ("OSError", f"[Errno 28] No space left on device{note}: {path}")
        assert out["both"] == ("ValueError", f"bad on {rank}")
        assert out["differ"] == "the batch is 5 rows on rank 1 but 4 rows on rank 0"
        assert out["agree"] is None
        assert out["values"] == [{"rank": 0}, {"rank": 1}]
        assert out["errno"] == (errno.ENOSPC, "/ckpt/rank1", out["rank_1"][1])
