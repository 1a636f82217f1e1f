"""fddp.data_parallel against single-process training and DDP, on 2 gloo ranks and a world of one.

The 2-rank checks run by name in one spawn: each trains one variant of a shared setup and
returns its parameter trajectory (the parameter trees after every step); the tests below read
them by name and compare them leaf by leaf. References: the same step without ``pmean`` on the
concatenated global batch (single process), and ``torch.nn.parallel.DistributedDataParallel``
where BatchNorm makes per-rank statistics matter.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import warnings

import _models
import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import (
    assert_ranks_equal,
    assert_trees_close,
    assert_trees_equal,
    detached,
    max_abs_diff,
)
from _dist import run_checks
from torch.nn.parallel import DistributedDataParallel

import fddp
import fddp.optim as optim
from fddp import CaptureError

WORLD = 2
STEPS = 12
MLP_SIZES = (12, 32, 32, 24, 4)
MLP_CAPS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}
ACCUM_K = 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
TIGHT = {"rtol": 1e-6, "atol": 1e-6}
SGD = optim.sgd(lr=0.05, momentum=0.9)


def _identity(tree):
    return tree


def _clone(tree):
    return optree.tree_map(torch.clone, tree)


def _make_step(loss_fn, opt, reduce):
    """``step(params, opt_state, batch)``; ``reduce`` is ``fddp.pmean`` or, for the reference
    run on the global batch, the identity."""

    def step(params, opt_state, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        grads = reduce(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, reduce(loss)

    return step


def _make_accum_step(loss_fn, opt, k):
    """Gradient accumulation inside the step: k microbatches summed, one pmean."""

    def step(params, opt_state, batch):
        rows = batch["x"].shape[0] // k
        total_loss, total = None, None
        for i in range(k):
            micro = optree.tree_map(lambda t, i=i: t[i * rows : (i + 1) * rows], batch)
            loss, grads = fddp.value_and_grad(loss_fn)(params, micro)
            if total is None:
                total_loss, total = loss, grads
            else:
                total_loss = total_loss + loss
                total = optree.tree_map(torch.add, total, grads)
        grads = fddp.pmean(optree.tree_map(lambda g: g / k, total))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(total_loss / k)

    return step


def _train(step, params, opt_state, batches, *, check_unchanged=False, fresh=False):
    """Run ``step`` over ``batches``; return the params (and losses) after every step.

    ``fresh`` passes clones of the initial state (for donated runs); ``check_unchanged``
    keeps every call's arguments and their pre-call clones, to compare after the run.
    """
    if fresh:
        params, opt_state = _clone(params), _clone(opt_state)
    trajectory, losses, calls = [], [], []
    for batch in batches:
        before = _clone((params, opt_state, batch)) if check_unchanged else None
        args = (params, opt_state, batch)
        params, opt_state, loss = step(*args)
        if check_unchanged:
            calls.append({"after": detached(args), "before": before})
        trajectory.append(detached(params))
        losses.append(loss.detach().clone())
    return {"params": trajectory, "loss": losses, "calls": calls}


# --- 2 ranks: an MLP, every option -----------------------------------------------------------


def _mlp_setup():
    model = _models.mlp(MLP_SIZES)
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return F.mse_loss(apply(params, {}, batch["x"]), batch["y"])

    return model, loss_fn


@functools.cache
def _mlp_case():
    """This rank's MLP setup, shared by the MLP checks (they run in one process, in order)."""
    model, loss_fn = _mlp_setup()
    params = fddp.replicate(fddp.state(model)[0])
    state = SGD.init(params)
    rows, d_in, d_out = 12, MLP_SIZES[0], MLP_SIZES[-1]
    global_batches = [_models.regression_batch(s, rows, d_in, d_out) for s in range(STEPS)]
    batches = [fddp.shard(b) for b in global_batches]
    return loss_fn, params, state, global_batches, batches


@functools.cache
def _mlp_pstep(variant: str):
    """The data_parallel step of a variant, made once per rank (its schedule is read later)."""
    loss_fn = _mlp_case()[0]
    step = _make_step(loss_fn, SGD, fddp.pmean)
    if variant == "fx":
        return fddp.data_parallel(step, **MLP_CAPS)
    if variant == "eager":
        return fddp.data_parallel(step, trace=False)
    if variant == "donated":
        return fddp.data_parallel(step, donate_argnums=(0, 1), **MLP_CAPS)
    if variant == "bf16":
        return fddp.data_parallel(step, comm_dtype=torch.bfloat16, **MLP_CAPS)
    if variant == "accum":
        return fddp.data_parallel(_make_accum_step(loss_fn, SGD, ACCUM_K), **MLP_CAPS)
    if variant == "item_eager":
        return fddp.data_parallel(_step_with_item(loss_fn), trace=False)
    assert variant == "inductor", variant
    return fddp.data_parallel(step, compile=True, **MLP_CAPS)


