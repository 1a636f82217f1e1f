"""The persistent program cache: a new step object (as in a restarted process) with the same
step code, constants, signature and options loads the compiled program instead of capturing,
and computes bitwise what a fresh compile computes; any change the trace could see compiles
afresh; files the cache did not write are never unpickled.

The in-process tests build a second ``data_parallel`` step, which shares nothing with the first
but the directory; the multi-rank tests start new processes, as a restarted job would.
"""

from __future__ import annotations

import os
import pickle
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from _compare import assert_trees_equal, detached
from _dist import run_ranks
from _models import mlp_step, regression_batch

import fddp
import fddp.optim as optim
from fddp._compiler._cache import _store

SIZES = (8, 16, 4)
LOADED = "loaded from cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "programs"
    monkeypatch.setattr(fddp._compiler._cache._persistent, "_directory", str(directory))
    return directory


def _train(step, params, opt, steps: int = 3, rows: int = 8, **options):
    pstep = fddp.data_parallel(step, **options)
    params = {k: v.clone() for k, v in params.items()}  # a donated argument is overwritten
    state = opt.init(params)
    losses = []
    for i in range(steps):
        params, state, loss = pstep(params, state, regression_batch(i, rows, SIZES[0], SIZES[-1]))
        losses.append(loss)
    plan = pstep.schedule(params, state, regression_batch(0, rows, SIZES[0], SIZES[-1]))
    return detached((params, state, losses)), plan.captured_with


def _files(directory: Path) -> list[str]:
    return sorted(p.name.rsplit(".", 1)[-1] for p in directory.rglob("*") if p.is_file())


def test_a_new_step_loads_the_program_and_computes_the_same(cache):
    opt = optim.adamw(1e-2)
    step, params = mlp_step(opt, SIZES)
    fresh, how = _train(step, params, opt, donate_argnums=(0, 1))
    loaded, how_loaded = _train(step, params, opt, donate_argnums=(0, 1))
    assert how == "make_fx" and how_loaded == f"make_fx, {LOADED}"
    assert_trees_equal(loaded, fresh)
    assert _files(cache) == ["key", "profile", "program"]


def test_the_cache_is_off_unless_a_directory_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(
        fddp._compiler._cache._persistent, "_directory", fddp._compiler._cache._persistent._UNSET
    )
    monkeypatch.delenv("FDDP_CACHE_DIR", raising=False)
    assert fddp.cache_dir() is None
    monkeypatch.setenv("FDDP_CACHE_DIR", str(tmp_path / "env"))
    assert fddp.cache_dir() == str(tmp_path / "env")
    fddp.set_cache_dir(None)
    assert fddp.cache_dir() is None


def test_other_options_or_another_signature_compile_afresh(cache):
    opt = optim.sgd(0.1)
    step, params = mlp_step(opt, SIZES)
    _train(step, params, opt)
    assert _train(step, params, opt, comm_dtype=torch.bfloat16)[1] == "make_fx"
    assert _train(step, params, opt, donate_argnums=(0,))[1] == "make_fx"
    assert _train(step, params, opt, rows=6)[1] == "make_fx"  # batches of another shape
    assert _train(step, params, opt)[1].endswith(LOADED)


def _step_from_source(source: str):
    """``step`` defined by ``source`` in a fresh namespace: the same name, the code as given."""
    namespace = {"fddp": fddp, "torch": torch}
    exec(compile(textwrap.dedent(source), "<edited step>", "exec"), namespace)
    return namespace["step"]


_STEP = """
def step(w, x):
    g = fddp.grad(lambda w: ((x @ w) ** 2).mean())(w)
    return w - {lr} * fddp.pmean(g)
"""


def test_an_edited_step_is_traced_again(cache):
    w, x = torch.ones(3), torch.randn(5, 3)
    first = _step_from_source(_STEP.format(lr=0.1))
    again = _step_from_source(_STEP.format(lr=0.1))  # the same code, a new function object
    edited = _step_from_source(_STEP.format(lr=0.5))
    fddp.data_parallel(first)(w, x)
    assert fddp.data_parallel(again).schedule(w, x).captured_with.endswith(LOADED)
    pstep = fddp.data_parallel(edited)
    assert_trees_equal(pstep(w, x), edited(w, x))
    assert pstep.schedule(w, x).captured_with == "make_fx"


def test_a_changed_closed_over_value_is_computed_with(cache):
    """A tensor the step closes over is a graph constant held by reference: a program loaded
    by a later capture of the same graph runs on that capture's tensor, new values and all; a
    closed-over number is compiled into the graph, so another one is another program."""
    w, x = torch.ones(3), torch.randn(5, 3)
    scale = torch.tensor(2.0)

    def make(lr: float):
        def step(w, x):
            g = fddp.grad(lambda w: ((x @ w) ** 2).mean() * scale)(w)
            return w - lr * fddp.pmean(g)

        return step

    fddp.data_parallel(make(0.1))(w, x)
    assert fddp.data_parallel(make(0.1)).schedule(w, x).captured_with.endswith(LOADED)
    scale.fill_(3.0)
    pstep = fddp.data_parallel(make(0.1))
    assert_trees_equal(pstep(w, x), make(0.1)(w, x))
    assert pstep.schedule(w, x).captured_with.endswith(LOADED)
    pstep = fddp.data_parallel(make(0.2))
    assert_trees_equal(pstep(w, x), make(0.2)(w, x))
    assert pstep.schedule(w, x).captured_with == "make_fx"


