"""fddp.optim under torch.func transforms: vmap ensembles, fddp.vmap replicas, grad and jvp.

References: an ensemble trained under ``torch.func.vmap`` against one ``torch.optim`` run per
member; ``fddp.vmap`` replicas (every argument carrying the replica dimension) against one process
on the global batch; derivatives through an update against central finite differences in float64.
"""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from _models import mlp
from torch.fx.experimental.proxy_tensor import make_fx

import fddp
import fddp.optim as optim

MEMBERS = 4
STEPS = 10
TOL = 1e-6
SIZES = (6, 16, 3)
BATCH = 8


def _batches(members: int, steps: int = STEPS, dtype=torch.float32) -> list[tuple]:
    """One ``(x, y)`` per step, each with a leading member dimension."""
    g = torch.Generator().manual_seed(1)
    shape = (members, BATCH)
    return [
        (
            torch.randn(*shape, SIZES[0], generator=g, dtype=dtype),
            torch.randn(*shape, SIZES[2], generator=g, dtype=dtype),
        )
        for _ in range(steps)
    ]


BASE = copy.deepcopy(mlp(SIZES, seed=0)).to("meta")


def _loss(params, x, y):
    return F.mse_loss(torch.func.functional_call(BASE, params, (x,)), y)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# --- ensembles under torch.func.vmap against torch.optim, one run per member ------------------

CLIP = 0.05

ENSEMBLE_CASES = {
    "sgd": (lambda: optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1), None),
    "sgd_momentum": (
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        None,
    ),
    "sgd_nesterov_wd": (
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        None,
    ),
    "adam_wd": (
        lambda: optim.adam(1e-2, b1=0.8, b2=0.99, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        None,
    ),
    "adamw": (
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        None,
    ),
    "clip_sgd_momentum": (
        lambda: optim.chain(optim.clip_by_global_norm(CLIP), optim.sgd(0.1, momentum=0.9)),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        CLIP,
    ),
    "clip_adamw": (
        lambda: optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(1e-2)),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        CLIP,
    ),
}


def _train_torch(member: int, make_opt, clip: float | None, batches) -> dict[str, torch.Tensor]:
    model = mlp(SIZES, seed=member)
    opt = make_opt(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x[member]), y[member]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _member_step(opt):
    def step(params, state, x, y):
        grads = torch.func.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return step


def _train_ensemble(opt, batches) -> tuple[dict, object]:
    params, _ = torch.func.stack_module_state([mlp(SIZES, seed=i) for i in range(MEMBERS)])
    params = {k: v.detach() for k, v in params.items()}
    state = torch.func.vmap(opt.init)(params)
    step = torch.func.vmap(_member_step(opt))
    for x, y in batches:
        params, state = step(params, state, x, y)
    return params, state


@pytest.mark.parametrize("name", list(ENSEMBLE_CASES))
def test_vmap_ensemble_matches_torch_optim_per_member(name):
    ours, theirs, clip = ENSEMBLE_CASES[name]
    batches = _batches(MEMBERS)
    params, _ = _train_ensemble(ours(), batches)
    for i in range(MEMBERS):
        ref = _train_torch(i, theirs, clip, batches)
        member = {k: v[i] for k, v in params.items()}
        assert _max_diff(member, ref) <= TOL, (name, i, _max_diff(member, ref))
        start = dict(mlp(SIZES, seed=i).named_parameters())
        assert _max_diff(ref, {k: v.detach() for k, v in start.items()}) > 1e-3


REST = {
    "schedule": lambda: optim.chain(
        optim.scale_by_schedule(optim.warmup_cosine_decay_schedule(0.0, 1.0, 3, STEPS)),
        optim.adam(optim.linear_schedule(1e-2, 1e-3, STEPS)),
    ),
    "cosine_sgd": lambda: optim.sgd(optim.cosine_decay_schedule(0.1, STEPS, 0.1), momentum=0.9),
    "trace_scale": lambda: optim.chain(
        optim.identity(),
        optim.add_decayed_weights(0.01),
        optim.trace(0.5, nesterov=True),
        optim.scale(-0.05),
    ),
    "scale_by_adam": lambda: optim.chain(
        optim.scale_by_adam(), optim.scale_by_learning_rate(optim.constant_schedule(1e-2))
    ),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.adamw(1e-2), max_consecutive_errors=1),
}