def _step_with_item(loss_fn):
    def step_with_item(params, opt_state, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        if loss.item() > 0:  # Python control flow on a tensor value: not capturable
            grads = fddp.pmean(grads)
        updates, opt_state = SGD.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step_with_item


def check_mlp_reference():
    loss_fn, params, state, global_batches, _ = _mlp_case()
    return _train(_make_step(loss_fn, SGD, _identity), params, state, global_batches)


def check_mlp_variant(variant: str, **options):
    _, params, state, _, batches = _mlp_case()
    steps = batches[:2] if variant == "item_eager" else batches
    return _train(_mlp_pstep(variant), params, state, steps, **options)


def check_mlp_schedule(variant: str):
    _, params, state, _, batches = _mlp_case()
    plan = _mlp_pstep(variant).schedule(params, state, batches[0])
    return [(c.kind, c.leaves, c.dtype) for c in plan.collectives]


def check_mlp_gradient_writers():
    _, params, state, _, batches = _mlp_case()
    graph = _mlp_pstep("fx").graph(params, state, batches[0]).graph
    return [(str(n.target), n.kwargs.get("alpha")) for n in graph.nodes if "out" in str(n.target)]


def check_mlp_donated_batch():
    """A batch passed to a step that donates other arguments: (after the call, before)."""
    _, params, state, _, batches = _mlp_case()
    batch = _clone(batches[0])
    _mlp_pstep("donated")(_clone(params), _clone(state), batch)
    return batch, batches[0]


def check_mlp_capture_error():
    loss_fn, params, state, _, batches = _mlp_case()
    try:
        fddp.data_parallel(_step_with_item(loss_fn))(params, state, batches[0])
    except Exception as e:
        return (isinstance(e, CaptureError), isinstance(e, RuntimeError), str(e))
    return None


def test_mlp_matches_single_process_on_global_batch(runs):
    for rank, (fx, reference, plan) in enumerate(
        zip(runs["fx"], runs["reference"], runs["fx_schedule"], strict=True)
    ):
        assert_trees_close(fx["params"], reference["params"], **TOL, what=f"rank {rank} params")
        assert_trees_close(fx["loss"], reference["loss"], **TOL, what=f"rank {rank} losses")
        assert max_abs_diff(fx["params"][-1], fx["params"][0]) > 0.05  # it trains
        assert len({c[1] for c in plan}) > 2  # several buckets


@pytest.mark.parametrize(
    "variant",
    [
        "fx",
        "eager",
        "donated",
        "bf16",
        "accum",
        "inductor",
    ],
)
def test_ranks_bitwise_identical_after_every_step(runs, variant):
    assert_ranks_equal([run["params"] for run in runs[variant]], f"{variant} params by step")


@pytest.mark.parametrize("variant", ["fx", "inductor"])
def test_fx_and_inductor_backends_match_trace_false(runs, variant):
    for rank in range(WORLD):
        eager = runs["eager"][rank]["params"]
        got = runs[variant][rank]["params"]
        assert_trees_close(got, eager, **TIGHT, what=f"{variant} vs trace=False, rank {rank}")
        reference = runs["reference"][rank]["params"]
        assert_trees_close(eager, reference, **TOL, what=f"trace=False vs reference, rank {rank}")


def test_weight_gradients_are_computed_in_their_bucket_with_the_pmean_folded_in(runs):
    """Each Linear weight's gradient matmul writes into its bucket slot, scaled by 1/2 (exact
    for a power-of-two world), so the traced step equals the eager psum-then-divide bitwise."""
    for rank, writers in enumerate(runs["fx_gradient_writers"]):
        weights = len(MLP_SIZES) - 1
        assert writers.count(("aten.addmm.out", 1 / WORLD)) == weights, writers
        fx, eager = runs["fx"][rank]["params"], runs["eager"][rank]["params"]
        assert_trees_equal(fx, eager, f"fx vs trace=False, rank {rank}")


def test_without_donation_inputs_are_never_mutated(runs):
    for rank, fx in enumerate(runs["fx"]):
        assert len(fx["calls"]) == STEPS
        for i, call in enumerate(fx["calls"]):
            assert_trees_equal(call["after"], call["before"], f"rank {rank}, call {i + 1}")
    for after, before in runs["donated_batch"]:  # not donated, though others are
        assert_trees_equal(after, before, "the batch of a donating step")


def test_donation_gives_the_same_results(runs):
    for rank, (donated, fx) in enumerate(zip(runs["donated"], runs["fx"], strict=True)):
        assert_trees_close(donated["params"], fx["params"], **TIGHT, what=f"rank {rank} params")
        assert_trees_close(donated["loss"], fx["loss"], **TIGHT, what=f"rank {rank} losses")


def test_comm_dtype_bfloat16_schedule_reduces_in_bfloat16(runs):
    for bf16, fx in zip(runs["bf16_schedule"], runs["fx_schedule"], strict=True):
        assert {dtype for _, _, dtype in bf16} == {"bfloat16"}
        assert [names for _, names, _ in bf16] == [names for _, names, _ in fx]


def test_comm_dtype_bfloat16_results_close_to_float32(runs):
    for rank, (bf16, fx) in enumerate(zip(runs["bf16"], runs["fx"], strict=True)):
        assert_trees_close(bf16["params"], fx["params"], rtol=2e-2, atol=2e-3, what=f"rank {rank}")
        assert max_abs_diff(bf16["params"][-1], fx["params"][-1]) > 0  # the cast did happen


def test_grad_accumulation_one_all_reduce_per_bucket_and_same_result(runs):
    for rank in range(WORLD):
        leaves = [leaf for _, names, _ in runs["accum_schedule"][rank] for leaf in names]
        expected = [leaf for _, names, _ in runs["fx_schedule"][rank] for leaf in names]
        assert sorted(leaves) == sorted(expected)  # each leaf reduced once, not ACCUM_K times
        assert len(leaves) == 2 * (len(MLP_SIZES) - 1) + 1  # the gradients and the loss
        accum, fx = runs["accum"][rank], runs["fx"][rank]
        assert_trees_close(accum["params"], fx["params"], **TOL, what=f"rank {rank} params")
        assert_trees_close(accum["loss"], fx["loss"], **TOL, what=f"rank {rank} losses")


def test_uncapturable_step_raises_capture_error_on_every_rank(runs):
    for rank, error in enumerate(runs["capture_error"]):
        assert error is not None, "a step with loss.item() control flow was captured"
        is_capture_error, is_runtime_error, message = error
        assert is_capture_error and is_runtime_error
        assert "trace=False" in message and "item" in message
        reference = runs["reference"][rank]["params"][:2]
        got = runs["item_eager"][rank]["params"]
        assert_trees_close(got, reference, **TOL, what=f"trace=False with .item(), rank {rank}")


# --- 2 ranks: a CNN with BatchNorm against DDP, a decoder, a Hugging Face model ----------------


def _cnn_run(steps: int) -> dict:
    model = _models.small_cnn()
    with warnings.catch_warnings():  # torch 2.13 suggests forward_sync_buffers (new there)
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model, return_buffers=True)
    opt = optim.sgd(lr=0.05, momentum=0.9)

    def loss_fn(params, buffers, batch):
        logits, new_buffers = apply(params, buffers, batch["x"])
        return F.cross_entropy(logits, batch["y"]), new_buffers

    @fddp.data_parallel
    def step(params, opt_state, buffers, batch):
        (loss, new_buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, batch
        )
        grads = fddp.pmean(grads)
        floats = {k: v for k, v in new_buffers.items() if v.is_floating_point()}
        new_buffers = {**new_buffers, **fddp.pmean(floats)}
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, new_buffers, fddp.pmean(loss)

    state = opt.init(params)
    out = {"params": [], "ddp_params": [], "buffers": [], "ddp_buffers": [], "counts": []}
    for s in range(steps):
        batch = fddp.shard(_models.image_batch(s, 8))
        params, state, buffers, _ = step(params, state, buffers, batch)
        torch_opt.zero_grad()
        F.cross_entropy(ddp(batch["x"]), batch["y"]).backward()
        torch_opt.step()
        # fddp pmeans the running statistics; DDP (broadcast_buffers=False) keeps per-rank
        # ones, and their rank mean follows the same linear update.
        ddp_buffers = dict(ddp.module.named_buffers())
        mean = {k: v.clone() for k, v in ddp_buffers.items() if v.is_floating_point()}
        for v in mean.values():
            dist.all_reduce(v)
            v /= fddp.world_size()
        out["params"].append(detached(params))
        out["ddp_params"].append(detached(dict(ddp.module.named_parameters())))
        out["buffers"].append(detached({k: buffers[k] for k in mean}))
        out["ddp_buffers"].append(detached(mean))
        out["counts"].append(
            (
                buffers["bn1.num_batches_tracked"].item(),
                ddp_buffers["bn1.num_batches_tracked"].item(),
            )
        )
    return out


