"""fddp.data_parallel against single-process training and DDP, on 2 gloo ranks and a world of one.

The 2-rank runs are grouped (a spawn costs seconds): each worker trains several variants of one
setup and returns their parameter trajectories; the tests below compare them. References: the
same step without ``pmean`` on the concatenated global batch (single process), and
``torch.nn.parallel.DistributedDataParallel`` where BatchNorm makes per-rank statistics matter.
"""

from __future__ import annotations

import copy
import importlib.util
import traceback
import warnings

import _models
import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_ranks
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


def _flat(tree) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in optree.tree_leaves(tree)])


def _clone(tree):
    return optree.tree_map(torch.clone, tree)


def _tree_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


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
    """Run ``step`` over ``batches``; return flat params (and losses) after every step.

    ``fresh`` passes clones of the initial state (for donated runs); ``check_unchanged``
    records whether every argument still equals its pre-call clone after each call.
    """
    if fresh:
        params, opt_state = _clone(params), _clone(opt_state)
    trajectory, losses, unchanged = [], [], True
    for batch in batches:
        before = _clone((params, opt_state, batch)) if check_unchanged else None
        args = (params, opt_state, batch)
        params, opt_state, loss = step(*args)
        if check_unchanged:
            unchanged = unchanged and _tree_equal(args, before)
        trajectory.append(_flat(params))
        losses.append(loss.detach().clone())
    return {"params": trajectory, "loss": losses, "unchanged": unchanged}


# --- 2 ranks: an MLP, every option -----------------------------------------------------------


def _mlp_setup():
    model = _models.mlp(MLP_SIZES)
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return F.mse_loss(apply(params, {}, batch["x"]), batch["y"])

    return model, loss_fn


def _attempt(out: dict, name: str, fn) -> None:
    """``out[name] = fn()``, or the traceback: one failing variant must not hide the others.

    Every variant fails or succeeds alike on all ranks (same code, same shapes), so a rank that
    records an error does not leave its peer waiting in a collective.
    """
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc()}


def _result(run: dict, name: str):
    value = run[name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"{name} raised on a rank:\n{value['error']}", pytrace=False)
    return value


def _mlp_worker() -> dict:
    model, loss_fn = _mlp_setup()
    params = fddp.replicate(fddp.state(model)[0])
    opt = SGD
    state = opt.init(params)
    rows, d_in, d_out = 12, MLP_SIZES[0], MLP_SIZES[-1]
    global_batches = [_models.regression_batch(s, rows, d_in, d_out) for s in range(STEPS)]
    batches = [fddp.shard(b) for b in global_batches]
    step = _make_step(loss_fn, opt, fddp.pmean)

    def schedule(pstep):
        return [
            (c.kind, c.leaves, c.dtype)
            for c in pstep.schedule(params, state, batches[0]).collectives
        ]

    out: dict = {}
    reference = _make_step(loss_fn, opt, _identity)
    _attempt(out, "reference", lambda: _train(reference, params, state, global_batches))
    fx = fddp.data_parallel(step, **MLP_CAPS)
    _attempt(out, "fx", lambda: _train(fx, params, state, batches, check_unchanged=True))
    _attempt(out, "fx_schedule", lambda: schedule(fx))
    eager = fddp.data_parallel(step, trace=False)
    _attempt(out, "eager", lambda: _train(eager, params, state, batches))

    def gradient_writers(pstep):
        graph = pstep.graph(params, state, batches[0]).graph
        return [
            (str(n.target), n.kwargs.get("alpha")) for n in graph.nodes if "out" in str(n.target)
        ]

    _attempt(out, "fx_gradient_writers", lambda: gradient_writers(fx))

    donated = fddp.data_parallel(step, donate_argnums=(0, 1), **MLP_CAPS)
    _attempt(out, "donated", lambda: _train(donated, params, state, batches, fresh=True))

    def batch_unchanged():
        batch = _clone(batches[0])
        donated(_clone(params), _clone(state), batch)
        return _tree_equal(batch, batches[0])

    _attempt(out, "donated_batch_unchanged", batch_unchanged)

    bf16 = fddp.data_parallel(step, comm_dtype=torch.bfloat16, **MLP_CAPS)
    _attempt(out, "bf16", lambda: _train(bf16, params, state, batches))
    _attempt(out, "bf16_schedule", lambda: schedule(bf16))

    accum = fddp.data_parallel(_make_accum_step(loss_fn, opt, ACCUM_K), **MLP_CAPS)
    _attempt(out, "accum", lambda: _train(accum, params, state, batches))
    _attempt(out, "accum_schedule", lambda: schedule(accum))

    def step_with_item(params, opt_state, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        if loss.item() > 0:  # Python control flow on a tensor value: not capturable
            grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    def capture_error():
        try:
            fddp.data_parallel(step_with_item)(params, state, batches[0])
        except Exception as e:
            return (isinstance(e, CaptureError), isinstance(e, RuntimeError), str(e))
        return None

    _attempt(out, "capture_error", capture_error)
    item_eager = fddp.data_parallel(step_with_item, trace=False)
    _attempt(out, "item_eager", lambda: _train(item_eager, params, state, batches[:2]))

    inductor = fddp.data_parallel(step, compile=True, **MLP_CAPS)
    _attempt(out, "inductor", lambda: _train(inductor, params, state, batches))
    return out


@pytest.fixture(scope="module")
def mlp_runs() -> list[dict]:
    return run_ranks(_mlp_worker, WORLD, timeout=240)


def _assert_trajectories_close(actual: list, expected: list, **tol) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m, i=i: f"after step {i + 1}: {m}")


