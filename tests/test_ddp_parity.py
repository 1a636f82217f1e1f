"""DDP parity: each feature DDP users rely on, in fddp, side by side with its reference.

References: ``torch.nn.parallel.DistributedDataParallel`` on the same model, data and seed, or
single-process training on the global batch where that is what DDP's feature computes (DDP's
``SyncBatchNorm`` refuses CPU tensors; ``join`` does not give the exact global mean). The
2-rank checks run in one spawn and the 4-rank process-group check in another; each check
returns plain values that the tests below compare. Items follow the issue: 1 initial values,
2 buffers and synchronised BatchNorm, 3 gradient accumulation, 4 unused parameters, 5 uneven
inputs, 6 communication hooks, 7 process groups, 8 mixed precision.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import traceback

import _models
import numpy as np
import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ddp_powersgd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import fddp
import fddp.optim as optim
from fddp._accumulate import accumulate_gradients
from fddp._data import lockstep, pad_rows, shard_batches, weighted_pmean
from fddp._powersgd import PowerSGDState, powersgd, powersgd_init
from fddp._precision import cast_floating, mixed_precision
from fddp._replicas import ReplicaMismatchError
from fddp._schedule._fingerprint import ScheduleMismatchError
from fddp._syncbn import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm, sync_buffers

WORLD = 2
SIZES = (16, 32, 32, 4)
TOL = {"rtol": 1e-5, "atol": 1e-5}

ACCUM_K = 3
PSGD_SIZES = (32, 64, 64, 8)
PSGD_RANK = 2
PSGD_START = 3
PSGD_STEPS = 12
PSGD_EPSILON = 1e-8
PSGD_LOSS_RTOL = 1e-4  # same initial Q as DDP: the trajectories agree to float rounding
PSGD_OWN_SEED_LOSS_RTOL = 0.1  # fddp's own initial Q: another projection, a loss within 10 %
BYTES_RATIO_MIN = 5.0


# --- helpers -----------------------------------------------------------------------------------


def _flat(tree) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in optree.tree_leaves(tree)])


def _named(module: nn.Module) -> dict:
    """Parameters by name, flattened in the same (sorted-key) order as fddp's params dicts."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def _global_mean(x: torch.Tensor) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def _from_rank0(tree):
    """Rank 0's values of ``tree`` on every rank (a plain broadcast, outside fddp)."""
    leaves, spec = optree.tree_flatten(optree.tree_map(torch.clone, tree))
    for leaf in leaves:
        dist.broadcast(leaf, 0)
    return optree.tree_unflatten(spec, leaves)


def _sgd_step(loss_fn, opt, reduce=fddp.pmean):
    """``step(params, opt_state, *batch)``: grads reduced with ``reduce``, loss averaged alike."""

    def step(params, opt_state, *batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(reduce(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, reduce(loss)

    return step


def _mse_setup(sizes=SIZES, seed=0):
    model = _models.mlp(sizes, seed=seed)
    apply = fddp.functional(model)

    def loss_fn(params, x, y):
        return F.mse_loss(apply(params, {}, x), y)

    return model, loss_fn


def _batch(step: int, rows: int, sizes=SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    b = _models.regression_batch(step, rows, sizes[0], sizes[-1])
    return b["x"], b["y"]


def _local(step: int, rows: int, sizes=SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step, rows * fddp.world_size(), sizes)
    return fddp.shard(x), fddp.shard(y)


def _ddp_step(ddp, opt, x, y) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return loss


def _ddp_train_step(ddp, opt, x, y) -> float:
    return _global_mean(_ddp_step(ddp, opt, x, y))


def _attempt(out: dict, name: str, fn) -> None:
    """``out[name] = fn()`` or its traceback, so one failing check does not hide the others.

    Each check fails or passes alike on every rank, so no rank is left waiting in a collective.
    """
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc()}


def _result(runs: list[dict], name: str) -> list:
    values = [run[name] for run in runs]
    for r, value in enumerate(values):
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"{name} raised on rank {r}:\n{value['error']}", pytrace=False)
    return values


def _assert_steps_close(actual: list, expected: list, what: str, **tol) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m, i=i: f"{what}, step {i + 1}: {m}")


def _assert_ranks_equal(values: list, what: str) -> None:
    for r in range(1, len(values)):
        for a, b in zip(optree.tree_leaves(values[0]), optree.tree_leaves(values[r])):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), f"{what}: rank {r} != 0"


# --- 1. initial values -------------------------------------------------------------------------


def _check_replicas() -> dict:
    r = fddp.rank()
    model, loss_fn = _mse_setup(seed=10 + r)  # every rank starts from different values
    opt = optim.sgd(lr=0.1, momentum=0.9)
    pstep = fddp.data_parallel(_sgd_step(loss_fn, opt))
    out = {}

    same = fddp.state(_mse_setup(seed=0)[0])[0]
    if r == 1:
        same = {**same, "2.weight": same["2.weight"] + 1e-3}
    x, y = _local(0, 4)
    try:
        pstep(same, opt.init(same), x, y)
        out["mismatch"] = None
    except ReplicaMismatchError as e:
        out["mismatch"] = str(e)

    params = fddp.replicate(fddp.state(model)[0])
    ddp = DistributedDataParallel(copy.deepcopy(model))  # broadcasts rank 0's at construction
    out["replicated"] = _flat(params)
    out["ddp_initial"] = _flat(_named(ddp.module))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = opt.init(params)
    out["params"], out["ddp_params"] = [], []
    for s in range(4):
        x, y = _local(s, 4)
        params, state, _ = pstep(params, state, x, y)
        _ddp_train_step(ddp, torch_opt, x, y)
        out["params"].append(_flat(params))
        out["ddp_params"].append(_flat(_named(ddp.module)))
    return out


