"""The default bucket cap: the rule of thumb, the cost model's predictions and its choice, and
one choice on all ranks.

The pure checks replay a captured MLP step under made-up machines whose answer is known (a slow
link favours small buckets, a high latency few, a free link leaves the rule of thumb). A machine
is measured, never chosen, so these unit tests call the bucket policy and the compiler's cost
model directly, with explicit arguments only. The two-rank checks use the public API: the
figures, and so the schedule, come from rank 0, are measured once per process group and leave
the user's random numbers alone.
"""

from __future__ import annotations

import functools

import _models
import pytest
import torch
import torch.nn.functional as F
from _dist import run_checks

import fddp
from fddp._base import _axes
from fddp._collectives import _ops
from fddp._collectives._bucket_policy import DDP_CAP_BYTES, CapPolicy, rule_of_thumb
from fddp._compiler._capture._trace import capture
from fddp._compiler._passes import _bucket, _cost
from fddp._ranks import _machine as _machine_module
from fddp._ranks._machine import Machine

MIB = 2**20
SIZES = (256,) * 9  # eight 256 KiB weights and their biases: 2 MiB of gradients
ROWS = 64
FIRST = 64 * 1024


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
    tensors = [*params.values(), *batch]
    with _axes.bind(_ops.process_axis("data", None, traced=True)):
        graph = capture(step, (params, batch), tensors, fused_backward=True)[0].graph.graph
    return graph, _bucket.find_members(graph)


def _machine(latency: float = 0.0, bandwidth: float = 1e15) -> Machine:
    return Machine(latency, 1 / bandwidth, 1e-11, 1e-10, 2e-6)


def _choose(captured, machine: Machine):
    graph, members = captured
    predict = _cost.profile(graph, members).predictor(FIRST, machine)
    return CapPolicy(None, FIRST).choose(_bucket.total_bytes(members), machine, predict)


def _predicted(captured, machine: Machine, cap: int) -> float:
    graph, members = captured
    return _cost.profile(graph, members).predictor(cap, machine)(cap)


def test_a_slow_link_favours_buckets_that_start_during_the_backward(captured):
    slow = _machine(bandwidth=2e8)  # 2 MiB take 10 ms on the wire, the backward far less
    small, whole = _predicted(captured, slow, 256 * 1024), _predicted(captured, slow, 4 * MIB)
    transfer = 2.1 * MIB / 2e8
    assert small < whole
    assert whole - small > 0.5 * transfer / len(SIZES)  # at least half a layer's transfer hidden
    assert _choose(captured, slow).cap < 2 * MIB


def test_a_high_latency_favours_few_buckets(captured):
    distant = _machine(latency=0.05)  # 50 ms per all-reduce, whatever its size
    assert _predicted(captured, distant, 4 * MIB) < _predicted(captured, distant, 256 * 1024)
    choice = _choose(captured, distant)
    total = _bucket.total_bytes(captured[1])
    assert choice.cap >= total - FIRST  # everything after the first bucket in one
    assert "chosen by the cost model" in str(choice)


def test_a_free_link_leaves_the_rule_of_thumb(captured):
    choice = _choose(captured, _machine())
    total = _bucket.total_bytes(captured[1])
    assert choice.cap == rule_of_thumb(total, FIRST) == total // 16
    assert f"rule of thumb {choice.cap / MIB:.3g} MiB" in str(choice)


def test_the_rule_of_thumb_keeps_a_bucket_five_latencies_long():
    machine = _machine(latency=1e-3, bandwidth=1e9)  # 1 ms and 1 GB/s: 5 MB at the least
    assert rule_of_thumb(32 * MIB, FIRST, machine) == 5_000_000
    assert rule_of_thumb(32 * MIB, FIRST) == 2 * MIB  # a sixteenth without a measured link
    assert rule_of_thumb(10 * 2**30, FIRST, machine) == DDP_CAP_BYTES  # never above DDP's
    assert rule_of_thumb(1024, FIRST) == FIRST  # never below the first bucket's


def test_a_cap_set_by_the_user_is_used_as_it_is(captured):
    choice = CapPolicy(3 * MIB, FIRST).choose(2 * MIB, _machine(latency=0.05), lambda c: 1.0)
    assert (choice.cap, str(choice)) == (3 * MIB, "bucket cap 3 MiB, set by bucket_cap_mb")
    assert not CapPolicy(3 * MIB, FIRST).measures(world=8)
    assert CapPolicy(None, FIRST).measures(world=2) and not CapPolicy(None, FIRST).measures(1)


def test_shard_state_buckets_follow_the_same_rule():
    """shard_state's layout (its state's shapes) uses the rule of thumb without a machine."""
    leaves = {f"w{i}": torch.zeros(2**18) for i in range(32)}  # 32 MiB: 2 MiB buckets
    state = fddp.optim.shard_state(fddp.optim.sgd(0.1, momentum=0.9)).init(leaves)
    sizes = [int(row[3]) * 4 for row in state.pieces]
    assert sizes == [rule_of_thumb(32 * MIB, MIB)] * 16


def test_a_matmul_costs_its_flops(captured):
    graph, _ = captured
    machine = _machine()
    seconds = _cost.node_seconds(graph, machine)
    mms = [s for n, s in zip(graph.nodes, seconds) if n.target is torch.ops.aten.mm.default]
    forward_flops = 2 * ROWS * SIZES[0] * SIZES[1]
    assert min(mms) == pytest.approx(machine.seconds_per_node + forward_flops * 1e-11)


# --- two ranks -------------------------------------------------------------------------------


def _default_schedule_line(**options) -> str:
    step, params, batch = _step()
    return fddp.data_parallel(step, **options).schedule(params, batch).bucket_cap


def _measuring_leaves_the_rng_alone() -> bool:
    """A first compile on a fresh group measures the link; the RNG must not move."""
    step, params, batch = _step()
    pstep = fddp.data_parallel(step)
    torch.manual_seed(0)
    pstep.schedule(params, batch)
    after = torch.rand(4)
    torch.manual_seed(0)
    return torch.equal(after, torch.rand(4))


def test_every_rank_takes_rank_0_figures_measured_once_per_group():
    checks = {
        "rng_untouched": _measuring_leaves_the_rng_alone,
        "first": _default_schedule_line,
        "second": _default_schedule_line,
        "set_by_user": functools.partial(_default_schedule_line, bucket_cap_mb=0.5),
    }
    results = run_checks(checks)
    assert results["rng_untouched"] == [True, True]  # a resumed run draws the same numbers
    first, second = results["first"], results["second"]
    assert "chosen by the cost model" in first[0]
    # the figures are printed to three digits: a rank that measured on its own, or a second
    # measurement, would differ
    assert first[0] == first[1], "every rank must print rank 0's figures"
    assert second == first, "the link is measured once per process group"
    assert results["set_by_user"] == ["bucket cap 0.5 MiB, set by bucket_cap_mb"] * 2


def test_a_noisy_link_probe_does_not_measure_an_unbounded_bandwidth():
    """The link is the line through the best times of a small and a large all-reduce; where a
    loaded machine made the large one no slower, its whole time counts as transfer."""
    small, large = _machine_module._PROBE_BYTES
    latency, per_byte = _machine_module.line_through(1e-4, 1e-4 + (large - small) * 1e-9)
    assert latency == pytest.approx(1e-4 - small * 1e-9) and per_byte == pytest.approx(1e-9)
    latency, per_byte = _machine_module.line_through(2e-3, 1e-3)  # the large probe was faster
    assert per_byte == pytest.approx(1e-3 / large) and latency == pytest.approx(
        2e-3 - small * per_byte
    )