def _assert_ranks_bitwise_equal(trajectories: list[list[torch.Tensor]], name: str) -> None:
    for r in range(1, len(trajectories)):
        for i, (a, b) in enumerate(zip(trajectories[0], trajectories[r])):
            assert torch.equal(a, b), f"{name}: rank {r} differs from rank 0 after step {i + 1}"


def test_mlp_matches_single_process_on_global_batch(mlp_runs):
    for run in mlp_runs:
        fx, reference = _result(run, "fx"), _result(run, "reference")
        _assert_trajectories_close(fx["params"], reference["params"], **TOL)
        _assert_trajectories_close(fx["loss"], reference["loss"], **TOL)
        assert (fx["params"][-1] - fx["params"][0]).abs().max() > 0.05  # it trains
        assert len({c[1] for c in _result(run, "fx_schedule")}) > 2  # several buckets


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
def test_ranks_bitwise_identical_after_every_step(mlp_runs, variant):
    _assert_ranks_bitwise_equal([_result(run, variant)["params"] for run in mlp_runs], variant)


@pytest.mark.parametrize("variant", ["fx", "inductor"])
def test_fx_and_inductor_backends_match_trace_false(mlp_runs, variant):
    for run in mlp_runs:
        eager = _result(run, "eager")["params"]
        _assert_trajectories_close(_result(run, variant)["params"], eager, **TIGHT)
        _assert_trajectories_close(eager, _result(run, "reference")["params"], **TOL)


def test_weight_gradients_are_computed_in_their_bucket_with_the_pmean_folded_in(mlp_runs):
    """Each Linear weight's gradient matmul writes into its bucket slot, scaled by 1/2 (exact
    for a power-of-two world), so the traced step equals the eager psum-then-divide bitwise."""
    for run in mlp_runs:
        writers = _result(run, "fx_gradient_writers")
        weights = len(MLP_SIZES) - 1
        assert writers.count(("aten.addmm.out", 1 / WORLD)) == weights, writers
        fx, eager = _result(run, "fx")["params"], _result(run, "eager")["params"]
        assert all(torch.equal(a, b) for a, b in zip(fx, eager))


def test_without_donation_inputs_are_never_mutated(mlp_runs):
    for run in mlp_runs:
        assert _result(run, "fx")["unchanged"]
        assert _result(run, "donated_batch_unchanged")  # not donated, though others are


def test_donation_gives_the_same_results(mlp_runs):
    for run in mlp_runs:
        donated, fx = _result(run, "donated"), _result(run, "fx")
        _assert_trajectories_close(donated["params"], fx["params"], **TIGHT)
        _assert_trajectories_close(donated["loss"], fx["loss"], **TIGHT)


def test_comm_dtype_bfloat16_schedule_reduces_in_bfloat16(mlp_runs):
    for run in mlp_runs:
        assert {dtype for _, _, dtype in _result(run, "bf16_schedule")} == {"bfloat16"}
        leaves = [names for _, names, _ in _result(run, "bf16_schedule")]
        assert leaves == [names for _, names, _ in _result(run, "fx_schedule")]


