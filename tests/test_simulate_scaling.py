"""benchmarks/simulate_scaling.py's core on a tiny member list: the alpha-beta all-reduce models,
the replay of a step program, and what overlapping the optimizer with the wire can and cannot
buy. Pure: a hand-built FX graph, no capture, no process group."""

from __future__ import annotations

import itertools
import os
import random
import sys

import pytest
import torch
from torch import fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import simulate_scaling as sim  # noqa: E402

from fddp._base._annotations import LEAF_PATH  # noqa: E402
from fddp._compiler._graph import ALL_REDUCE, WAIT  # noqa: E402
from fddp._compiler._passes import _bucket  # noqa: E402

MIB = 2**20
GBIT = 1e9 / 8
WORLDS = [2**k for k in range(1, 11)]
ACCELERATOR = sim.Accelerator()


def _members(sizes: list[int], names: list[str] | None = None) -> tuple[int, list]:
    """A graph whose first nodes are gradients of ``sizes`` float32 elements (in the order the
    backward produces them), each all-reduced, waited for and divided as pmean does; its
    members, ready at positions 0, 1, ..."""
    graph = fx.Graph()
    grads = []
    for i, n in enumerate(sizes):
        grad = graph.placeholder(f"g{i}")
        grad.meta["val"] = torch.empty(n)
        grads.append(grad)
    outs = []
    for i, grad in enumerate(grads):
        reduce = graph.call_function(ALL_REDUCE, (grad, "sum", "0"))
        if names is not None:
            reduce.meta["custom"] = {LEAF_PATH: f"['{names[i]}']"}
        wait = graph.call_function(WAIT, (reduce,))
        outs.append(graph.call_function(torch.ops.aten.div.Tensor, (wait, 2)))
    graph.output(tuple(outs))
    return len(graph.nodes), _bucket.find_members(graph)


def _backward(positions: int, layers: int, seconds: float) -> list[sim.Compute]:
    """``seconds`` of backward compute before each of the first ``layers`` gradients."""
    return [sim.Compute(0.0, seconds if p < layers else 0.0) for p in range(positions)]


def _local(program: list[sim.Op]) -> float:
    compute = [op for op in program if isinstance(op, sim.Compute)]
    return sim.run_program(compute, 0.0, 0.0, launch_s=0.0, asynchronous=True)


def test_the_ring_moves_twice_the_buffer_for_many_ranks_and_once_for_two():
    nbytes, bandwidth = 100 * MIB, 100 * GBIT
    ring = sim.AllReduce("ring", 0.0, bandwidth)
    times = [ring.seconds(n, nbytes) for n in WORLDS]
    assert times[0] == pytest.approx(nbytes / bandwidth)  # 2 ranks: each sends half, twice
    assert all(a < b for a, b in itertools.pairwise(times))
    assert all(t < 2 * nbytes / bandwidth for t in times)
    assert times[-1] == pytest.approx(2 * nbytes / bandwidth, rel=1e-3)  # 1024 ranks
    # the same through the replay: one bucket on the wire, the launch's host time aside
    program = [sim.Launch(0, nbytes), sim.Wait(0)]
    machine = ring.machine(1024, ACCELERATOR)
    replayed = sim.step_seconds(program, machine, asynchronous=True) - ACCELERATOR.launch_s
    assert replayed == pytest.approx(2 * nbytes / bandwidth, rel=1e-3)


def test_latency_steps_ring_linear_tree_logarithmic():
    alpha = 5e-6
    ring, tree = (sim.AllReduce(a, alpha, 100 * GBIT) for a in ("ring", "tree"))
    assert [ring.machine(n, ACCELERATOR).latency for n in (8, 1024)] == pytest.approx(
        [14 * alpha, 2046 * alpha]
    )
    assert [tree.machine(n, ACCELERATOR).latency for n in (8, 1024)] == pytest.approx(
        [6 * alpha, 20 * alpha]
    )
    assert tree.seconds(1024, 0) < ring.seconds(1024, 0) / 100
    assert tree.byte_factor(8) == tree.byte_factor(1024) == 2.0


