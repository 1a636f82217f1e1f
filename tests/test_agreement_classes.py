"""Ranks agree by one mechanism: every class of difference a user can make between ranks is an
error on every rank naming the value and the ranks, written as users write steps (public API
only). Per class: a setting that differs per rank inside or outside a sharded transform, an
integer or tensor constant, a tensor hyperparameter, a replicated tensor of any size, an
injected hyperparameter changed on one rank, a per-rank warmup with ``trace=False``, a rank
that skips a call (default options, ``overlap_steps``, fully sharded), per-rank seeds under the
invariant mode; and no false error where the ranks legitimately differ (sharded state checked
with ``check_replicas=(0, 1)``). 2 gloo ranks, one spawn."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from _dist import raised, run_checks

import fddp
import fddp.optim as optim

SIZES = (6, 16, 12)  # biases of more than 8 elements
CALLS = 4
AGREEMENT_ERRORS = ("ScheduleMismatchError", "ReplicaMismatchError")


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(SIZES[1], SIZES[2]))
    return torch.nn.Sequential(*layers)


def _batch(call: int, rows: int = 4) -> dict:
    g = torch.Generator().manual_seed(100 * call + fddp.rank())
    return {
        "x": torch.randn(rows, SIZES[0], generator=g),
        "y": torch.randn(rows, SIZES[2], generator=g),
    }


def _step(opt, model: torch.nn.Module, *, sharded: bool = False, loss=None):
    """The step a user writes: ``step(params, opt_state, batch)``; with ``sharded`` (the
    optimizer is shard_state's) the gradients are not averaged by the step."""
    apply = fddp.functional(model)
    _, buffers = fddp.state(model)

    def loss_fn(p, batch):
        out = apply(p, buffers, batch["x"])
        return F.mse_loss(out, batch["y"]) if loss is None else loss(out, batch["y"])

    def step(params, opt_state, batch):
        value, grads = fddp.value_and_grad(loss_fn)(params, batch)
        if not sharded:
            grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(value)

    return step


def _train(opt, *, sharded=False, shard_params=False, loss=None, calls=CALLS, **options):
    """``calls`` calls of the user's step on rank-own batches; what the first failing call
    raised (type, first line), or ("ok", "")."""
    model = _model()
    params, _ = fddp.state(model)
    pstep = fddp.data_parallel(_step(opt, model, sharded=sharded, loss=loss), **options)
    state = opt.init(params)
    if shard_params:
        params = fddp.shard_params(params)
    for call in range(calls):
        try:
            params, state, _ = pstep(params, state, _batch(call))
        except Exception as e:
            return type(e).__name__, str(e).split("\n")[0]
    return "ok", ""


def _per_rank(first, second):
    return first if fddp.rank() == 0 else second


def _decays(params):
    return {name: p.ndim > 1 for name, p in params.items()}


# --- sharded steps: a per-rank setting outside the sharded transform, and inside it ---


def check_sharded_weight_decay_outside():
    """The docs' masked AdamW with sharded moments, its weight decay per rank."""
    opt = optim.chain(
        optim.shard_state(optim.scale_by_adam()),
        optim.masked(optim.add_decayed_weights(_per_rank(0.1, 0.2)), _decays),
        optim.scale_by_learning_rate(1e-2),
    )
    return _train(opt, sharded=True)


def check_sharded_mask_outside():
    def decays(params):
        return {name: (p.ndim > 1) if fddp.rank() == 0 else True for name, p in params.items()}

    opt = optim.chain(
        optim.shard_state(optim.scale_by_adam()),
        optim.masked(optim.add_decayed_weights(0.1), decays),
        optim.scale_by_learning_rate(1e-2),
    )
    return _train(opt, sharded=True)


def check_sharded_lr_scale_outside():
    opt = optim.chain(optim.shard_state(optim.adam(1e-2)), optim.scale(_per_rank(1.0, 0.5)))
    return _train(opt, sharded=True)


def check_sharded_lr_inside():
    return _train(optim.shard_state(optim.adamw(_per_rank(1e-2, 2e-2))), sharded=True)


def check_sharded_clip_inside():
    inner = optim.chain(optim.clip_by_global_norm(_per_rank(0.01, 0.02)), optim.adam(1e-2))
    return _train(optim.shard_state(inner), sharded=True)


def check_sharded_int_warmup_inside():
    schedule = optim.warmup_cosine_decay_schedule(
        0.0, 1e-2, warmup_steps=_per_rank(2, 3), decay_steps=100
    )
    return _train(optim.shard_state(optim.adamw(schedule)), sharded=True)


def check_fully_sharded_lr_inside():
    opt = optim.shard_state(optim.adamw(_per_rank(1e-2, 2e-2)))
    return _train(opt, sharded=True, shard_params=True)


# --- replicated steps ---


def check_integer_transition_steps():
    schedule = optim.linear_schedule(1e-2, 0.0, transition_steps=_per_rank(10, 20))
    return _train(optim.sgd(schedule))


def check_top_k():
    k = _per_rank(2, 3)

    def hardest(out, y):  # the mean over the k examples of largest loss
        per_example = ((out - y) ** 2).mean(dim=1)
        return torch.topk(per_example, k).values.mean()

    return _train(optim.sgd(0.1), loss=hardest)


def check_closure_tensor():
    weights = torch.arange(1.0, SIZES[2] + 1) * _per_rank(1.0, 1.5)

    def weighted(out, y):
        return (((out - y) ** 2) * weights).mean()

    return _train(optim.sgd(0.1), loss=weighted)


def check_tensor_hyperparameter():
    return _train(optim.adamw(1e-2, weight_decay=torch.tensor(_per_rank(0.01, 0.02))))


def check_tensor_lr_in_step():
    lr = _per_rank(0.1, 0.2)
    model = _model()
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    @fddp.data_parallel
    def step(params, batch):
        grads = fddp.grad(lambda p: F.mse_loss(apply(p, buffers, batch["x"]), batch["y"]))(params)
        rate = torch.tensor(lr)  # a tensor built inside the step
        return {k: v - rate * g for (k, v), g in zip(params.items(), fddp.pmean(grads).values())}

    return raised(lambda: [step(params, _batch(call)) for call in range(CALLS)])


def _changed_on_rank_1(opt, at: int, change):
    """CALLS calls of the user's step, where before call ``at`` rank 1 alone applies ``change``
    to its (params, state), which returns them; what was raised."""
    model = _model()
    params, _ = fddp.state(model)
    pstep = fddp.data_parallel(_step(opt, model))
    state = opt.init(params)

    def calls():
        nonlocal params, state
        for call in range(CALLS):
            if call == at and fddp.rank() == 1:
                params, state = change(params, state)
            params, state, _ = pstep(params, state, _batch(call))

    return raised(calls)


def check_replicated_tensor_of_many_elements():
    """After two calls rank 1 changes the first layer's 96-element weight (beyond the
    eight-element limit the per-call value check had)."""

    def changed(params, state):
        return {**params, "0.weight": params["0.weight"] + 1e-3}, state

    return _changed_on_rank_1(optim.sgd(0.1), 2, changed)


def check_inject_hyperparams_changed():
    def changed(params, state):
        state.hyperparams["lr"] = torch.tensor(2e-2, dtype=torch.float64)
        return params, state

    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.01)
    return _changed_on_rank_1(opt, 1, changed)


