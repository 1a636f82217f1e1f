"""AdamW recipes: masked weight decay, schedules of Python ints, inject_hyperparams.

Each result is compared with a reference: torch.optim.AdamW with parameter groups, a
hand-written loop, the same optimizer built fresh, or the eager step.
"""

import optree
import pytest
import torch
from _compare import assert_trees_close, assert_trees_equal
from _models import mlp
from torch import nn

import fddp
import fddp.optim as optim
from fddp._base._errors import UsageTypeError, UsageValueError

SIZES = (6, 8, 3)
STEPS = 8
TOL = 1e-6
MEMBERS = 3


def _decays(params):
    """The usual recipe: weight matrices decay, biases do not."""
    return {k: v.ndim > 1 for k, v in params.items()}


def _data(seed=1, rows=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, SIZES[0], generator=g), torch.randn(rows, SIZES[-1], generator=g)


MODEL = mlp(SIZES)


def _loss(params, x, y):
    out = torch.func.functional_call(MODEL, params, (x,))
    return nn.functional.mse_loss(out, y)


def _params(seed=0):
    return {k: v.detach().clone() for k, v in mlp(SIZES, seed=seed).named_parameters()}


def _train(opt, params, steps=STEPS):
    x, y = _data()
    state = opt.init(params)
    for _ in range(steps):
        grads = torch.func.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("callable_mask", [False, True])