def _poison(batches) -> list[tuple]:
    """NaN targets for member 1 at steps 2 and 5, for member 2 at steps 6 and 7."""
    out = [(x.clone(), y.clone()) for x, y in batches]
    for member, step in ((1, 2), (1, 5), (2, 6), (2, 7)):
        out[step][1][member, 0, 0] = float("nan")
    return out


@pytest.mark.parametrize("name", list(REST))
def test_vmap_ensemble_equals_each_member_alone(name):
    """The rest of the public set: each ensemble member as if trained alone by fddp.optim."""
    opt = REST[name]()
    batches = _batches(MEMBERS)
    if name == "apply_if_finite":
        batches = _poison(batches)
    params, state = _train_ensemble(opt, batches)
    step = _member_step(opt)
    for i in range(MEMBERS):
        p = {k: v.detach() for k, v in mlp(SIZES, seed=i).named_parameters()}
        s = opt.init(p)
        for x, y in batches:
            p, s = step(p, s, x[i], y[i])
        member = optree.tree_map(lambda leaf, i=i: leaf[i], (params, state))
        assert_trees_close(member, (p, s), rtol=0, atol=TOL, equal_nan=True, what=f"member {i}")
    if name == "apply_if_finite":
        # member 2's second NaN in a row is past max_consecutive_errors: applied, so its
        # parameters are NaN from then on, and so are its last two gradients
        assert state.total_notfinite.tolist() == [0, 2, 4, 0]
        weight = params["0.weight"]
        assert torch.isnan(weight[2]).all() and torch.isfinite(weight[1]).all()


def test_vmap_global_norm_and_reduced_precision_scalars():
    torch.manual_seed(0)
    tree = {"a": torch.randn(MEMBERS, 3, 2), "b": [torch.randn(MEMBERS, 5)]}
    norms = torch.func.vmap(optim.global_norm)(tree)
    for i in range(MEMBERS):
        member = optree.tree_map(lambda x, i=i: x[i], tree)
        assert torch.allclose(norms[i], optim.global_norm(member))
    # a batched tensor learning rate acts on bf16 leaves as a float32 scalar would, per member
    leaves = torch.randn(MEMBERS, 50).to(torch.bfloat16)
    lrs = torch.tensor([1e-3, 3e-3, 1.7e-3, 5e-4], dtype=torch.float64)

    def scaled(leaf, lr):
        opt = optim.scale_by_learning_rate(lambda count: lr)
        return opt.update([leaf], opt.init([leaf]))[0][0]

    got = torch.func.vmap(scaled)(leaves, lrs)
    for i in range(MEMBERS):
        expected = optim.scale_by_learning_rate(lrs[i].item()).update([leaves[i]], None)[0][0]
        assert got.dtype == torch.bfloat16 and torch.equal(got[i], expected)


# --- fddp.vmap replicas: every argument carries the replica dimension -----------------------

REPLICAS = 4