# --- 2. buffers: broadcast or mean, and synchronised BatchNorm ---------------------------------


def _bn_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def _bn_loss(apply):
    def loss_fn(params, buffers, x, y):
        out, new_buffers = apply(params, buffers, x)
        return F.mse_loss(out, y), new_buffers

    return loss_fn


def _bn_step(loss_fn, opt, reduce, buffer_sync):
    def step(params, opt_state, buffers, x, y):
        (_, new_buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = opt.update(reduce(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, buffer_sync(new_buffers)

    return step


def _floats(buffers: dict) -> dict:
    return {k: v for k, v in buffers.items() if v.is_floating_point()}


def _check_buffers(steps: int = 4) -> dict:
    """fddp's two buffer choices against DDP's broadcast_buffers=True and =False."""
    model = _bn_mlp()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    loss_fn = _bn_loss(fddp.functional(model, return_buffers=True))
    out = {}
    for how, broadcast_buffers in (("broadcast", True), ("mean", False)):
        ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=broadcast_buffers)
        torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        params, buffers = fddp.state(model)
        state = opt.init(params)
        pstep = fddp.data_parallel(
            _bn_step(loss_fn, opt, fddp.pmean, functools.partial(sync_buffers, how=how))
        )
        run = {"params": [], "ddp_params": [], "buffers": [], "ddp_buffers": [], "counts": []}
        for s in range(steps):
            x, y = _local(s, 4)
            params, state, buffers = pstep(params, state, buffers, x, y)
            _ddp_train_step(ddp, torch_opt, x, y)
            ddp_buffers = _floats(dict(ddp.module.named_buffers()))
            # broadcast_buffers=True: DDP broadcasts rank 0's buffers before each forward, so
            # rank 0's are the ones every rank trains with. False: DDP keeps per-rank buffers,
            # whose mean follows the same linear update as fddp's averaged ones.
            reference = _from_rank0(ddp_buffers) if how == "broadcast" else fddp.pmean(ddp_buffers)
            run["params"].append(_flat(params))
            run["ddp_params"].append(_flat(_named(ddp.module)))
            run["buffers"].append(_flat(_floats(buffers)))
            run["ddp_buffers"].append(_flat(reference))
            run["counts"].append(int(buffers["1.num_batches_tracked"]))
        out[how] = run
    return out


def _check_sync_batchnorm(steps: int = 4) -> dict:
    """convert_sync_batchnorm under data_parallel against BatchNorm on the global batch."""
    base = _bn_mlp()
    synced = convert_sync_batchnorm(base)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params, buffers = fddp.state(synced)
    state = opt.init(params)
    pstep = fddp.data_parallel(
        _bn_step(
            _bn_loss(fddp.functional(synced, return_buffers=True)), opt, fddp.pmean, lambda b: b
        )
    )
    ref_step = _bn_step(
        _bn_loss(fddp.functional(base, return_buffers=True)), opt, lambda t: t, lambda b: b
    )
    ref_params, ref_buffers, ref_state = params, buffers, state
    out = {"params": [], "ref_params": [], "buffers": [], "ref_buffers": []}
    for s in range(steps):
        x, y = _batch(s, 8)
        params, state, buffers = pstep(params, state, buffers, fddp.shard(x), fddp.shard(y))
        ref_params, ref_state, ref_buffers = ref_step(ref_params, ref_state, ref_buffers, x, y)
        out["params"].append(_flat(params))
        out["ref_params"].append(_flat(ref_params))
        out["buffers"].append(_flat(buffers))
        out["ref_buffers"].append(_flat(ref_buffers))
    x = _batch(99, 6)[0]
    synced.eval(), base.eval()
    out["eval"] = fddp.functional(synced)(params, buffers, x)
    out["ref_eval"] = fddp.functional(base)(ref_params, ref_buffers, x)
    synced.train(), base.train()
    return out


# --- 3. gradient accumulation ------------------------------------------------------------------


def _check_accumulation(steps: int = 4) -> dict:
    """accumulate_gradients + one pmean against DDP with no_sync() on k-1 microbatches."""
    model, loss_fn = _mse_setup()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.state(model)[0]
    state = opt.init(params)

    @fddp.data_parallel
    def step(params, opt_state, x, y):
        loss, grads = accumulate_gradients(loss_fn, ACCUM_K, batch_argnums=(1, 2))(params, x, y)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    ddp = DistributedDataParallel(copy.deepcopy(model))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    out = {"params": [], "ddp_params": [], "loss": [], "ddp_loss": []}
    for s in range(steps):
        x, y = _local(s, 2 * ACCUM_K)
        params, state, loss = step(params, state, x, y)
        torch_opt.zero_grad()
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(ACCUM_K), y.chunk(ACCUM_K))):
            sync = contextlib.nullcontext() if i == ACCUM_K - 1 else ddp.no_sync()
            with sync:
                micro = F.mse_loss(ddp(xi), yi) / ACCUM_K
                micro.backward()
            total += _global_mean(micro)
        torch_opt.step()
        out["params"].append(_flat(params))
        out["ddp_params"].append(_flat(_named(ddp.module)))
        out["loss"].append(loss.item())
        out["ddp_loss"].append(total)
    x, y = _local(0, 2 * ACCUM_K)
    out["reduced_leaves"] = [
        leaf for c in step.schedule(params, state, x, y).collectives for leaf in c.leaves
    ]
    out["param_leaves"] = len(params)
    return out