def test_masked_adamw_matches_torch_adamw_with_a_no_decay_group(callable_mask):
    params = _params()
    mask = _decays if callable_mask else _decays(params)
    got, _ = _train(optim.adamw(1e-2, weight_decay=0.3, mask=mask), params)

    model = mlp(SIZES)
    named = dict(model.named_parameters())
    flags = _decays(named)
    torch_opt = torch.optim.AdamW(
        [
            {"params": [p for k, p in named.items() if flags[k]], "weight_decay": 0.3},
            {"params": [p for k, p in named.items() if not flags[k]], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    x, y = _data()
    for _ in range(STEPS):
        torch_opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch_opt.step()
    expected = {k: v.detach() for k, v in model.named_parameters()}
    assert_trees_close(got, expected, rtol=0, atol=TOL, what="masked adamw vs torch AdamW")
    unmasked, _ = _train(optim.adamw(1e-2, weight_decay=0.3), params)
    assert not torch.equal(unmasked["0.bias"], got["0.bias"])  # the mask did something


def test_masked_applies_inner_to_masked_in_leaves_only_as_a_hand_written_loop():
    params = _params()
    flags = _decays(params)
    opt = optim.masked(optim.trace(0.9), flags)
    state = opt.init(params)
    assert_trees_equal(
        state.inner_state,
        optim.TraceState([torch.zeros_like(v) for k, v in params.items() if flags[k]]),
        "the state holds the masked-in leaves only",
    )
    buf = {k: torch.zeros_like(v) for k, v in params.items() if flags[k]}
    torch.manual_seed(0)
    for _ in range(4):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        expected = {}
        for k, g in grads.items():
            if flags[k]:
                buf[k] = 0.9 * buf[k] + g
                expected[k] = buf[k]
            else:
                expected[k] = g
        assert_trees_equal(updates, expected, "masked momentum vs the loop")
        assert_trees_equal(state, optim.MaskedState(optim.TraceState(list(buf.values()))))


def test_masked_rejects_a_mask_of_another_structure_or_not_of_bools():
    params = _params()
    with pytest.raises(UsageValueError, match="structure"):
        optim.masked(optim.identity(), {"0.weight": True}).init(params)
    bad = {k: torch.tensor(True) for k in params}
    with pytest.raises(UsageTypeError, match="Python bools"):
        optim.masked(optim.identity(), bad).init(params)


def _step(opt):
    def step(params, state, x, y):
        grads = torch.func.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return step


def test_masked_adamw_inside_data_parallel_world_of_one_matches_eager():
    opt = optim.adamw(1e-2, weight_decay=0.3, mask=_decays)
    step = _step(opt)
    pstep = fddp.data_parallel(step)
    params = _params()
    state = opt.init(params)
    eager = (params, state)
    for seed in range(3):
        x, y = _data(seed)
        params, state = pstep(params, state, x, y)
        eager = step(*eager, x, y)
        assert_trees_close((params, state), eager, rtol=0, atol=TOL, what="traced vs eager")
    assert pstep.retraces == 0


def _stacked(trees):
    return optree.tree_map(lambda *xs: torch.stack(xs), *trees)


def test_masked_adamw_under_torch_func_vmap_matches_each_member_alone():
    opt = optim.adamw(1e-2, weight_decay=0.3, mask=_decays)
    step = _step(opt)
    members = [_params(seed=i) for i in range(MEMBERS)]
    params = _stacked(members)
    state = torch.func.vmap(opt.init)(params)
    alone = [(p, opt.init(p)) for p in members]
    x, y = _data()
    for _ in range(3):
        params, state = torch.func.vmap(step, in_dims=(0, 0, None, None))(params, state, x, y)
        alone = [step(p, s, x, y) for p, s in alone]
    assert_trees_close((params, state), _stacked(alone), rtol=0, atol=TOL, what="vmap")


def test_masked_adamw_under_fddp_vmap_matches_the_global_batch():
    opt = optim.adamw(1e-2, weight_decay=0.3, mask=_decays)

    def step(params, state, x, y):
        grads = fddp.pmean(torch.func.grad(_loss)(params, x, y))
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    params = _params()
    state = opt.init(params)
    x, y = _data(rows=16)
    vstep = fddp.vmap(step, in_dims=(None, None, 0, 0))
    expected = (params, state)
    for _ in range(3):
        params, state = vstep(params, state, x.view(4, 4, -1), y.view(4, 4, -1))
        params, state = optree.tree_map(lambda t: t[0], (params, state))
        expected = _step(opt)(*expected, x, y)
    assert_trees_close((params, state), expected, rtol=0, atol=TOL, what="fddp.vmap")


def test_shard_state_refuses_a_mask_and_the_named_alternative_matches_masked_adamw():
    params = _params()
    for mask in (_decays(params), lambda p: optree.tree_map(lambda v: v.ndim > 1, p)):
        opt = optim.shard_state(optim.adamw(1e-2, weight_decay=0.3, mask=mask))
        with pytest.raises(UsageValueError, match=r"shard_state.*chain\(shard_state"):
            _train(opt, params, steps=1)
    sharded = optim.chain(
        optim.shard_state(optim.scale_by_adam()),
        optim.masked(optim.add_decayed_weights(0.3), _decays),
        optim.scale_by_learning_rate(1e-2),
    )
    got, _ = _train(sharded, params)
    expected, _ = _train(optim.adamw(1e-2, weight_decay=0.3, mask=_decays), params)
    assert_trees_close(got, expected, rtol=0, atol=TOL, what="sharded masked adamw")


SCHEDULES = {
    "constant": optim.constant_schedule(0.1),
    "linear": optim.linear_schedule(1.0, 0.1, transition_steps=5, transition_begin=2),
    "cosine": optim.cosine_decay_schedule(1.0, decay_steps=7, alpha=0.1),
    "warmup_cosine": optim.warmup_cosine_decay_schedule(0.0, 1.0, 3, 9, end_value=0.05),
}


def test_schedules_take_python_ints_as_tensors():
    for name, schedule in SCHEDULES.items():
        by_int = [schedule(step) for step in range(12)]
        by_tensor = [schedule(torch.tensor(step)) for step in range(12)]
        assert [type(v) for v in by_int] == [type(v) for v in by_tensor], name
        assert [float(v) for v in by_int] == [float(v) for v in by_tensor], name


def test_inject_hyperparams_equals_the_plain_optimizer():
    schedule = optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, STEPS)
    params = _params()
    expected, _ = _train(optim.adamw(schedule, weight_decay=0.3, mask=_decays), params)
    inject = optim.inject_hyperparams(optim.adamw, static_args=("weight_decay",))
    got, state = _train(inject(lr=schedule, weight_decay=0.3, mask=_decays), params)
    assert_trees_equal(got, expected, "inject_hyperparams(adamw) vs adamw")
    assert set(state.hyperparams) == {"lr"}
    assert int(state.count) == STEPS
    assert float(state.hyperparams["lr"]) == float(schedule(STEPS - 1))  # the last one used
    # an injected weight decay is a tensor: u + (wd * p) rounds apart from the fused form
    opt = optim.inject_hyperparams(optim.adamw)(lr=schedule, weight_decay=0.3, mask=_decays)
    got, state = _train(opt, params)
    assert set(state.hyperparams) == {"lr", "weight_decay"}
    assert_trees_close(got, expected, rtol=0, atol=TOL, what="injected weight_decay")


def test_changing_lr_in_the_state_equals_a_fresh_optimizer_with_that_lr():
    params = _params()
    opt = optim.inject_hyperparams(optim.adamw, static_args=("weight_decay",))(
        lr=1e-2, weight_decay=0.3
    )
    x, y = _data()
    state = opt.init(params)
    plain = optim.adamw(1e-2, weight_decay=0.3)
    plain_state = plain.init(params)
    for _ in range(3):
        grads = torch.func.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        expected, plain_state = plain.update(grads, plain_state, params)
        assert_trees_equal(updates, expected)
        params = optim.apply_updates(params, updates)
    state.hyperparams["lr"] = torch.tensor(3e-4, dtype=torch.float64)
    grads = torch.func.grad(_loss)(params, x, y)
    updates, state = opt.update(grads, state, params)
    expected, plain_state = optim.adamw(3e-4, weight_decay=0.3).update(grads, plain_state, params)
    assert_trees_equal((updates, state.inner_state), (expected, plain_state), "after the change")


def test_traced_step_reads_the_injected_lr_without_retracing():
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.3, mask=_decays)
    step = _step(opt)
    pstep = fddp.data_parallel(step)
    params = _params()
    state = opt.init(params)
    eager = (params, state)
    for seed, lr in enumerate((1e-2, 1e-3, 0.0, 5e-2)):
        state.hyperparams["lr"] = torch.tensor(lr, dtype=torch.float64)
        eager[1].hyperparams["lr"] = torch.tensor(lr, dtype=torch.float64)
        x, y = _data(seed)
        before = params
        params, state = pstep(params, state, x, y)
        eager = step(*eager, x, y)
        assert_trees_close((params, state), eager, rtol=0, atol=TOL, what=f"lr={lr}")
        if lr == 0.0:
            assert_trees_equal(params, before, "lr 0 leaves the params")
    assert pstep.retraces == 0


def test_inject_hyperparams_under_torch_func_vmap_with_a_learning_rate_per_member():
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.3)
    step = _step(opt)
    members = [_params(seed=i) for i in range(MEMBERS)]
    params = _stacked(members)
    state = torch.func.vmap(opt.init)(params)
    lrs = [1e-2, 3e-3, 1e-3]
    state.hyperparams["lr"] = torch.tensor(lrs, dtype=torch.float64)
    alone = [(p, optim.adamw(lr, weight_decay=0.3)) for p, lr in zip(members, lrs)]
    alone = [(p, o.init(p), o) for p, o in alone]
    x, y = _data()
    for _ in range(3):
        params, state = torch.func.vmap(step, in_dims=(0, 0, None, None))(params, state, x, y)
        alone = [(*_step(o)(p, s, x, y), o) for p, s, o in alone]
    expected = _stacked([(p, s) for p, s, _ in alone])
    assert_trees_close((params, state.inner_state), expected, rtol=0, atol=TOL, what="vmap")


