"""The default bucket cap: the cost model's predictions, its choice, and one choice on all ranks.

The pure checks replay a captured MLP step under made-up machines whose answer is known (a slow
link favours small buckets, a high latency few, a free link leaves the rule of thumb); the
two-rank checks show that the figures, and so the schedule, come from rank 0 even when the
ranks measure different things.
"""

from __future__ import annotations

import functools

import _models
import pytest
import torch
import torch.nn.functional as F
from _dist import run_checks

import fddp
from fddp._schedule import _bucket, _cost
from fddp._schedule._capture import trace_with_make_fx

MIB = 2**20
SIZES = (256,) * 9  # eight 256 KiB weights and their biases: 2 MiB of gradients
ROWS = 64


def _step():
    model = _models.mlp(SIZES)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randn(ROWS, SIZES[0]), torch.randn(ROWS, SIZES[-1]))

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    def step(params, batch):
        loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
        grads = fddp.pmean(grads)
        return {k: p - 0.1 * grads[k] for k, p in params.items()}, loss

    return step, params, batch


@pytest.fixture(scope="module")
def captured():
    """The captured graph (before bucketing) and its per-leaf all-reduces."""
    step, params, batch = _step()
    pstep = fddp.data_parallel(step)
    with fddp._axes.bind(pstep._axis(traced=True)):
        graph = trace_with_make_fx(step, (params, batch)).graph.graph
    return graph, _bucket.find_members(graph)


def _machine(latency: float = 0.0, bandwidth: float = 1e15) -> _cost.Machine:
    return _cost.Machine(latency, 1 / bandwidth, 1e-11, 1e-10, 2e-6)


def _predicted(captured, machine: _cost.Machine, cap: int) -> float:
    graph, members = captured
    seconds = _cost.node_seconds(graph, machine)
    return _cost.predict(seconds, _bucket.assign(members, cap, cap), machine)


def test_a_slow_link_favours_buckets_that_start_during_the_backward(captured):
    slow = _machine(bandwidth=2e8)  # 2 MiB take 10 ms on the wire, the backward far less
    small, whole = _predicted(captured, slow, 256 * 1024), _predicted(captured, slow, 4 * MIB)
    transfer = 2.1 * MIB / 2e8
    assert small < whole
    assert whole - small > 0.5 * transfer / len(SIZES)  # at least half a layer's transfer hidden
    graph, members = captured
    assert _cost.choose_cap(graph, members, 64 * 1024, slow).cap < 2 * MIB


def test_a_high_latency_favours_few_buckets(captured):
    distant = _machine(latency=0.05)  # 50 ms per all-reduce, whatever its size
    assert _predicted(captured, distant, 4 * MIB) < _predicted(captured, distant, 256 * 1024)
    graph, members = captured
    choice = _cost.choose_cap(graph, members, 64 * 1024, distant)
    total = _bucket.total_bytes(members)
    assert choice.cap >= total - 64 * 1024  # everything after the first bucket in one
    assert "chosen by the cost model" in str(choice)


def test_a_free_link_leaves_the_rule_of_thumb(captured):
    graph, members = captured
    choice = _cost.choose_cap(graph, members, 64 * 1024, _machine())
    assert choice.cap == choice.preferred == _bucket.auto_cap(members, 64 * 1024)


def test_the_rule_of_thumb_keeps_a_bucket_five_latencies_long(captured):
    _, members = captured
    machine = _machine(latency=1e-3, bandwidth=1e9)  # 1 ms and 1 GB/s: 5 MB at the least
    assert _cost.preferred_cap(members, 64 * 1024, machine) == 5_000_000


def test_a_matmul_costs_its_flops(captured):
    graph, _ = captured
    machine = _machine()
    seconds = _cost.node_seconds(graph, machine)
    mms = [s for n, s in zip(graph.nodes, seconds) if n.target is torch.ops.aten.mm.default]
    forward_flops = 2 * ROWS * SIZES[0] * SIZES[1]
    assert min(mms) == pytest.approx(machine.seconds_per_node + forward_flops * 1e-11)


# --- two ranks -------------------------------------------------------------------------------


def _measure_with_rank_dependent_compute() -> _cost.Machine:
    """Each rank's compute probe reports something else; every rank must get rank 0's."""
    slowdown = 1.0 + 1000.0 * fddp.rank()
    real = _cost._compute
    _cost._compute = lambda device: tuple(x * slowdown for x in real(device))
    try:
        return _cost.measure(None, torch.device("cpu"))
    finally:
        _cost._compute = real


def _measuring_leaves_the_rng_alone() -> bool:
    torch.manual_seed(0)
    _cost.measure(None, torch.device("cpu"))
    after = torch.rand(4)
    torch.manual_seed(0)
    return torch.equal(after, torch.rand(4))


def _default_schedule_line(**options) -> str:
    step, params, batch = _step()
    return fddp.data_parallel(step, **options).schedule(params, batch).bucket_cap


def _probes_for_two_steps_on_one_group() -> int:
    """How many times two steps with default caps measure the link between them."""
    _cost._measured.clear()
    real, calls = _cost.measure, []
    _cost.measure = lambda *args: calls.append(args) or real(*args)
    try:
        _default_schedule_line()
        _default_schedule_line()
    finally:
        _cost.measure = real
    return len(calls)


def test_every_rank_takes_rank_0_figures_and_the_same_cap():
    machines, rng_untouched, chosen, set_by_user, probes = run_checks(
        [
            _measure_with_rank_dependent_compute,
            _measuring_leaves_the_rng_alone,
            _default_schedule_line,
            functools.partial(_default_schedule_line, bucket_cap_mb=0.5),
            _probes_for_two_steps_on_one_group,
        ]
    )
    assert machines[0] == machines[1]
    assert rng_untouched == [True, True]  # a resumed run draws the same numbers as the original
    assert machines[0].latency >= 0 and 0 < machines[0].seconds_per_byte < 1e-6
    assert chosen[0] == chosen[1] and "chosen by the cost model" in chosen[0]
    assert set_by_user == ["bucket cap 0.5 MiB, set by bucket_cap_mb"] * 2
    assert probes == [1, 1]  # once per process group, not once per step