# --- 4. unused parameters ----------------------------------------------------------------------


class _Branchy(nn.Module):
    """A trunk, an optional residual branch and a head; ``use_branch`` a bool or a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool | torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if isinstance(use_branch, torch.Tensor):  # the pattern that works per rank: mask
            h = torch.where(use_branch, h + torch.tanh(self.branch(h)), h)
        elif use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _branchy_run(steps, ddp_use_branch, step_arg, fddp_use_branch, *, momentum: float) -> dict:
    """DDP (find_unused_parameters=True) and fddp on _Branchy; ``step_arg(s)`` is passed to the
    fddp step, which turns it into the model's ``use_branch`` with ``fddp_use_branch``."""
    torch.manual_seed(0)
    model = _Branchy()
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.1, momentum=momentum)
    ddp = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)

    @fddp.data_parallel
    def step(params, opt_state, x, y, arg):
        def loss_fn(params):
            return F.mse_loss(apply(params, {}, x, fddp_use_branch(arg)), y)

        grads = fddp.grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    params = fddp.state(model)[0]
    state = opt.init(params)
    out = {"params": [], "ddp_params": [], "branch_moved": []}
    for s in range(steps):
        x, y = _local(s, 4)
        before = params["branch.weight"]
        params, state = step(params, state, x, y, step_arg(s))
        torch_opt.zero_grad()
        F.mse_loss(ddp(x, ddp_use_branch(s)), y).backward()
        torch_opt.step()
        out["params"].append(_flat(params))
        out["ddp_params"].append(_flat(_named(ddp.module)))
        out["branch_moved"].append(not torch.equal(before, params["branch.weight"]))
    out["signatures"] = len(step._cache)
    return out


def _check_unused() -> dict:
    rank = fddp.rank()
    out = {}
    # On some steps, on every rank: the choice is a step argument (one graph per value).
    # Plain SGD: torch.optim skips a parameter whose .grad is None, fddp gives it a zero
    # gradient; both leave it in place only when the optimizer has no momentum.
    _attempt(
        out,
        "some_steps",
        lambda: _branchy_run(
            4, lambda s: s % 2 == 0, lambda s: s % 2 == 0, lambda use: use, momentum=0.0
        ),
    )
    # On some ranks: fddp computes the branch everywhere and masks it with the replica index.
    _attempt(
        out,
        "some_ranks",
        lambda: _branchy_run(
            4, lambda s: rank == 0, lambda s: None, lambda _: fddp.axis_index() == 0, momentum=0.9
        ),
    )

    def python_branch_on_rank():
        try:
            run = _branchy_run(
                1, lambda s: rank == 0, lambda s: None, lambda _: rank == 0, momentum=0.9
            )
        except ScheduleMismatchError as e:
            return {"raised": str(e)}
        return {"raised": None, "params": run["params"][-1]}

    _attempt(out, "python_branch_on_rank", python_branch_on_rank)
    return out


# --- 5. uneven inputs --------------------------------------------------------------------------