def test_inject_hyperparams_keeps_structural_floats_fixed_and_traces_sgd_momentum():
    inject = optim.inject_hyperparams(optim.sgd)
    opt = inject(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)
    step = _step(opt)
    pstep = fddp.data_parallel(step)
    params = _params()
    state = opt.init(params)
    assert set(state.hyperparams) == {"lr", "weight_decay"}  # momentum shapes the chain
    inner = state.inner_state
    for seed, lr in enumerate((0.1, 0.02, 0.05)):
        state.hyperparams["lr"] = torch.tensor(lr, dtype=torch.float64)
        x, y = _data(seed)
        expected, inner = _step(optim.sgd(lr, 0.9, True, 1e-2))(params, inner, x, y)
        params, state = pstep(params, state, x, y)
        assert_trees_close((params, state.inner_state), (expected, inner), rtol=0, atol=TOL)
    assert pstep.retraces == 0


def test_inject_hyperparams_rejects_unknown_names():
    with pytest.raises(UsageTypeError, match="learning_rate"):
        optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3)
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-3)
    params = _params()
    state = opt.init(params)
    state.hyperparams["learning_rate"] = torch.tensor(1e-4, dtype=torch.float64)
    with pytest.raises(UsageValueError, match="learning_rate"):
        opt.update(params, state, params)