def _lm_run(model, opt, steps: int, logits_of) -> dict:
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return _models.next_token_loss(logits_of(apply(params, buffers, batch)), batch)

    state = opt.init(params)
    global_batches = [_models.token_batch(s, 4) for s in range(steps)]
    step = fddp.data_parallel(_make_step(loss_fn, opt, fddp.pmean))
    out = {"reference": _train(_make_step(loss_fn, opt, _identity), params, state, global_batches)}
    out["fx"] = _train(step, params, state, [fddp.shard(b) for b in global_batches])
    return out


def _logits(output):
    return output.logits


def _lm_run_decoder(steps: int) -> dict:
    return _lm_run(_models.tiny_decoder(), SGD, steps, _identity)


def check_gpt2():
    if importlib.util.find_spec("transformers") is None:
        return None
    # Adam divides by sqrt(v) + eps: a large eps keeps near-zero gradients (rounding noise in
    # both runs) from turning into different lr-sized updates.
    adamw = optim.adamw(lr=1e-2, eps=1e-4)
    return _lm_run(_models.tiny_gpt2(), adamw, 10, _logits)


# Run in this order on both ranks, in one spawn.
CHECKS = {
    "reference": check_mlp_reference,
    "fx": functools.partial(check_mlp_variant, "fx", check_unchanged=True),
    "fx_schedule": functools.partial(check_mlp_schedule, "fx"),
    "eager": functools.partial(check_mlp_variant, "eager"),
    "fx_gradient_writers": check_mlp_gradient_writers,
    "donated": functools.partial(check_mlp_variant, "donated", fresh=True),
    "donated_batch": check_mlp_donated_batch,
    "bf16": functools.partial(check_mlp_variant, "bf16"),
    "bf16_schedule": functools.partial(check_mlp_schedule, "bf16"),
    "accum": functools.partial(check_mlp_variant, "accum"),
    "accum_schedule": functools.partial(check_mlp_schedule, "accum"),
    "capture_error": check_mlp_capture_error,
    "item_eager": functools.partial(check_mlp_variant, "item_eager"),
    "inductor": functools.partial(check_mlp_variant, "inductor"),
    "cnn": functools.partial(_cnn_run, 10),
    "decoder": functools.partial(_lm_run_decoder, 10),
    "gpt2": check_gpt2,
}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, WORLD, timeout=300)