REPLICA_CASES = {
    "sgd_momentum": (
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "adamw": (
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
    "finite_clip_adamw": (
        lambda: optim.apply_if_finite(
            optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(1e-2)), 2
        ),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
    ),
}


def _replicate(tree):
    return optree.tree_map(lambda x: x.expand(REPLICAS, *x.shape).clone(), tree)


def _global_torch_run(make_opt, clip: float | None, batches) -> dict[str, torch.Tensor]:
    model = mlp(SIZES, seed=0)
    opt = make_opt(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x.flatten(0, 1)), y.flatten(0, 1)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("convention", ["all_mapped", "params_unmapped"])
@pytest.mark.parametrize("name", list(REPLICA_CASES))
def test_fddp_vmap_replicas_match_global_batch_and_stay_identical(name, convention):
    """pmean of a batched value is unbatched: the update mixes it with per-replica state."""
    ours, theirs = REPLICA_CASES[name]
    opt = ours()

    def step(params, state, x, y):
        loss, grads = fddp.value_and_grad(_loss)(params, x, y)
        updates, state = opt.update(fddp.pmean(grads), state, params)
        return optim.apply_updates(params, updates), state, fddp.pmean(loss)

    params = {k: v.detach() for k, v in mlp(SIZES, seed=0).named_parameters()}
    state = opt.init(params)
    if convention == "all_mapped":
        vstep = fddp.vmap(step)
        params, state = _replicate(params), _replicate(state)
    else:
        vstep = fddp.vmap(step, in_dims=(None, None, 0, 0))
    batches = _batches(REPLICAS)
    for x, y in batches:
        params, state, loss = vstep(params, state, x, y)
        for leaf in optree.tree_leaves((params, state, loss)):
            assert leaf.shape[0] == REPLICAS and torch.equal(leaf, leaf[:1].expand_as(leaf))
        if convention == "params_unmapped":
            params, state = optree.tree_map(lambda t: t[0], (params, state))
    clip = CLIP if "clip" in name else None
    ref = _global_torch_run(theirs, clip, batches)
    got = params if convention == "params_unmapped" else {k: v[0] for k, v in params.items()}
    assert _max_diff(got, ref) <= TOL, _max_diff(got, ref)


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt's orthonormal columns: QR, with the signs that make R's diagonal positive."""
    q, r = torch.linalg.qr(matrix)
    return q * torch.sign(torch.diagonal(r))


def test_powersgd_state_per_replica_under_fddp_vmap():
    """Each replica carries its own error feedback; the reference is PowerSGD on stacked grads."""
    torch.manual_seed(0)
    grads = [{"w": torch.randn(REPLICAS, 24, 10), "b": torch.randn(REPLICAS, 24)} for _ in range(3)]
    psgd = fddp.powersgd(approximation_rank=2, epsilon=0.0)
    state = torch.func.vmap(psgd.init)(grads[0])
    alone = psgd.init({k: v[0] for k, v in grads[0].items()})
    assert_trees_equal(state, _replicate(alone), "vmapped init")
    q, error = alone.qs["['w']"], torch.zeros(REPLICAS, 24, 10)
    step = fddp.vmap(psgd.update)
    for g in grads:
        mean, state = step(g, state)
        m = g["w"] + error
        p = _orthonormal((m @ _orthonormal(q)).sum(0))
        q = (m.transpose(1, 2) @ p).mean(0)
        expected, error = p @ q.T, m - p @ q.T
        torch.testing.assert_close(mean["w"], expected.expand_as(mean["w"]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean["b"], g["b"].mean(0).expand_as(g["b"]))
        torch.testing.assert_close(state.errors["['w']"], error, rtol=1e-5, atol=1e-5)
        for leaf in (mean["w"], state.qs["['w']"]):
            assert torch.equal(leaf, leaf[:1].expand_as(leaf))


# --- derivatives through an update, against central finite differences in float64 ------------

DIFF_CASES = {
    "sgd": lambda lr: optim.sgd(lambda count: lr, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam": lambda lr: optim.adam(lambda count: lr, weight_decay=0.1),
    "adamw": lambda lr: optim.chain(
        optim.clip_by_global_norm(0.5), optim.adamw(lambda count: lr, weight_decay=0.1)
    ),
}


def _meta_setup(name: str):
    """``outer(params, lr)``: the validation loss after one update from a warmed-up state."""
    x, y = (b.double() for b in _batches(2, steps=1, dtype=torch.float64)[0])
    params = {k: v.detach().double() for k, v in mlp(SIZES, seed=0).named_parameters()}

    def loss(p, i):
        # not F.mse_loss: jvp over its grad raises "ZeroTensors are immutable" (torch 2.13)
        return ((torch.func.functional_call(BASE, p, (x[i],)) - y[i]) ** 2).mean()

    state = DIFF_CASES[name](torch.tensor(1e-2, dtype=torch.float64)).init(params)
    for _ in range(2):
        opt = DIFF_CASES[name](torch.tensor(1e-2, dtype=torch.float64))
        updates, state = opt.update(torch.func.grad(loss)(params, 0), state, params)
        params = optim.apply_updates(params, updates)

    def outer(p, lr):
        updates, _ = DIFF_CASES[name](lr).update(torch.func.grad(loss)(p, 0), state, p)
        return loss(optim.apply_updates(p, updates), 1)

    return outer, params, torch.tensor(5e-2, dtype=torch.float64)


def _directional_fd(f, primals, tangents, eps=1e-6) -> float:
    def shifted(sign: float) -> tuple:
        return optree.tree_map(lambda p, t: p + sign * eps * t, primals, tangents)

    return ((f(*shifted(1.0)) - f(*shifted(-1.0))) / (2 * eps)).item()


@pytest.mark.parametrize("name", list(DIFF_CASES))
def test_grad_vjp_jvp_through_update_match_finite_differences(name):
    outer, params, lr = _meta_setup(name)
    torch.manual_seed(0)
    grads = torch.func.grad(outer, argnums=(0, 1))(params, lr)
    value, vjp_fn = torch.func.vjp(outer, params, lr)
    assert_trees_equal(vjp_fn(torch.ones_like(value)), grads, "vjp vs grad")
    for _ in range(3):
        tangents = (optree.tree_map(torch.randn_like, params), torch.randn((), dtype=lr.dtype))
        fd = _directional_fd(outer, (params, lr), tangents)
        products = optree.tree_map(lambda g, t: (g * t).sum(), grads, tangents)  # same trees
        by_grad = sum(optree.tree_leaves(products))
        _, by_jvp = torch.func.jvp(outer, (params, lr), tangents)
        assert abs(fd) > 1e-4
        assert by_grad.item() == pytest.approx(fd, rel=1e-6, abs=1e-9)
        assert by_jvp.item() == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_vmap_of_grad_through_update_equals_each_member():
    """Nested transforms: a batched tensor under a grad wrapper takes the per-leaf path too."""
    outer, params, lr = _meta_setup("adamw")
    lrs = torch.tensor([1e-2, 5e-2, 1e-1], dtype=torch.float64)
    batched = torch.func.vmap(torch.func.grad(outer, argnums=1), in_dims=(None, 0))(params, lrs)
    for i, lr in enumerate(lrs):
        assert torch.allclose(batched[i], torch.func.grad(outer, argnums=1)(params, lr))


# --- the plain and traced paths keep the foreach kernels --------------------------------------


def test_traced_update_keeps_foreach_kernels_and_transformed_one_does_not():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2), optim.sgd(1.0, 0.9))

    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    params = {k: v.detach() for k, v in mlp(SIZES, seed=0).named_parameters()}
    grads = optree.tree_map(torch.randn_like, params)
    state = opt.init(params)
    ops = {str(n.target) for n in make_fx(step)(params, grads, state).graph.nodes}
    kernels = ("lerp", "addcmul", "sqrt", "div", "norm", "mul", "add")
    assert {f"aten._foreach_{k}" for k in kernels} <= {op.rsplit(".", 1)[0] for op in ops}
    assert not {"aten.lerp", "aten.addcmul"} & {op.rsplit(".", 1)[0] for op in ops}
    stacked = _replicate((params, grads, state))
    vmapped = make_fx(torch.func.vmap(step))(*stacked)
    assert not any("_foreach_" in str(n.target) for n in vmapped.graph.nodes)
    assert_trees_equal(vmapped(*stacked), torch.func.vmap(step)(*stacked), "make_fx of vmap")


def test_ensemble_step_inside_data_parallel_world_of_one():
    opt = optim.adamw(1e-2)
    step = torch.func.vmap(_member_step(opt))
    params, _ = torch.func.stack_module_state([mlp(SIZES, seed=i) for i in range(MEMBERS)])
    params = {k: v.detach() for k, v in params.items()}
    state = torch.func.vmap(opt.init)(params)
    pstep = fddp.data_parallel(step)
    eager = (params, state)
    for x, y in _batches(MEMBERS, steps=3):
        params, state = pstep(params, state, x, y)
        eager = step(*eager, x, y)
        assert_trees_close((params, state), eager, rtol=0, atol=TOL, what="traced vs eager")


def test_vmapped_update_under_torch_compile_both_ways():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    torch.manual_seed(0)
    params = {"w": torch.randn(MEMBERS, 3, 5), "b": torch.randn(MEMBERS, 5)}
    args = (params, torch.func.vmap(opt.init)(params), optree.tree_map(torch.randn_like, params))
    expected = torch.func.vmap(step)(*args)
    compiled = torch.compile(torch.func.vmap(step), fullgraph=True, backend="eager")
    mapped = torch.func.vmap(torch.compile(step, fullgraph=True, backend="eager"))
    for fn in (compiled, mapped):
        assert_trees_close(fn(*args), expected, rtol=0, atol=TOL)