def test_comm_dtype_bfloat16_results_close_to_float32(mlp_runs):
    for run in mlp_runs:
        bf16, fx = _result(run, "bf16")["params"], _result(run, "fx")["params"]
        _assert_trajectories_close(bf16, fx, rtol=2e-2, atol=2e-3)
        assert not torch.equal(bf16[-1], fx[-1])  # the cast did happen


def test_grad_accumulation_one_all_reduce_per_bucket_and_same_result(mlp_runs):
    for run in mlp_runs:
        leaves = [leaf for _, names, _ in _result(run, "accum_schedule") for leaf in names]
        expected = [leaf for _, names, _ in _result(run, "fx_schedule") for leaf in names]
        assert sorted(leaves) == sorted(expected)  # each leaf reduced once, not ACCUM_K times
        assert len(leaves) == 2 * (len(MLP_SIZES) - 1) + 1  # the gradients and the loss
        accum, fx = _result(run, "accum"), _result(run, "fx")
        _assert_trajectories_close(accum["params"], fx["params"], **TOL)
        _assert_trajectories_close(accum["loss"], fx["loss"], **TOL)


def test_uncapturable_step_raises_capture_error_on_every_rank(mlp_runs):
    for run in mlp_runs:
        error = _result(run, "capture_error")
        assert error is not None, "a step with loss.item() control flow was captured"
        is_capture_error, is_runtime_error, message = error
        assert is_capture_error and is_runtime_error
        assert "trace=False" in message and "item" in message
        reference = _result(run, "reference")["params"][:2]
        _assert_trajectories_close(_result(run, "item_eager")["params"], reference, **TOL)


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
        out["params"].append(_flat(params))
        out["ddp_params"].append(_flat(dict(ddp.module.named_parameters())))
        out["buffers"].append(_flat({k: buffers[k] for k in mean}))
        out["ddp_buffers"].append(_flat(mean))
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


def _models_worker() -> dict:
    out = {"cnn": _cnn_run(10), "decoder": _lm_run(_models.tiny_decoder(), SGD, 10, _identity)}
    if importlib.util.find_spec("transformers") is not None:
        # Adam divides by sqrt(v) + eps: a large eps keeps near-zero gradients (rounding noise
        # in both runs) from turning into different lr-sized updates.
        adamw = optim.adamw(lr=1e-2, eps=1e-4)
        out["gpt2"] = _lm_run(_models.tiny_gpt2(), adamw, 10, _logits)
    return out


@pytest.fixture(scope="module")
def model_runs() -> list[dict]:
    return run_ranks(_models_worker, WORLD, timeout=240)


def test_cnn_with_batchnorm_matches_ddp(model_runs):
    for run in model_runs:
        cnn = run["cnn"]
        _assert_trajectories_close(cnn["params"], cnn["ddp_params"], **TOL)
        _assert_trajectories_close(cnn["buffers"], cnn["ddp_buffers"], **TOL)
        assert cnn["counts"] == [(s + 1, s + 1) for s in range(len(cnn["counts"]))]
    for r in range(1, len(model_runs)):
        for name in ("params", "buffers"):
            for a, b in zip(model_runs[0]["cnn"][name], model_runs[r]["cnn"][name]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("model", ["decoder", "gpt2"])
def test_language_model_matches_single_process_on_global_batch(model_runs, model):
    if model == "gpt2":
        pytest.importorskip("transformers")
    for run in model_runs:
        _assert_trajectories_close(
            run[model]["fx"]["params"], run[model]["reference"]["params"], **TOL
        )
        _assert_trajectories_close(run[model]["fx"]["loss"], run[model]["reference"]["loss"], **TOL)
    _assert_ranks_bitwise_equal([run[model]["fx"]["params"] for run in model_runs], model)


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
    torch.testing.assert_close(p3, expected, **TIGHT)


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
        torch.testing.assert_close((p, s, donated_loss), (q, t, loss), **TIGHT)


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
        torch.testing.assert_close(p_traced, p_eager, **TIGHT)
        torch.testing.assert_close(loss_traced, loss_eager, **TIGHT)
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
    torch.testing.assert_close(
        fddp.data_parallel(step, trace=False)(params, batch), step(params, batch)
    )


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