class _Marker:
    """Unpickling this creates the file at ``path``: a crafted cache file's payload."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_file_the_cache_did_not_write_is_never_unpickled(cache, tmp_path):
    opt = optim.sgd(0.1)
    step, params = mlp_step(opt, SIZES)
    fresh, _ = _train(step, params, opt)
    marker = tmp_path / "code ran"
    for file in cache.rglob("*.pro*"):
        file.write_bytes(b"\0" * 32 + pickle.dumps({"profile": _Marker(str(marker))}))
    again, how = _train(step, params, opt)
    assert not marker.exists()
    assert how == "make_fx"
    assert_trees_equal(again, fresh)


def test_a_directory_others_can_write_to_is_not_used(cache):
    versioned = cache / f"fddp-v{_store.FORMAT}"
    versioned.mkdir(parents=True)
    os.chmod(versioned, 0o777)
    opt = optim.sgd(0.1)
    step, params = mlp_step(opt, SIZES)
    with pytest.warns(UserWarning, match=f"others can write to .*{versioned.name}"):
        _train(step, params, opt, steps=1)
    assert _files(cache) == []


def _only_dynamo_can_trace(x: torch.Tensor) -> None:
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):
        raise AssertionError("unreachable")


def test_a_step_captured_with_dynamo_is_loaded_too(cache):
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(3, 4)

    def step(w, x):
        def loss(w):
            _only_dynamo_can_trace(x)
            return torch.tanh(x @ w).pow(2).sum()

        value, g = fddp.value_and_grad(loss)(w)
        return {"w": w - 0.1 * fddp.pmean(g), "loss": value, "note": "done"}

    first = fddp.data_parallel(step)
    fresh = [detached(first(w, x)) for _ in range(2)]
    second = fddp.data_parallel(step)
    loaded = [detached(second(w, x)) for _ in range(2)]
    assert second.schedule(w, x).captured_with == f"dynamo, {LOADED}"
    assert_trees_equal(loaded, fresh)


def test_a_loaded_program_shows_the_same_graph(cache):
    opt = optim.adamw(1e-2)
    step, params = mlp_step(opt, SIZES)
    state, batch = opt.init(params), regression_batch(0, 8, SIZES[0], SIZES[-1])
    first = fddp.data_parallel(step)
    first(params, state, batch)
    second = fddp.data_parallel(step)
    assert second.schedule(params, state, batch).captured_with.endswith(LOADED)
    assert second.graph(params, state, batch).code == first.graph(params, state, batch).code


# --- new processes, two ranks ------------------------------------------------------------------


def _job(directory: str, sizes: tuple[int, ...]):
    """One job of two ranks: three AdamW steps with the cache in ``directory``; what the steps
    captured, their results, and how many graphs were built from a cached program's nodes."""
    built = []
    decode_graph = _store.decode_graph
    _store.decode_graph = lambda *args: built.append(1) or decode_graph(*args)
    fddp.set_cache_dir(directory)
    opt = optim.adamw(1e-2)
    step, params = mlp_step(opt, sizes)
    pstep = fddp.data_parallel(step, donate_argnums=(0, 1))
    state = opt.init(params)
    for i in range(3):
        batch = regression_batch(10 * i + fddp.rank(), 8, sizes[0], sizes[-1])
        params, state, loss = pstep(params, state, batch)
    how = pstep.schedule(params, state, batch).captured_with
    return how, detached((params, state, loss)), len(built)


def test_a_restarted_job_loads_its_programs_on_every_rank(tmp_path):
    directory = str(tmp_path / "programs")
    fresh = run_ranks(_job, 2, directory, SIZES)
    restarted = run_ranks(_job, 2, directory, SIZES)
    assert [how for how, _, _ in fresh] == ["make_fx"] * 2
    assert [how for how, _, _ in restarted] == [f"make_fx, {LOADED}"] * 2
    assert_trees_equal([out for _, out, _ in restarted], [out for _, out, _ in fresh])
    # the ranks compare a loaded program's graph by the digest kept with it: none is built
    assert [built for _, _, built in restarted] == [0, 0]


def test_concurrent_jobs_share_a_directory(tmp_path):
    directory = str(tmp_path / "programs")
    sizes = (8, 12, 4)
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = run_ranks(_job, 2, directory, sizes)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    later = run_ranks(_job, 2, directory, sizes)
    assert [how for how, _, _ in later] == [f"make_fx, {LOADED}"] * 2
    outputs = [[out for _, out, _ in results[i]] for i in (0, 1)]
    assert_trees_equal(outputs[1], outputs[0])
    assert_trees_equal([out for _, out, _ in later], outputs[0])
    assert list(Path(directory).rglob(".writing-*")) == []  # no temporary file left behind


def _dropout_step(opt):
    """A step whose remat region recomputes dropout: its program replays the generator state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Dropout(0.5), torch.nn.Linear(*SIZES[1:])
    )
    apply = fddp.functional(model)

    def step(params, opt_state, batch):
        forward = fddp.remat(
            lambda p: apply(p, {}, batch["x"]), policy=fddp.remat_policies.nothing_saveable
        )
        loss, grads = fddp.value_and_grad(
            lambda p: torch.nn.functional.mse_loss(forward(p), batch["y"])
        )(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step, fddp.state(model)[0]


def test_a_step_that_replays_random_ops_is_loaded_too(cache):
    opt = optim.adamw(1e-2)
    step, params = _dropout_step(opt)
    torch.manual_seed(1)
    fresh, how = _train(step, params, opt)
    torch.manual_seed(1)
    loaded, how_loaded = _train(step, params, opt)
    assert how == "make_fx" and how_loaded == f"make_fx, {LOADED}"
    assert_trees_equal(loaded, fresh)
    torch.manual_seed(2)
    other, _ = _train(step, params, opt)  # the dropout masks come from the generator
    assert not torch.equal(other[2][0], fresh[2][0])