def _check_uneven() -> dict:
    """An epoch over a dataset that does not split evenly, against one process on it all."""
    model, loss_fn = _mse_setup()
    apply = fddp.functional(model)
    opt = optim.sgd(lr=0.1, momentum=0.9)

    def masked_loss(params, x, y, mask):
        per_row = ((apply(params, {}, x) - y) ** 2).mean(1)
        return (per_row * mask).sum() / mask.sum().clamp(min=1)

    @fddp.data_parallel
    def step(params, opt_state, x, y, mask):
        loss, grads = fddp.value_and_grad(masked_loss)(params, x, y, mask)
        rows = mask.sum()
        updates, opt_state = opt.update(weighted_pmean(grads, rows), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, weighted_pmean(loss, rows)

    reference = _sgd_step(loss_fn, opt, lambda t: t)
    out = {}
    for n in (23, 17):  # last global batch: 7 rows (4 + 3), then 1 row (1 + 0)
        data_x, data_y = _batch(500 + n, n)
        params = fddp.state(model)[0]
        ref_params, state, ref_state = params, opt.init(params), opt.init(params)
        run = {"rows": [], "params": [], "ref_params": [], "loss": [], "ref_loss": []}
        order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
        for t, idx in enumerate(lockstep(shard_batches(n, 4, shuffle=True, seed=3))):
            (x, y), mask = pad_rows((data_x[idx], data_y[idx]), 4)
            params, state, loss = step(params, state, x, y, mask)
            rows = order[t * 8 : (t + 1) * 8]
            ref_params, ref_state, ref_loss = reference(
                ref_params, ref_state, data_x[rows], data_y[rows]
            )
            run["rows"].append(len(idx))
            run["params"].append(_flat(params))
            run["ref_params"].append(_flat(ref_params))
            run["loss"].append(loss.item())
            run["ref_loss"].append(ref_loss.item())
        out[n] = run
    out["programs"] = len(step._cache)

    short = shard_batches(21, 4)[: 2 if fddp.rank() == 1 else 3]
    try:
        out["steps_before_error"] = sum(1 for _ in lockstep(short))
        out["early_end"] = None
    except ValueError as e:
        out["early_end"] = str(e)
    return out


# --- 6. communication hooks: bf16/fp16 and PowerSGD --------------------------------------------


def _check_low_precision_comm(steps: int = 5) -> dict:
    model, loss_fn = _mse_setup()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    out = {}
    for dtype, hook in (
        (torch.bfloat16, default_hooks.bf16_compress_hook),
        (torch.float16, default_hooks.fp16_compress_hook),
    ):
        ddp = DistributedDataParallel(copy.deepcopy(model))
        # DDP refuses a hook *named* bf16_compress_hook without NCCL; gloo reduces bf16 fine
        ddp.register_comm_hook(hook, _call_hook)
        torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        pstep = fddp.data_parallel(_sgd_step(loss_fn, opt), comm_dtype=dtype)
        params = fddp.state(model)[0]
        state = opt.init(params)
        run = {"params": [], "ddp_params": []}
        for s in range(steps):
            x, y = _local(s, 4)
            params, state, _ = pstep(params, state, x, y)
            _ddp_train_step(ddp, torch_opt, x, y)
            run["params"].append(_flat(params))
            run["ddp_params"].append(_flat(_named(ddp.module)))
        x, y = _local(0, 4)
        run["wire"] = {c.dtype for c in pstep.schedule(params, state, x, y).collectives}
        out[str(dtype)] = run
    return out


def _call_hook(hook, bucket):
    return hook(None, bucket)


def _ddp_initial_qs(params: dict, bucket_shapes: list[tuple[int, ...]]) -> dict:
    """The Q factors DDP's powerSGD_hook draws for a single bucket, keyed like fddp's state.

    The hook seeds torch with ``RandomState(random_seed).randint(1e9)`` and draws one
    ``randn(1, m, r)`` per distinct compressed shape, in bucket order.
    """
    seed = np.random.RandomState(0).randint(1_000_000_000)
    shapes = []
    for shape in bucket_shapes:
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(n, m, PSGD_RANK)
        if len(shape) > 1 and ddp_powersgd._should_compress(n, m, r, 2)[0] and shape not in shapes:
            shapes.append(shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draws = {shape: torch.randn(1, int(np.prod(shape[1:])), PSGD_RANK)[0] for shape in shapes}
    return {f"[{k!r}]": draws[tuple(v.shape)] for k, v in params.items() if tuple(v.shape) in draws}


def _check_powersgd() -> dict:
    """fddp.powersgd against DDP's powerSGD_hook: same rank, start iteration and epsilon."""
    model, loss_fn = _mse_setup(PSGD_SIZES)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_state = ddp_powersgd.PowerSGDState(
        None,
        matrix_approximation_rank=PSGD_RANK,
        start_powerSGD_iter=PSGD_START,
        orthogonalization_epsilon=PSGD_EPSILON,
    )
    bucket_shapes: list[tuple[int, ...]] = []

    def hook(state, bucket):
        if state.iter == PSGD_START and bucket.index() == 0 and not bucket_shapes:
            bucket_shapes.extend(tuple(g.shape) for g in bucket.gradients())
        return ddp_powersgd.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(ddp_state, hook)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp_losses = []
    for s in range(PSGD_STEPS):
        ddp_losses.append(_ddp_train_step(ddp, torch_opt, *_local(s, 8, PSGD_SIZES)))

    dense = fddp.data_parallel(_sgd_step(loss_fn, opt))

    @fddp.data_parallel
    def compressed(params, opt_state, comm_state, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        grads, comm_state = powersgd(grads, comm_state, epsilon=PSGD_EPSILON)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, comm_state, fddp.pmean(loss)

    def train(comm_state: PowerSGDState) -> tuple[dict, list[float], list[int]]:
        params = fddp.state(model)[0]
        state, losses, nbytes = opt.init(params), [], []
        for s in range(PSGD_STEPS):
            x, y = _local(s, 8, PSGD_SIZES)
            if s < PSGD_START:  # DDP's start_powerSGD_iter: plain all-reduce first
                nbytes.append(
                    sum(c.nbytes for c in dense.schedule(params, state, x, y).collectives)
                )
                params, state, loss = dense(params, state, x, y)
            else:
                plan = compressed.schedule(params, state, comm_state, x, y)
                nbytes.append(sum(c.nbytes for c in plan.collectives))
                params, state, comm_state, loss = compressed(params, state, comm_state, x, y)
            losses.append(loss.item())
        return params, losses, nbytes

    params = fddp.state(model)[0]
    own = powersgd_init(params, rank=PSGD_RANK)
    same_q = own._replace(qs={**own.qs, **_ddp_initial_qs(params, bucket_shapes)})
    final, losses, nbytes = train(same_q)
    _, own_losses, _ = train(own)
    before, after = ddp_state.compression_stats()[1:]
    return {
        "params": _flat(final),
        "ddp_params": _flat(_named(ddp.module)),
        "loss": losses,
        "ddp_loss": ddp_losses,
        "own_seed_loss": own_losses,
        "compressed_leaves": sorted(same_q.qs),
        "bytes": nbytes,
        "ddp_ratio": before / after,
    }


# --- 8. mixed precision ------------------------------------------------------------------------


def _check_mixed_precision(steps: int = 4) -> dict:
    """bf16 compute, fp32 master params, grads and all-reduce; against the same casts locally."""
    model, loss_fn = _mse_setup()
    low = mixed_precision(loss_fn, torch.bfloat16)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.state(model)[0]
    state = opt.init(params)
    pstep = fddp.data_parallel(_sgd_step(low, opt))
    # one process, the same casts on each rank's half, the halves' gradients averaged in fp32
    accumulated = accumulate_gradients(low, fddp.world_size(), batch_argnums=(1, 2))

    def split(params, opt_state, x, y):
        loss, grads = accumulated(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    full32 = _sgd_step(loss_fn, opt, lambda t: t)
    ref, ref_state, ref32, ref32_state = params, state, params, state
    out = {"params": [], "ref_params": [], "fp32_params": []}
    for s in range(steps):
        x, y = _batch(s, 8)
        params, state, _ = pstep(params, state, fddp.shard(x), fddp.shard(y))
        ref, ref_state, _ = split(ref, ref_state, x, y)
        ref32, ref32_state, _ = full32(ref32, ref32_state, x, y)
        out["params"].append(_flat(params))
        out["ref_params"].append(_flat(ref))
        out["fp32_params"].append(_flat(ref32))
    x, y = _local(0, 4)
    out["param_dtypes"] = {str(v.dtype) for v in params.values()}
    out["grad_dtypes"] = {str(g.dtype) for g in fddp.grad(low)(params, x, y).values()}
    out["wire"] = {c.dtype for c in pstep.schedule(params, state, x, y).collectives}
    return out


# --- the 2-rank spawn --------------------------------------------------------------------------


def _two_rank_worker() -> dict:
    out: dict = {}
    _attempt(out, "replicas", _check_replicas)
    _attempt(out, "buffers", _check_buffers)
    _attempt(out, "sync_batchnorm", _check_sync_batchnorm)
    _attempt(out, "accumulation", _check_accumulation)
    out.update(_check_unused())
    _attempt(out, "uneven", _check_uneven)
    _attempt(out, "low_precision_comm", _check_low_precision_comm)
    _attempt(out, "powersgd", _check_powersgd)
    _attempt(out, "mixed_precision", _check_mixed_precision)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_two_rank_worker, WORLD, timeout=600)


def test_1_data_parallel_refuses_replicas_that_differ_naming_the_leaf(runs):
    for message in _result(runs, "replicas"):
        assert message["mismatch"] is not None, "differing parameters were not detected"
        assert "['2.weight']" in message["mismatch"] and "fddp.replicate" in message["mismatch"]


def test_1_replicate_gives_rank0_values_like_ddp_and_trains_like_ddp(runs):
    results = _result(runs, "replicas")
    for r in results:
        assert torch.equal(r["replicated"], results[0]["replicated"])
        assert torch.equal(r["replicated"], r["ddp_initial"])
        _assert_steps_close(r["params"], r["ddp_params"], "params vs DDP", **TOL)


@pytest.mark.parametrize(
    "how",
    ["broadcast", "mean"],
)
def test_2_buffers_broadcast_or_mean_match_ddp(runs, how):
    results = [r[how] for r in _result(runs, "buffers")]
    for r in results:
        _assert_steps_close(r["params"], r["ddp_params"], f"{how}: params vs DDP", **TOL)
        _assert_steps_close(r["buffers"], r["ddp_buffers"], f"{how}: buffers vs DDP", **TOL)
        assert r["counts"] == list(range(1, len(r["counts"]) + 1))
    _assert_ranks_equal([r["buffers"] for r in results], f"{how}: buffers")


def test_2_buffer_choices_differ_so_the_tests_can_tell_them_apart(runs):
    (r0, *_) = _result(runs, "buffers")
    assert not torch.allclose(r0["broadcast"]["buffers"][-1], r0["mean"]["buffers"][-1])


def test_2_sync_batchnorm_matches_batchnorm_on_the_global_batch(runs):
    results = _result(runs, "sync_batchnorm")
    for r in results:
        _assert_steps_close(r["params"], r["ref_params"], "params vs global batch", **TOL)
        _assert_steps_close(r["buffers"], r["ref_buffers"], "buffers vs global batch", **TOL)
        torch.testing.assert_close(r["eval"], r["ref_eval"], **TOL)
    _assert_ranks_equal([r["params"] for r in results], "sync batchnorm params")


def test_3_accumulation_matches_ddp_no_sync(runs):
    for r in _result(runs, "accumulation"):
        _assert_steps_close(r["params"], r["ddp_params"], "params vs DDP no_sync", **TOL)
        torch.testing.assert_close(r["loss"], r["ddp_loss"], **TOL)
        grads = [leaf for leaf in r["reduced_leaves"] if leaf != "<root>"]
        assert sorted(grads) == sorted(set(grads)), "a gradient was all-reduced more than once"
        assert len(grads) == r["param_leaves"]


@pytest.mark.parametrize("where", ["some_steps", "some_ranks"])
def test_4_unused_parameters_train_like_ddp_find_unused(runs, where):
    results = _result(runs, where)
    for r in results:
        _assert_steps_close(r["params"], r["ddp_params"], f"{where}: params vs DDP", **TOL)
    _assert_ranks_equal([r["params"] for r in results], where)
    if where == "some_steps":
        assert results[0]["branch_moved"] == [True, False, True, False]
        assert results[0]["signatures"] == 2


def test_4_python_branch_on_the_rank_raises_instead_of_diverging(runs):
    results = _result(runs, "python_branch_on_rank")
    for r in results:
        assert r["raised"] is not None, "ranks traced different steps and trained apart"
        assert "no branch depends on the rank" in r["raised"]


@pytest.mark.parametrize("n", [23, 17])
def test_5_uneven_epoch_equals_one_process_on_the_whole_dataset(runs, n):
    results = [r[n] for r in _result(runs, "uneven")]
    last = 7 if n == 23 else 1
    assert [r["rows"][-1] for r in results] == [(last + 1) // 2, last // 2]
    assert all(r["rows"][:-1] == [4, 4] for r in results)  # same number of steps on every rank
    for r in results:
        _assert_steps_close(r["params"], r["ref_params"], f"n={n}: params", **TOL)
        torch.testing.assert_close(r["loss"], r["ref_loss"], **TOL)
    assert [r["programs"] for r in _result(runs, "uneven")] == [1, 1]  # padded: one shape


def test_5_a_rank_that_runs_out_of_data_early_raises_on_every_rank(runs):
    for r in _result(runs, "uneven"):
        assert r["early_end"] is not None
        assert "rank(s) [1] ran out of data after 2 steps" in r["early_end"]


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_6_comm_dtype_matches_ddp_compress_hook(runs, dtype):
    for r in _result(runs, "low_precision_comm"):
        run = r[dtype]
        assert run["wire"] == {dtype.removeprefix("torch.")}
        _assert_steps_close(run["params"], run["ddp_params"], f"{dtype} vs DDP hook", **TOL)


def test_6_powersgd_matches_ddp_powersgd_hook_and_sends_fewer_bytes(runs):
    results = _result(runs, "powersgd")
    for r in results:
        torch.testing.assert_close(r["params"], r["ddp_params"], **TOL)
        torch.testing.assert_close(r["loss"], r["ddp_loss"], rtol=PSGD_LOSS_RTOL, atol=0)
        own, ddp = r["own_seed_loss"][-1], r["ddp_loss"][-1]
        assert abs(own - ddp) <= PSGD_OWN_SEED_LOSS_RTOL * ddp
        assert r["compressed_leaves"] == ["['0.weight']", "['2.weight']", "['4.weight']"]
        dense, compressed = r["bytes"][0], r["bytes"][-1]
        ratio = (dense - 4) / (compressed - 4)  # less the 4-byte loss riding along
        assert ratio > BYTES_RATIO_MIN
        assert ratio == pytest.approx(r["ddp_ratio"], rel=1e-3)
        print(f"PowerSGD rank {PSGD_RANK}: {dense} -> {compressed} bytes/step, {ratio:.2f}x")
    _assert_ranks_equal([r["params"] for r in results], "powersgd params")


def test_8_mixed_precision_keeps_fp32_master_params_and_matches_the_same_casts(runs):
    for r in _result(runs, "mixed_precision"):
        assert r["param_dtypes"] == {"torch.float32"} and r["grad_dtypes"] == {"torch.float32"}
        assert r["wire"] == {"float32"}
        _assert_steps_close(r["params"], r["ref_params"], "bf16 vs same casts", **TOL)
        _assert_steps_close(r["params"], r["fp32_params"], "bf16 vs fp32", rtol=0, atol=2e-3)
        assert (r["params"][-1] - r["params"][0]).abs().max() > 0.05  # it trains
        assert not torch.equal(r["params"][-1], r["fp32_params"][-1])  # it did compute in bf16


# --- 7. process groups: 4 ranks, two independent data-parallel groups --------------------------


def _groups_worker() -> dict:
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    index = rank // 2
    group = groups[index]
    model, loss_fn = _mse_setup(seed=rank)  # different everywhere until replicated per group
    opt = optim.sgd(lr=0.1, momentum=0.9)
    params = fddp.replicate(fddp.state(model)[0], src=0, group=group)
    state = opt.init(params)
    pstep = fddp.data_parallel(_sgd_step(loss_fn, opt), group=group)
    ddp = DistributedDataParallel(_models.mlp(SIZES, seed=rank), process_group=group)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    reference = _sgd_step(loss_fn, opt, lambda t: t)
    ref, ref_state = params, state
    out = {"group": index, "params": [], "ddp_params": [], "ref_params": []}
    for s in range(3 + 2 * index):  # the groups do not even make the same number of steps
        x, y = _batch(100 * index + s, 8)
        local = fddp.shard((x, y), group=group)
        params, state, _ = pstep(params, state, *local)
        _ddp_step(ddp, torch_opt, *local)  # no world-wide loss mean: the groups are apart
        ref, ref_state, _ = reference(ref, ref_state, x, y)
        out["params"].append(_flat(params))
        out["ddp_params"].append(_flat(_named(ddp.module)))
        out["ref_params"].append(_flat(ref))
    return out


def test_7_two_process_groups_train_independently():
    results = run_ranks(_groups_worker, 4, timeout=300)
    for r in results:
        _assert_steps_close(r["params"], r["ref_params"], f"group {r['group']}", **TOL)
        _assert_steps_close(r["params"], r["ddp_params"], f"group {r['group']} DDP", **TOL)
    assert [len(r["params"]) for r in results] == [3, 3, 5, 5]
    _assert_ranks_equal([r["params"] for r in results[:2]], "group 0")
    _assert_ranks_equal([r["params"] for r in results[2:]], "group 1")
    assert not torch.allclose(results[0]["params"][-1], results[2]["params"][-1])


# --- a world of one: the helpers on their own --------------------------------------------------


def test_sync_batch_norm_under_vmap_is_batchnorm_over_all_replicas_with_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 4, generator=g) * 2 + 1  # 2 replicas of 5 rows
    w, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    mean, var = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5

    def synced(w, b, x):
        out, m, v = sync_batch_norm(x, mean, var, w, b, momentum=0.3)
        return (out**3).sum(), (m, v)

    def replica(x):
        (gw, gb, gx), stats = fddp.grad(synced, argnums=(0, 1, 2), has_aux=True)(w, b, x)
        return fddp.psum((gw, gb)), gx, stats

    (gw, gb), gx, (m, v) = fddp.vmap(replica)(x)

    def single(w, b, x):
        m, v = mean.clone(), var.clone()
        out = F.batch_norm(x, m, v, w, b, True, 0.3, 1e-5)
        return (out**3).sum(), (m, v)

    (rw, rb, rx), (rm, rv) = fddp.grad(single, argnums=(0, 1, 2), has_aux=True)(
        w, b, x.reshape(10, 3, 4)
    )
    torch.testing.assert_close(gw[0], rw, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gb[0], rb)
    torch.testing.assert_close(gx.reshape(10, 3, 4), rx, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(m[0], rm)
    torch.testing.assert_close(v[0], rv)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_converted_model_in_one_process_is_the_original(momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())
    synced = convert_sync_batchnorm(model)
    assert isinstance(synced[1], SyncBatchNorm) and isinstance(model[1], nn.BatchNorm2d)
    params, buffers = fddp.state(model)
    assert (sorted(params), sorted(buffers)) == tuple(sorted(d) for d in fddp.state(synced))
    x = torch.randn(6, 3, 5, 5)
    sbuffers = buffers
    for _ in range(2):
        out, buffers = fddp.functional(model, return_buffers=True)(params, buffers, x)
        sout, sbuffers = fddp.functional(synced, return_buffers=True)(params, sbuffers, x)
    torch.testing.assert_close(sout, out)
    torch.testing.assert_close(sbuffers, buffers)
    model.eval(), synced.eval()
    torch.testing.assert_close(
        fddp.functional(synced)(params, buffers, x), fddp.functional(model)(params, buffers, x)
    )


def test_sync_buffers_rejects_an_unknown_choice():
    with pytest.raises(ValueError, match="'mean' or 'broadcast'"):
        sync_buffers({"running_mean": torch.zeros(2)}, "average")


def test_accumulate_gradients_with_uneven_microbatches_is_the_full_batch():
    model, loss_fn = _mse_setup()
    params = fddp.state(model)[0]
    x, y = _batch(0, 7)
    loss, grads = accumulate_gradients(loss_fn, 3, batch_argnums=(1, 2))(params, x, y)  # 3+2+2
    ref_loss, ref_grads = fddp.value_and_grad(loss_fn)(params, x, y)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads)
    (_, auxes), _ = accumulate_gradients(
        lambda p, x, y: (loss_fn(p, x, y), len(x)), 3, has_aux=True, batch_argnums=(1, 2)
    )(params, x, y)
    assert auxes == [3, 2, 2]


def test_accumulate_gradients_explains_mistakes():
    model, loss_fn = _mse_setup()
    params = fddp.state(model)[0]
    x, y = _batch(0, 2)
    with pytest.raises(ValueError, match="num_microbatches <= rows"):
        accumulate_gradients(loss_fn, 3, batch_argnums=(1, 2))(params, x, y)
    with pytest.raises(ValueError, match="same rows"):
        accumulate_gradients(loss_fn, 2, batch_argnums=(1, 2))(params, *_batch(0, 3)[:1], y)
    with pytest.raises(ValueError, match="overlap"):
        accumulate_gradients(loss_fn, 2, batch_argnums=0)(params, x, y)
    with pytest.raises(ValueError, match="positive int"):
        accumulate_gradients(loss_fn, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_batches_follows_distributed_sampler_without_padding(shuffle):
    world, batch = 3, 4

    def sampler_batches(n, rank):
        sampler = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=7)
        sampler.set_epoch(2)
        return [b.tolist() for b in DataLoader(range(n), batch_size=batch, sampler=sampler)]

    def ours(n, rank):
        return shard_batches(
            n, batch, shuffle=shuffle, seed=7, epoch=2, num_replicas=world, rank=rank
        )

    for rank in range(world):
        assert ours(36, rank) == sampler_batches(36, rank)  # evenly divisible: identical
    ranks = [ours(31, rank) for rank in range(world)]  # 2 full global batches and 7 samples
    assert {len(r) for r in ranks} == {3}
    for rank, mine in enumerate(ranks):
        assert mine[:2] == sampler_batches(31, rank)[:2]
    assert [len(r[-1]) for r in ranks] == [3, 2, 2]
    assert sorted(i for r in ranks for b in r for i in b) == list(range(31))
    assert [
        len(shard_batches(31, batch, drop_last=True, num_replicas=world, rank=r))
        for r in range(world)
    ] == [2, 2, 2]


def test_weighted_pmean_under_vmap_is_the_row_weighted_mean_and_ignores_empty_replicas():
    values = torch.tensor([[1.0, 2.0], [4.0, 8.0], [float("nan"), float("nan")]])
    weights = torch.tensor([3.0, 1.0, 0.0])
    out = fddp.vmap(lambda v, w: weighted_pmean({"v": v}, w))(values, weights)
    torch.testing.assert_close(out["v"], torch.tensor([[1.75, 3.5]] * 3))
    with pytest.raises(TypeError, match="floating-point"):
        weighted_pmean({"n": torch.arange(3)}, 1)


def test_pad_rows_pads_every_leaf_and_masks_the_padding():
    (x, labels), mask = pad_rows((torch.ones(3, 2), torch.arange(3)), 5)
    assert x.shape == (5, 2) and labels.tolist() == [0, 1, 2, 0, 0]
    assert mask.tolist() == [1, 1, 1, 0, 0] and x[3:].abs().sum() == 0
    assert pad_rows(torch.ones(0, 2), 2)[1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="more than rows"):
        pad_rows(torch.ones(3), 2)
    with pytest.raises(ValueError, match="same leading"):
        pad_rows((torch.ones(3), torch.ones(2)), 4)


def test_lockstep_in_a_world_of_one_is_plain_iteration():
    assert list(lockstep(iter(range(3)))) == [0, 1, 2]


def test_powersgd_error_feedback_keeps_the_mean_and_exact_low_rank_gradients():
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(3, 16, 12, generator=g), "b": torch.randn(3, 16, generator=g)}
    state = powersgd_init({"w": grads["w"][0], "b": grads["b"][0]}, rank=2)
    assert list(state.qs) == ["['w']"]
    states = optree.tree_map(lambda t: t.expand(3, *t.shape), state)
    mean, new = fddp.vmap(powersgd)(grads, states)
    torch.testing.assert_close(mean["b"], grads["b"].mean(0).expand(3, 16))
    # what was not transmitted stays in the errors: mean(approximation + error) = mean(grads)
    torch.testing.assert_close(
        mean["w"][0] + new.errors["['w']"].mean(0), grads["w"].mean(0), rtol=1e-5, atol=1e-5
    )
    # a gradient of rank 2, the same on every replica, comes through exactly
    factors = torch.randn(16, 2, generator=g), torch.randn(12, 2, generator=g)
    low = {"w": factors[0] @ factors[1].T, "b": torch.zeros(16)}
    out, _ = powersgd(low, state)
    torch.testing.assert_close(out["w"], low["w"], rtol=1e-5, atol=1e-4)


def test_powersgd_explains_a_state_for_other_parameters():
    state = powersgd_init({"w": torch.zeros(16, 12)})
    with pytest.raises(ValueError, match="powersgd_init"):
        powersgd({"w": torch.zeros(12, 16)}, state)
    with pytest.raises(ValueError, match="lacks"):
        powersgd({"v": torch.zeros(16, 12)}, state)


def test_mixed_precision_casts_floats_only_and_returns_fp32_grads():
    tree = cast_floating({"w": torch.ones(2), "ids": torch.arange(2), "n": 3}, torch.bfloat16)
    assert (tree["w"].dtype, tree["ids"].dtype, tree["n"]) == (torch.bfloat16, torch.int64, 3)
    seen = []

    def loss_fn(w, x, labels):
        seen.append((w.dtype, x.dtype, labels.dtype))
        return F.cross_entropy(x @ w, labels)

    w = torch.randn(4, 3)
    loss, g = fddp.value_and_grad(mixed_precision(loss_fn))(
        w, torch.randn(5, 4), torch.zeros(5, dtype=torch.long)
    )
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.int64)]
    assert loss.dtype == g.dtype == torch.float32
