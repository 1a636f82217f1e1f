"""The same step under fddp.vmap (simulated replicas) and fddp.data_parallel (real ranks)."""

from __future__ import annotations

import functools

import pytest
import torch
from _compare import assert_trees_close, max_abs_diff
from _dist import run_checks
from _models import mlp, next_token_loss, tiny_decoder

import fddp
import fddp.optim as optim

STEPS = 10
REPLICAS = 2


def _mlp_case():
    model = mlp((6, 16, 16, 3))
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return torch.nn.functional.mse_loss(apply(params, {}, batch["x"]), batch["y"])

    def batches(step):
        g = torch.Generator().manual_seed(step)
        return {
            "x": torch.randn(REPLICAS, 4, 6, generator=g),
            "y": torch.randn(REPLICAS, 4, 3, generator=g),
        }

    return model, loss_fn, batches


def _decoder_case():
    model = tiny_decoder()
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return next_token_loss(apply(params, {}, batch["ids"]), batch["ids"])

    def batches(step):
        g = torch.Generator().manual_seed(step)
        return {"ids": torch.randint(0, 32, (REPLICAS, 3, 12), generator=g)}

    return model, loss_fn, batches


CASES = {"mlp": _mlp_case, "decoder": _decoder_case}


def _make_step(loss_fn):
    # SGD, not Adam: Adam divides by the gradient's running magnitude, which blows float noise
    # in gradients that are zero in exact arithmetic (the attention key bias) up to lr-sized
    # steps, so two correct implementations would drift apart.
    opt = optim.sgd(lr=0.1, momentum=0.9)

    def step(params, opt_state, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step, opt


def _train_on_ranks(name: str) -> tuple[dict, torch.Tensor]:
    model, loss_fn, batches = CASES[name]()
    step, opt = _make_step(loss_fn)
    params, _ = fddp.state(model)
    opt_state = opt.init(params)
    pstep = fddp.data_parallel(step)
    for i in range(STEPS):
        local = {k: v[fddp.rank()] for k, v in batches(i).items()}
        params, opt_state, loss = pstep(params, opt_state, local)
    return params, loss


def _train_simulated(name: str) -> tuple[dict, torch.Tensor]:
    model, loss_fn, batches = CASES[name]()
    step, opt = _make_step(loss_fn)
    params, _ = fddp.state(model)
    opt_state = opt.init(params)
    sim = fddp.vmap(step, in_dims=(None, None, 0), out_dims=(None, None, None))
    for i in range(STEPS):
        params, opt_state, loss = sim(params, opt_state, batches(i))
    return params, loss


@pytest.fixture(scope="module")
def ranks():
    checks = {name: functools.partial(_train_on_ranks, name) for name in CASES}
    return run_checks(checks, 2, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_matches_two_real_ranks(ranks, name):
    simulated, sim_loss = _train_simulated(name)
    for rank, (params, loss) in enumerate(ranks[name]):
        assert_trees_close(params, simulated, rtol=0, atol=1e-6, what=f"{name}, rank {rank}")
        assert_trees_close(loss, sim_loss, rtol=0, atol=1e-6, what=f"{name} loss, rank {rank}")
    moved = max_abs_diff(simulated, fddp.state(CASES[name]()[0])[0])
    assert moved > 1e-3, "the parameters must actually train for the comparison to mean anything"
