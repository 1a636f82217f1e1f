"""Ops recorded by ``_quick_record`` give the graph make_fx records for them: the same nodes,
arguments, annotations and fake values (shapes, strides, dtypes, devices, and which values
share a storage), for the optimizers, clipping, pmean and the cases the quick path must leave
to make_fx (integer sums, transposed leaves, mixed dtypes, 0-d leaves)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_equal
from _models import (
    captured_step,
    mlp_step,
    next_token_loss,
    regression_batch,
    tiny_decoder,
    token_batch,
)

import fddp
import fddp.optim as optim
from fddp._compiler._capture import _quick_record


def _graph(step, args, monkeypatch, *, quick: bool):
    """The captured graph of ``step(*args)`` and how many ops the quick path recorded."""
    recorded = []
    record = _quick_record._record

    def counted(*a):
        out = record(*a)
        recorded.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(_quick_record, "_record", counted)
        if not quick:
            m.setattr(_quick_record, "_RULES", {})
        captured = captured_step(step, args)
    assert captured.graph is not None
    return captured.graph.graph, sum(recorded)


def _described(graph) -> list[tuple]:
    """Each node as its op, target, arguments (earlier nodes by position), annotations and
    fake values; storages are numbered in order of first appearance."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    storages: dict[int, int] = {}

    def value(v):
        if isinstance(v, torch.Tensor):
            storage = storages.setdefault(v.untyped_storage()._cdata, len(storages))
            return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, storage)
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v

    def arg(a):
        return ("node", index[a]) if isinstance(a, torch.fx.Node) else a

    return [
        (
            node.op,
            str(node.target),
            str(torch.fx.node.map_aggregate(node.args, arg)),
            str(torch.fx.node.map_aggregate(node.kwargs, arg)),
            node.meta.get("custom"),
            value(node.meta.get("val")),
        )
        for node in graph.nodes
    ]


def _decoder_step(opt):
    model = tiny_decoder(layers=2)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)

    def step(params, opt_state, ids):
        def loss_fn(p):
            return next_token_loss(apply(p, buffers, ids), ids)

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    return step, (params, opt.init(params), token_batch(0, 4))


def _mlp_args(opt, sizes=(6, 8, 3)):
    step, params = mlp_step(opt, sizes)
    return step, (params, opt.init(params), regression_batch(0, 4, sizes[0], sizes[-1]))


def _odd_leaves_step():
    """Leaves the quick path must leave alone: a transposed (non-contiguous) weight, a 0-d
    scale, bfloat16 leaves updated in float32, and an integer psum."""
    params = {
        "w": torch.randn(3, 5).t(),
        "scale": torch.tensor(1.5),
        "b": torch.randn(3, dtype=torch.bfloat16),
    }
    opt = optim.adamw(1e-2, weight_decay=0.1)

    def step(params, opt_state, x, count):
        def loss_fn(p):
            y = (x @ p["w"]) * p["scale"] + p["b"].float()
            return (y**2).mean()

        loss, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        params = optim.apply_updates(params, updates)
        return params, opt_state, fddp.pmean(loss), fddp.psum(count)

    return step, (params, opt.init(params), torch.randn(4, 5), torch.tensor([3, 4]))


CASES = {
    "decoder, AdamW after clipping": lambda: _decoder_step(
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.01))
    ),
    "MLP, SGD with Nesterov momentum": lambda: _mlp_args(
        optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    ),
    "odd leaves": _odd_leaves_step,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quick_path_records_what_make_fx_records(case, monkeypatch):
    fddp.init()
    step, args = CASES[case]()
    quick, recorded = _graph(step, args, monkeypatch, quick=True)
    plain, none = _graph(step, args, monkeypatch, quick=False)
    assert none == 0
    assert recorded >= 10, f"the quick path recorded only {recorded} ops"
    assert _described(quick) == _described(plain)


def test_quick_path_leaves_uncovered_arguments_to_make_fx(monkeypatch):
    """Integer, non-contiguous and mixed-dtype calls reach make_fx (checked op by op)."""
    fddp.init()
    taken: list[tuple[str, bool]] = []
    record = _quick_record._record

    def noted(func, layout, args, kwargs):
        out = record(func, layout, args, kwargs)
        taken.append((str(func), out is not None))
        return out

    monkeypatch.setattr(_quick_record, "_record", noted)
    step, args = _odd_leaves_step()
    captured_step(step, args)
    left = {name for name, quick in taken if not quick}
    # the integer psum's all-reduce, the bfloat16 group's foreach ops (a float32 scalar)
    assert "_c10d_functional.all_reduce.default" in left
    assert any(name.startswith("aten._foreach_") for name in left)


def test_quick_path_in_a_training_run_equals_the_plain_one(monkeypatch):
    """Five data_parallel steps of the decoder with and without the quick path: bitwise."""
    fddp.init()
    results = []
    for quick in (True, False):
        with monkeypatch.context() as m:
            if not quick:
                m.setattr(_quick_record, "_RULES", {})
            step, (params, state, _) = _decoder_step(optim.adamw(1e-2, weight_decay=0.1))
            pstep = fddp.data_parallel(step, donate_argnums=(0, 1))
            for i in range(5):
                params, state, loss = pstep(params, state, token_batch(i, 4))
            results.append((params, state, loss))
    (p1, s1, l1), (p2, s2, l2) = results
    assert_trees_equal((p1, s1, l1), (p2, s2, l2))


def test_mode_is_inert_outside_a_trace():
    """Eagerly (no make_fx trace) every op runs as it is."""
    x = torch.randn(3)
    with _quick_record.QuickRecord():
        out = torch._foreach_add([x, x], 1.0)
        y = F.gelu(x) + x
    assert torch.equal(out[0], x + 1.0) and torch.equal(y, F.gelu(x) + x)