def check_eager_int_warmup():
    schedule = optim.warmup_cosine_decay_schedule(
        0.0, 1e-2, warmup_steps=_per_rank(2, 3), decay_steps=100
    )
    return _train(optim.adam(schedule), trace=False, calls=6)


# --- a rank that skips a call ---


def _skipping(**options):
    """Rank 1 skips a call's results: at the third call it passes back what its first call
    returned. Each rank's outcome of every call until the first that fails."""
    sharded = options.pop("sharded", False)
    shard_params = options.pop("shard_params", False)
    opt = optim.shard_state(optim.adam(1e-2)) if sharded else optim.adam(1e-2)
    model = _model()
    params, _ = fddp.state(model)
    pstep = fddp.data_parallel(_step(opt, model, sharded=sharded), **options)
    state = opt.init(params)
    if shard_params:
        params = fddp.shard_params(params)
    outcomes, history = [], []
    for call in range(3):
        history.append((params, state))
        if call == 2 and fddp.rank() == 1:
            params, state = history[1]
        try:
            params, state, _ = pstep(params, state, _batch(call))
        except Exception as e:
            outcomes.append((type(e).__name__, str(e).split("\n")[0]))
            break
        outcomes.append(("ok", ""))
    return outcomes


def check_skipped_call_default():
    return _skipping()


def check_skipped_call_overlap_steps():
    return _skipping(overlap_steps=True, check_replicas=(0, 1))


def check_skipped_call_fully_sharded():
    return _skipping(sharded=True, shard_params=True)


def check_sharded_state_checked_as_replicated():
    """check_replicas=(0, 1) with shard_state: the state's per-rank shards are the layout's,
    so a correct program trains (and matches the unsharded step)."""
    out = {}
    for name, opt, sharded in [
        ("sharded", optim.shard_state(optim.adam(1e-2)), True),
        ("plain", optim.adam(1e-2), False),
    ]:
        model = _model()
        params, _ = fddp.state(model)
        pstep = fddp.data_parallel(_step(opt, model, sharded=sharded), check_replicas=(0, 1))
        state = opt.init(params)
        try:
            for call in range(CALLS):
                params, state, _ = pstep(params, state, _batch(call))
            out[name] = params
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


