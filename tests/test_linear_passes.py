"""The scheduling passes do work in proportion to the graph: no pass scans the whole graph once
per bucket or per node. Counted, not timed: the nodes each pass visits (every iteration over a
graph's node list) on a model four times deeper are at most five times as many.

With a 1-byte cap every gradient is its own bucket, so a pass that rescans the graph for each
bucket visits sixteen times as many nodes on the deeper model (before this test, bucketing and
overlap did: 12.5x and 11.3x).
"""

from __future__ import annotations

import collections
import functools

import optree
import pytest
import torch
import torch.fx.graph as fx_graph
from _models import captured_step, mlp_step, regression_batch

import fddp.optim as optim
from fddp._collectives._bucket_policy import CapPolicy
from fddp._compiler import _backend, _pipeline, _plan
from fddp._compiler._options import CompileOptions
from fddp._compiler._passes import _bucket, _cost, _gate, _overlap, _reinplace, _replication

PASSES = {
    _replication: ["dependencies"],
    _overlap: ["hoist_gradient_sums", "overlap"],
    _bucket: ["find_members", "rewrite", "pack_concatenations_in_place"],
    _cost: ["profile"],
    _gate: ["insert"],
    _reinplace: ["reinplace"],
    _plan: ["describe", "collective_sequence"],
    _backend: ["build"],
}
DEPTH = 6


def _captured(depth: int, opt):
    sizes = (8,) * (depth + 1) + (4,)
    step, params = mlp_step(opt, sizes)
    args = (params, opt.init(params), regression_batch(0, 4, sizes[0], sizes[-1]))
    tensors = [x for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    return captured_step(step, args), len(tensors)


def _visits(depth: int, opt, monkeypatch) -> tuple[int, collections.Counter]:
    """Graph size and nodes visited per pass, scheduling with one bucket per gradient."""
    captured, count = _captured(depth, opt)
    assert captured.graph is not None
    size = len(captured.graph.graph.nodes)
    visits: collections.Counter = collections.Counter()
    running: list[str] = []
    plain_iter = fx_graph._node_list.__iter__

    def counting_iter(nodes):
        for node in plain_iter(nodes):
            if running:
                visits[running[0]] += 1
            yield node

    def counted(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            running.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                running.pop()

        return run

    with monkeypatch.context() as patch:
        patch.setattr(fx_graph._node_list, "__iter__", counting_iter)
        for module, names in PASSES.items():
            for name in names:
                patch.setattr(module, name, counted(name, getattr(module, name)))
        options = CompileOptions(CapPolicy(fixed=1, first=1), None, "fx")
        _pipeline.schedule_graph(captured, options, set(range(count)))
    return size, visits


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_every_pass_visits_nodes_in_proportion_to_the_graph(optimizer, monkeypatch):
    opt = optim.adamw(1e-3) if optimizer == "adamw" else optim.sgd(0.1, momentum=0.9)
    small_size, small = _visits(DEPTH, opt, monkeypatch)
    large_size, large = _visits(4 * DEPTH, opt, monkeypatch)
    assert 3 < large_size / small_size < 4.5
    passes = [name for names in PASSES.values() for name in names]
    assert set(large) <= set(passes) and {"rewrite", "overlap", "reinplace"} <= set(large)
    ratios = {name: large[name] / max(small[name], 1) for name in large}
    assert all(r <= 5 for r in ratios.values()), ratios
