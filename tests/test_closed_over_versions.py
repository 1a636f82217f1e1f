"""A tensor the step closes over, changed in place after the compile: on one rank it is an error
on every rank naming it, before the call runs; alike on every rank the step trains as one
process would with the new value. A learning rate in the step's closure, an AdamW weight decay
tensor, steps with ``shard_state`` state and ``shard_params`` parameters, and
``check_replicas=False``, which turns the check off. 2 gloo ranks, one spawn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import raised, run_checks

import fddp
import fddp.optim as optim

CALLS = 4
CHANGED_AT = 2  # the call before which the tensor is changed
WORLD = 2


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.zeros(3)}


def _batch(call: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(x @ params["w"] + params["b"], y)


def _sgd_step(lr: torch.Tensor):
    """The step a user writes, its learning rate a tensor it closes over."""

    def step(params, x, y):
        grads = fddp.pmean(fddp.grad(_loss)(params, x, y))
        return {k: params[k] - lr * grads[k] for k in params}

    return step


def _sgd_changed(on_ranks: tuple[int, ...], inference: bool = False, **options):
    """CALLS calls of the closed-over-lr step; before call CHANGED_AT the ranks ``on_ranks``
    set the learning rate to 0.05 in place (``inference``: an inference tensor, which has no
    version counter, made and written under ``torch.inference_mode``). What was raised, and
    the parameters."""
    with torch.inference_mode(inference):
        lr = torch.tensor(0.1)
    pstep = fddp.data_parallel(_sgd_step(lr), **options)
    params = _params()

    def calls():
        nonlocal params
        for call in range(CALLS):
            if call == CHANGED_AT and fddp.rank() in on_ranks:
                with torch.inference_mode(inference):
                    lr.fill_(0.05)
            params = pstep(params, *_batch(call, fddp.rank()))

    return raised(calls), params


def check_lr_changed_on_one_rank():
    return _sgd_changed((1,))[0]


def check_inference_lr_changed_on_one_rank():
    return _sgd_changed((1,), inference=True)[0]


def check_lr_changed_alike():
    return _sgd_changed((0, 1))


def check_lr_changed_on_one_rank_unchecked():
    return _sgd_changed((1,), check_replicas=False)[0]


def _optimizer_changed(opt, weight_decay: torch.Tensor, *, sharded: bool, shard_params=False):
    """CALLS calls of a step with optimizer ``opt`` (``sharded``: its state is shard_state's,
    the gradients are not averaged by the step; ``shard_params``: the parameters rest as
    shards too); before call CHANGED_AT rank 1 alone doubles
    ``weight_decay``, which ``opt`` closes over. What was raised."""

    def step(params, opt_state, x, y):
        grads = fddp.grad(_loss)(params, x, y)
        if not sharded:
            grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    pstep = fddp.data_parallel(step)
    params = _params()
    state = opt.init(params)
    if shard_params:
        params = fddp.shard_params(params)

    def calls():
        nonlocal params, state
        for call in range(CALLS):
            if call == CHANGED_AT and fddp.rank() == 1:
                weight_decay.mul_(2)
            params, state = pstep(params, state, *_batch(call, fddp.rank()))

    return raised(calls)


def check_adamw_weight_decay_changed_on_one_rank():
    weight_decay = torch.tensor(0.01)
    opt = optim.adamw(1e-2, weight_decay=weight_decay)
    return _optimizer_changed(opt, weight_decay, sharded=False)


def check_sharded_state_weight_decay_changed_on_one_rank():
    weight_decay = torch.tensor(0.01)
    opt = optim.shard_state(optim.adamw(1e-2, weight_decay=weight_decay))
    return _optimizer_changed(opt, weight_decay, sharded=True)


def check_fully_sharded_weight_decay_changed_on_one_rank():
    weight_decay = torch.tensor(0.01)
    opt = optim.shard_state(optim.adamw(1e-2, weight_decay=weight_decay))
    return _optimizer_changed(opt, weight_decay, sharded=True, shard_params=True)


CHECKS = {
    "lr_changed_on_one_rank": check_lr_changed_on_one_rank,
    "inference_lr_changed_on_one_rank": check_inference_lr_changed_on_one_rank,
    "lr_changed_alike": check_lr_changed_alike,
    "lr_changed_on_one_rank_unchecked": check_lr_changed_on_one_rank_unchecked,
    "adamw_weight_decay_changed_on_one_rank": check_adamw_weight_decay_changed_on_one_rank,
    "sharded_state_weight_decay_changed_on_one_rank": (
        check_sharded_state_weight_decay_changed_on_one_rank
    ),
    "fully_sharded_weight_decay_changed_on_one_rank": (
        check_fully_sharded_weight_decay_changed_on_one_rank
    ),
}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, world_size=WORLD, timeout=600)


@pytest.mark.parametrize(
    "name",
    [
        "lr_changed_on_one_rank",
        "inference_lr_changed_on_one_rank",
        "adamw_weight_decay_changed_on_one_rank",
        "sharded_state_weight_decay_changed_on_one_rank",
        "fully_sharded_weight_decay_changed_on_one_rank",
    ],
)
def test_a_closed_over_tensor_changed_on_one_rank_is_refused_on_every_rank(runs, name):
    outcomes = runs[name]
    assert outcomes[0] == outcomes[1], outcomes
    kind, message = outcomes[0]
    assert kind == "ReplicaMismatchError", outcomes
    for said in ("the step closes over", "node '", "on rank 1 but", "on rank 0", "check_replicas"):
        assert said in message, (said, message)
    assert f"call {CHANGED_AT + 1}" in message, message


def test_a_closed_over_tensor_changed_alike_trains_as_one_process(runs):
    """The reference: plain autograd on the global batch (both ranks' rows), the learning rate
    0.1, then 0.05 from call CHANGED_AT."""
    params = _params()
    for call in range(CALLS):
        batches = [_batch(call, rank) for rank in range(WORLD)]
        x, y = (torch.cat(parts) for parts in zip(*batches))
        lr = 0.1 if call < CHANGED_AT else 0.05
        grads = torch.autograd.grad(
            _loss({k: v.requires_grad_() for k, v in params.items()}, x, y), list(params.values())
        )
        params = {k: (v - lr * g).detach() for (k, v), g in zip(params.items(), grads)}
    for outcome, trained in runs["lr_changed_alike"]:
        assert outcome == ("ok", "")
        assert trained.keys() == params.keys()
        for key in params:
            torch.testing.assert_close(trained[key], params[key], rtol=1e-6, atol=1e-7)


def test_check_replicas_false_turns_the_check_off(runs):
    assert runs["lr_changed_on_one_rank_unchecked"] == [("ok", "")] * WORLD