def test_cnn_with_batchnorm_matches_ddp(runs):
    for rank, cnn in enumerate(runs["cnn"]):
        assert_trees_close(cnn["params"], cnn["ddp_params"], **TOL, what=f"rank {rank} params")
        assert_trees_close(cnn["buffers"], cnn["ddp_buffers"], **TOL, what=f"rank {rank} buffers")
        assert cnn["counts"] == [(s + 1, s + 1) for s in range(len(cnn["counts"]))]
    for name in ("params", "buffers"):
        assert_ranks_equal([cnn[name] for cnn in runs["cnn"]], f"cnn {name} by step")


@pytest.mark.parametrize("model", ["decoder", "gpt2"])
def test_language_model_matches_single_process_on_global_batch(runs, model):
    if model == "gpt2":
        pytest.importorskip("transformers")
    for rank, run in enumerate(runs[model]):
        fx, reference = run["fx"], run["reference"]
        assert_trees_close(fx["params"], reference["params"], **TOL, what=f"rank {rank} params")
        assert_trees_close(fx["loss"], reference["loss"], **TOL, what=f"rank {rank} losses")
    assert_ranks_equal([run["fx"]["params"] for run in runs[model]], f"{model} params by step")


# --- a world of one: signatures, closures, capture errors ------------------------------------


def _tiny_setup():
    model, loss_fn = _mlp_setup()
    params = fddp.state(model)[0]
    opt = optim.sgd(lr=0.1)
    return params, opt, loss_fn


