"""fddp.optim against torch.optim, plus purity, pytree generality, schedules and tracing."""

import collections
import math

import optree
import pytest
import torch
from _compare import assert_trees_equal
from _models import mlp
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fddp.optim as optim

STEPS = 20
TOL = 1e-6

MLP_SIZES = (8, 16, 4)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _train_torch(make_opt, clip: float | None = None) -> dict[str, torch.Tensor]:
    model = mlp(MLP_SIZES)
    opt = make_opt(model.parameters())
    x, y = _data()
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _train_fddp(opt: optim.GradientTransformation) -> dict[str, torch.Tensor]:
    model = mlp(MLP_SIZES)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = _data()

    def loss_fn(p):
        return _loss_functional(model, p, x, y)

    state = opt.init(params)
    for _ in range(STEPS):
        grads = torch.func.grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def _loss_functional(model, params, x, y):
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


def _assert_close(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    for k in ref:
        diff = (ours[k] - ref[k]).abs().max().item()
        assert diff <= TOL, f"{k}: max abs diff {diff}"
    # the run must actually have moved the parameters, or the comparison says nothing
    start = dict(mlp(MLP_SIZES).named_parameters())
    assert any((ref[k] - start[k]).abs().max() > 1e-3 for k in ref)


CASES = {
    "sgd": (lambda: optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum": (
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "sgd_nesterov": (
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ),
    "sgd_weight_decay": (
        lambda: optim.sgd(0.1, momentum=0.5, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=0.05),
    ),
    "adam": (lambda: optim.adam(1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "adam_weight_decay": (
        lambda: optim.adam(1e-2, b1=0.8, b2=0.99, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    ),
    "adamw": (
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
    "adamw_default": (lambda: optim.adamw(1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_optim(name):
    ours, theirs = CASES[name]
    _assert_close(_train_fddp(ours()), _train_torch(theirs))


def test_clip_then_sgd_matches_clip_grad_norm():
    opt = optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1, momentum=0.9))
    ref = _train_torch(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), clip=0.05)
    _assert_close(_train_fddp(opt), ref)


def test_schedule_matches_torch_sgd_with_lr_set_each_step():
    sched = optim.linear_schedule(0.1, 0.01, transition_steps=10, transition_begin=3)

    def torch_opt(p):
        opt = torch.optim.SGD(p, lr=0.0, momentum=0.9)
        step, count = opt.step, iter(range(STEPS))

        def scheduled_step():
            opt.param_groups[0]["lr"] = sched(torch.tensor(next(count))).item()
            step()

        opt.step = scheduled_step
        return opt

    _assert_close(_train_fddp(optim.sgd(sched, momentum=0.9)), _train_torch(torch_opt))


def _values(schedule, steps):
    return [float(schedule(torch.tensor(s))) for s in steps]


def test_schedules():
    assert _values(optim.constant_schedule(0.3), [0, 100]) == [0.3, 0.3]
    lin = optim.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2)
    assert _values(lin, [0, 2, 3, 6, 50]) == pytest.approx([1.0, 1.0, 0.75, 0.0, 0.0])
    cos = optim.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1)
    expected = [2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * s / 10)) + 0.1) for s in (0, 3, 10)]
    assert _values(cos, [0, 3, 10, 20]) == pytest.approx([*expected, 0.2])
    warm = optim.warmup_cosine_decay_schedule(
        0.1, 1.0, warmup_steps=4, decay_steps=14, end_value=0.2
    )
    assert _values(warm, [0, 2, 4, 9, 14, 30]) == pytest.approx([0.1, 0.55, 1.0, 0.6, 0.2, 0.2])


def test_schedule_counts_steps():
    opt = optim.scale_by_learning_rate(lambda count: count + 1.0)
    params = [torch.ones(2)]
    state = opt.init(params)
    seen = []
    for _ in range(3):
        updates, state = opt.update([torch.ones(2)], state)
        seen.append(updates[0][0].item())
    assert seen == [-1.0, -2.0, -3.0]
    assert state.count.dtype == torch.int64 and state.count.shape == ()


OPTIMIZERS = {
    "sgd_nesterov_wd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam_wd": lambda: optim.adam(optim.cosine_decay_schedule(1e-2, 10), weight_decay=0.01),
    "adamw_clip": lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)),
}


Pair = collections.namedtuple("Pair", ["a", "b"])


def _tree():
    return {
        "pair": Pair(torch.randn(3, 2), [torch.randn(4, dtype=torch.float64), None]),
        "scalar": torch.tensor(0.5),
        "list": [torch.randn(2, 2, dtype=torch.bfloat16), (torch.randn(5),)],
    }


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pure_and_state_is_tensor_pytree(name):
    torch.manual_seed(0)
    opt = OPTIMIZERS[name]()
    params, grads = _tree(), optree.tree_map(torch.randn_like, _tree())
    state = opt.init(params)
    for _ in range(2):
        before = [optree.tree_map(torch.clone, t) for t in (params, grads, state)]
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        assert_trees_equal([params, grads, state], before, "the arguments of update")
        state, params = new_state, new_params

    assert all(isinstance(leaf, torch.Tensor) for leaf in optree.tree_leaves(state))
    assert optree.tree_structure(new_params) == optree.tree_structure(_tree())
    assert new_params["pair"].b[1] is None
    for new, old in zip(optree.tree_leaves(new_params), optree.tree_leaves(_tree()), strict=True):
        assert new.dtype == old.dtype and new.shape == old.shape  # the structure is asserted above
        assert torch.isfinite(new).all()


def test_traces_without_graph_breaks():
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
    )

    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "b": [torch.randn(3), None]}
    grads = optree.tree_map(torch.randn_like, params)
    state = opt.init(params)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    traced = make_fx(step)(params, grads, state)
    # the step count is a tensor, so later steps reuse the first graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            expected = step(params, grads, state)
            for got in (compiled(params, grads, state), traced(params, grads, state)):
                assert optree.tree_all(optree.tree_map(torch.equal, got, expected))
            params, state = expected


def test_chain_of_nothing_and_empty_tree():
    opt = optim.chain()
    updates, state = opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}))
    assert state == ()
    opt = optim.adamw(0.1)
    updates, state = opt.update({}, opt.init({}), {})
    assert updates == {} and optim.apply_updates({}, updates) == {}


def test_errors():
    params = {"w": torch.ones(2)}
    opt = optim.adamw(0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update(params, opt.init(params))
    with pytest.raises(ValueError, match="different tree structures"):
        opt.update(params, opt.init(params), {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="different tree structures"):
        optim.apply_updates(params, [torch.ones(2)])
    with pytest.raises(TypeError, match="call the factory"):
        optim.chain(optim.sgd)
    with pytest.raises(TypeError, match="learning_rate"):
        optim.sgd("0.1")
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)


def test_tensor_scalar_acts_like_python_float():
    torch.manual_seed(0)
    leaves = [torch.randn(100).to(dtype) for dtype in (torch.bfloat16, torch.float16)]
    tree = [*leaves, torch.tensor(1.3, dtype=torch.bfloat16), torch.randn(7, dtype=torch.float64)]
    lr = 3e-4 * 1.7
    ours = optim.scale_by_learning_rate(lambda count: torch.tensor(lr, dtype=torch.float64))
    plain = optim.scale_by_learning_rate(lr)
    got = ours.update(tree, ours.init(tree))[0]
    expected = plain.update(tree, plain.init(tree))[0]
    assert_trees_equal(got, expected, "a scheduled learning rate vs the float")