# --- the invariant mode ---


def check_invariant_per_rank_seeds():
    """Dropout under the invariant mode with each rank seeding its own generator: the results
    would depend on the world size."""
    model = _model(dropout=0.5)
    torch.manual_seed(fddp.rank())
    opt = optim.sgd(0.1)
    params, _ = fddp.state(model)
    pstep = fddp.data_parallel(_step(opt, model), invariant=2)
    state = opt.init(params)
    return raised(lambda: pstep(params, state, _batch(0)))


def check_invariant_seeds_agree():
    """The same with one seed on every rank: it runs."""
    model = _model(dropout=0.5)
    torch.manual_seed(7)
    opt = optim.sgd(0.1)
    params, _ = fddp.state(model)
    pstep = fddp.data_parallel(_step(opt, model), invariant=2)
    state = opt.init(params)
    return raised(lambda: [pstep(params, state, _batch(call)) for call in range(2)])


# --- DiLoCo: the LowCommState and the inner state belong together ---


def _diloco_inner(opt):
    model = _model()
    apply = fddp.functional(model)
    _, buffers = fddp.state(model)

    def inner_step(params, opt_state, batch):
        def loss_fn(p):
            return F.mse_loss(apply(p, buffers, batch["x"]), batch["y"])

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return inner_step


def check_diloco_saved_apart(tmp: str) -> dict:
    """Mid-way through H, the LowCommState saved by one fddp.save and the inner state by
    another: each save is refused, naming the missing part; saved together (each rank its own
    file) the run resumes as it goes on."""
    inner_opt = optim.sgd(0.1)
    dstep = fddp.diloco(_diloco_inner(inner_opt), every=4)
    params, _ = fddp.state(_model())
    state, opt_state = dstep.init(params), inner_opt.init(params)
    for call in range(2):
        state, params, opt_state, _ = dstep(state, params, opt_state, _batch(call))
    path = os.path.join(tmp, f"rank{fddp.rank()}.pt")
    out = {
        "outer alone": raised(lambda: fddp.save(path, state)),
        "inner alone": raised(lambda: fddp.save(path, {"params": params, "opt": opt_state})),
    }
    together = {"state": state, "params": params, "opt": opt_state}
    out["together"] = raised(lambda: fddp.save(path, together, rank0_only=False))
    resumed = fddp.load(path, like=together)
    runs = []
    for tree in (together, resumed):
        state, params, opt_state = tree["state"], tree["params"], tree["opt"]
        for call in range(2, 5):
            state, params, opt_state, _ = dstep(state, params, opt_state, _batch(call))
        runs.append(params)
    out["resumed"] = runs
    return out