def test_efficiency_falls_with_the_ranks_at_a_fixed_cap():
    positions, members = _members([2**18] * 8)  # eight 1 MiB gradients
    buckets = _bucket.assign(members, 2 * MIB, MIB)
    optimizer = [(sim.Compute(5e-6, 2e-4), None)] * 4
    program = sim.program_from_members(
        _backward(positions, 8, 1e-3), buckets, optimizer, overlap_optimizer=True
    )
    local = _local(program)
    for algorithm in ("ring", "tree"):
        wire = sim.AllReduce(algorithm, 5e-6, 8 * GBIT)  # 8 MiB take about 8 ms: exposed
        efficiency = [
            local / sim.step_seconds(program, wire.machine(n, ACCELERATOR), asynchronous=True)
            for n in WORLDS
        ]
        assert all(0 < e < 1 for e in efficiency)
        if algorithm == "ring":
            assert all(a > b for a, b in itertools.pairwise(efficiency)), efficiency
        else:  # the bytes do not grow with N, only log2(N) latencies
            assert all(a >= b for a, b in itertools.pairwise(efficiency)), efficiency
            assert efficiency[0] > efficiency[-1]


def test_overlapping_the_optimizer_never_loses_when_splitting_it_is_free():
    rng = random.Random(0)
    gained = 0
    for _ in range(40):
        layers = rng.randint(2, 12)
        positions, members = _members([rng.randint(2**14, 2**20) for _ in range(layers)])
        cap = rng.choice([MIB // 4, MIB, 4 * MIB])
        buckets = _bucket.assign(members, cap, MIB // 4)
        backward = _backward(positions, layers, rng.uniform(1e-4, 2e-3))
        optimizer = [(sim.Compute(0.0, rng.uniform(1e-5, 1e-3)), None) for _ in range(5)]
        fddp, ddp = (
            sim.program_from_members(backward, buckets, optimizer, overlap_optimizer=o)
            for o in (True, False)
        )
        wire = sim.AllReduce(rng.choice(["ring", "tree"]), 5e-6, rng.choice([10, 100]) * GBIT)
        machine = wire.machine(rng.choice(WORLDS), ACCELERATOR)
        for asynchronous in (True, False):
            fddp_s, ddp_s = (
                sim.step_seconds(p, machine, asynchronous=asynchronous) for p in (fddp, ddp)
            )
            assert ddp_s >= fddp_s - 1e-12
            gained += ddp_s > fddp_s * 1.001
    assert gained > 20  # with several buckets on a slow wire the overlap pays


def test_splitting_the_optimizer_costs_launches_when_the_wire_is_free():
    positions, members = _members([2**18] * 8)
    buckets = _bucket.assign(members, 256 * 1024, 256 * 1024)  # a bucket per gradient
    optimizer = [(sim.Compute(5e-6, 1e-6), None)] * 10  # launch-bound foreach ops
    backward = _backward(positions, 8, 1e-4)
    fddp, ddp = (
        sim.program_from_members(backward, buckets, optimizer, overlap_optimizer=o)
        for o in (True, False)
    )
    free = sim.AllReduce("tree", 0.0, 1e18).machine(8, ACCELERATOR)
    fddp_s, ddp_s = (sim.step_seconds(p, free, asynchronous=False) for p in (fddp, ddp))
    assert fddp_s - ddp_s == pytest.approx(70 * 5e-6)  # 8 x 10 launches against 10 (a CPU)
    fddp_s, ddp_s = (sim.step_seconds(p, free, asynchronous=True) for p in (fddp, ddp))
    assert fddp_s == pytest.approx(ddp_s)  # a GPU issues them while the backward runs


def test_ddp_buckets_close_at_one_then_twenty_five_mib_in_reverse_parameter_order():
    names = [f"w{i}" for i in range(40)]
    _, members = _members([2**18] * 40, names=names[::-1])  # the backward: last layer first
    buckets = sim.ddp_buckets(members, names)
    assert [[sim.leaf_name(m) for m in b] for b in buckets] == [
        ["w39"],
        [f"w{i}" for i in range(38, 13, -1)],
        [f"w{i}" for i in range(13, -1, -1)],
    ]