def test_same_signature_does_not_retrace_and_new_batch_shape_does():
    params, opt, loss_fn = _tiny_setup()
    step = _make_step(loss_fn, opt, fddp.pmean)
    pstep = fddp.data_parallel(step)
    state = opt.init(params)
    small = _models.regression_batch(0, 4, MLP_SIZES[0], MLP_SIZES[-1])
    large = _models.regression_batch(1, 6, MLP_SIZES[0], MLP_SIZES[-1])
    p1, _, _ = pstep(params, state, small)
    p2, _, _ = pstep(p1, state, _models.regression_batch(2, 4, MLP_SIZES[0], MLP_SIZES[-1]))
    assert pstep.retraces == 0  # one program compiled
    p3, _, _ = pstep(p2, state, large)
    assert pstep.retraces == 1  # a second one
    pstep(p3, state, small)  # back to a known signature: cached, compiled no more
    assert pstep.retraces == 1
    expected, _, _ = step(p2, state, large)
    assert_trees_close(p3, expected, **TIGHT)


def test_donated_params_and_optimizer_state_are_updated_in_place():
    params, _, loss_fn = _tiny_setup()
    opt = optim.adamw(lr=1e-2)
    step = _make_step(loss_fn, opt, fddp.pmean)
    donating = fddp.data_parallel(step, donate_argnums=(0, 1))
    plain = fddp.data_parallel(step)
    p, s = _clone(params), opt.init(_clone(params))
    q, t = params, opt.init(params)
    storage = {x.data_ptr() for x in optree.tree_leaves((p, s))}
    for i in range(3):
        batch = _models.regression_batch(i, 4, MLP_SIZES[0], MLP_SIZES[-1])
        p, s, donated_loss = donating(p, s, batch)
        q, t, loss = plain(q, t, batch)
        # one copy of the parameters and optimizer state: the outputs live in the inputs
        assert {x.data_ptr() for x in optree.tree_leaves((p, s))} == storage
        assert_trees_close((p, s, donated_loss), (q, t, loss), **TIGHT)


class _Scaled(torch.nn.Module):
    """A module with a buffer its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, -1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_step_may_close_over_module_buffers_and_constants():
    torch.manual_seed(0)
    model = _Scaled()
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    target = torch.randn(3)
    weights = torch.tensor([1.0, 3.0, 0.5])
    opt = optim.sgd(lr=0.1)

    def step(params, opt_state, x):  # closes over buffers, target, weights
        loss, grads = fddp.value_and_grad(
            lambda p: ((apply(p, buffers, x) - target) ** 2 * weights).mean()
        )(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    traced, eager = fddp.data_parallel(step), fddp.data_parallel(step, trace=False)
    state = opt.init(params)
    p_traced, p_eager = params, params
    for s in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(s))
        p_traced, _, loss_traced = traced(p_traced, state, x)
        p_eager, _, loss_eager = eager(p_eager, state, x)
        assert_trees_close(p_traced, p_eager, **TIGHT)
        assert_trees_close(loss_traced, loss_eager, **TIGHT)
    assert traced.retraces == 0


def test_uncapturable_step_names_the_cause_and_trace_false_runs_it():
    params, _, loss_fn = _tiny_setup()

    def step(params, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        if loss.item() > 0:
            grads = fddp.pmean(grads)
        return optree.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    batch = _models.regression_batch(0, 4, MLP_SIZES[0], MLP_SIZES[-1])
    with pytest.raises(CaptureError, match="trace=False") as info:
        fddp.data_parallel(step)(params, batch)
    assert isinstance(info.value, RuntimeError)
    assert "item" in str(info.value)
    assert_trees_close(fddp.data_parallel(step, trace=False)(params, batch), step(params, batch))


def test_a_step_that_fails_eagerly_too_shows_the_plain_error():
    """Both capture attempts fail on a step with a bug of its own: the error shows make_fx's
    plain message (the bug), not only Dynamo's account of it."""
    model = torch.nn.Linear(3, 2)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)

    def step(params, x):
        loss = apply(params, buffers, x, return_buffers=True).sum()  # a keyword forward lacks
        return fddp.pmean(fddp.grad(lambda p: loss)(params))

    with pytest.raises(CaptureError) as info:
        fddp.data_parallel(step)(params, torch.ones(4, 3))
    message = str(info.value)
    assert message.startswith("TypeError: "), message
    assert "return_buffers" in message and "trace=False" in message, message