CHECKS = {
    "sharded_weight_decay_outside": check_sharded_weight_decay_outside,
    "sharded_mask_outside": check_sharded_mask_outside,
    "sharded_lr_scale_outside": check_sharded_lr_scale_outside,
    "sharded_lr_inside": check_sharded_lr_inside,
    "sharded_clip_inside": check_sharded_clip_inside,
    "sharded_int_warmup_inside": check_sharded_int_warmup_inside,
    "fully_sharded_lr_inside": check_fully_sharded_lr_inside,
    "integer_transition_steps": check_integer_transition_steps,
    "top_k": check_top_k,
    "closure_tensor": check_closure_tensor,
    "tensor_hyperparameter": check_tensor_hyperparameter,
    "tensor_lr_in_step": check_tensor_lr_in_step,
    "replicated_tensor_of_many_elements": check_replicated_tensor_of_many_elements,
    "inject_hyperparams_changed": check_inject_hyperparams_changed,
    "eager_int_warmup": check_eager_int_warmup,
    "skipped_call_default": check_skipped_call_default,
    "skipped_call_overlap_steps": check_skipped_call_overlap_steps,
    "skipped_call_fully_sharded": check_skipped_call_fully_sharded,
    "sharded_state_checked_as_replicated": check_sharded_state_checked_as_replicated,
    "invariant_per_rank_seeds": check_invariant_per_rank_seeds,
    "invariant_seeds_agree": check_invariant_seeds_agree,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    tmp = str(tmp_path_factory.mktemp("agreement"))
    checks = {**CHECKS, "diloco_saved_apart": functools.partial(check_diloco_saved_apart, tmp)}
    return run_checks(checks, world_size=2, timeout=600)


def _refused_alike(outcomes: list, *names: str) -> str:
    """Both ranks raised the same agreement error, naming the ranks and every one of
    ``names``; its message."""
    assert outcomes[0] == outcomes[1], outcomes
    kind, message = outcomes[0]
    assert kind in AGREEMENT_ERRORS, outcomes
    assert "on rank 1 but" in message and "on rank 0" in message, message
    for name in names:
        assert name in message, (name, message)
    return message


# (check, what the message must name: the value on each rank, or the leaf)
PROGRAM_CLASSES = {
    "sharded_weight_decay_outside": ("0.1", "0.2"),
    "sharded_mask_outside": ("node",),
    "sharded_lr_scale_outside": ("0.5", "1.0"),
    "sharded_lr_inside": ("0.01", "0.02"),
    "sharded_clip_inside": ("0.01", "0.02"),
    "sharded_int_warmup_inside": ("node",),
    "fully_sharded_lr_inside": ("0.01", "0.02"),
    "integer_transition_steps": ("10", "20"),
    "top_k": ("node",),
    "closure_tensor": ("constant",),
    "tensor_hyperparameter": ("constant",),
    "tensor_lr_in_step": ("constant",),
}


@pytest.mark.parametrize("name", sorted(PROGRAM_CLASSES))
def test_a_program_that_differs_per_rank_is_refused_naming_the_value(runs, name):
    _refused_alike(runs[name], "compiled different", *PROGRAM_CLASSES[name])


def test_a_replicated_tensor_of_any_size_changed_on_one_rank_is_refused(runs):
    _refused_alike(runs["replicated_tensor_of_many_elements"], "['0.weight']")


def test_an_injected_hyperparameter_changed_on_one_rank_is_refused(runs):
    _refused_alike(runs["inject_hyperparams_changed"], "[1].hyperparams['lr']")


def test_a_per_rank_warmup_in_an_eager_step_is_refused(runs):
    _refused_alike(runs["eager_int_warmup"])


@pytest.mark.parametrize("mode", ["default", "overlap_steps", "fully_sharded"])
def test_a_rank_that_skips_a_call_is_refused_on_every_rank(runs, mode):
    rank0, rank1 = runs[f"skipped_call_{mode}"]
    assert rank0[:2] == rank1[:2] == [("ok", "")] * 2
    _refused_alike([rank0[2], rank1[2]], "call 3", "skipped")


def test_sharded_state_checked_as_replicated_trains_as_the_plain_step(runs):
    for out in runs["sharded_state_checked_as_replicated"]:
        sharded, plain = out["sharded"], out["plain"]
        assert not isinstance(sharded, str), sharded
        assert not isinstance(plain, str), plain
        for key in plain:
            torch.testing.assert_close(sharded[key], plain[key], rtol=1e-5, atol=1e-6)


def test_per_rank_seeds_under_the_invariant_mode_are_refused_naming_the_generator(runs):
    _refused_alike(runs["invariant_per_rank_seeds"], "generator")
    assert runs["invariant_seeds_agree"] == [("ok", "")] * 2


def test_diloco_states_saved_apart_are_refused_naming_the_missing_part(runs):
    for out in runs["diloco_saved_apart"]:
        kind, message = out["outer alone"]
        assert kind == "ValueError" or kind.endswith("ValueError"), out
        assert "inner" in message, message
        kind, message = out["inner alone"]
        assert kind == "ValueError" or kind.endswith("ValueError"), out
        assert "LowCommState" in message, message
        assert out["together"] == ("ok", "")
        going_on, resumed = out["resumed"]
        for key in going_on:
            assert torch.equal(going_on[key], resumed[key]), key


def _two_argument_step(batch_argnum):
    """An invariant step whose loss takes the batch as two arguments, x and y."""
    model = _model()
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def loss_fn(p, x, y):
        return F.mse_loss(apply(p, buffers, x), y)

    def step(params, x, y):
        grads = fddp.grad(loss_fn)(params, x, y)
        return {k: v - 0.1 * g for (k, v), g in zip(params.items(), fddp.pmean(grads).values())}

    invariant = fddp.Invariant(chunk_size=2, batch_argnum=batch_argnum)
    return fddp.data_parallel(step, invariant=invariant, trace=False), params


def test_a_batch_over_two_arguments_is_chunked_whole_or_refused():
    batch = _batch(0)
    pstep, params = _two_argument_step(-1)
    with pytest.raises(ValueError, match=r"batch_argnum=\(1, 2\)"):
        pstep(params, batch["x"], batch["y"])
    pstep, params = _two_argument_step((1, 2))
    both = pstep(params, batch["x"], batch["y"])

    def packed(p, batch):  # the reference: the same batch as one argument
        return F.mse_loss(fddp.functional(_model())(p, {}, batch["x"]), batch["y"])

    @functools.partial(fddp.data_parallel, invariant=2, trace=False)
    def reference(params, batch):
        grads = fddp.grad(packed)(params, batch)
        return {k: v - 0.1 * g for (k, v), g in zip(params.items(), fddp.pmean(grads).values())}

    expected = reference(params, batch)
    for key in expected:
        assert torch.equal(both[key], expected[key]), key
