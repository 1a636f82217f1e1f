"""The compiled schedule of fddp.data_parallel, read off its FX graph and its Schedule.

A world of one still has a real one-rank gloo group, so the collectives are in the graph and
every check here runs in this process. The graph queries below are written from the op schemas,
independently of fddp's own helpers, so that a wrong helper cannot hide a wrong schedule.
"""

from __future__ import annotations

import itertools

import _models
import optree
import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close, assert_trees_equal
from torch import fx

import fddp
import fddp.optim as optim

aten = torch.ops.aten
WAIT = torch.ops._c10d_functional.wait_tensor.default
MIB = 2**20
SIZES = (16, 24, 32, 40, 8)  # weights of 1536, 3072, 5120 and 1280 bytes, first layer first

# --- graph queries ---------------------------------------------------------------------------


def _op(node: fx.Node) -> torch._ops.OpOverload | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target
    return None


def _is_launch(node: fx.Node) -> bool:
    op = _op(node)
    return op is not None and op.namespace == "_c10d_functional" and op is not WAIT


def _is_all_reduce(node: fx.Node) -> bool:
    # the bucketed all-reduce may be the functional one or the in-place one
    return _is_launch(node) and node.target._opname in ("all_reduce", "all_reduce_")


def _is_wait(node: fx.Node) -> bool:
    return _op(node) is WAIT


def _is_view(node: fx.Node) -> bool:
    op = _op(node)
    if op is None:
        return node.op == "call_function"  # operator.getitem
    ret = op._schema.returns
    return bool(ret) and ret[0].alias_info is not None and not ret[0].alias_info.is_write


def _is_compute(node: fx.Node) -> bool:
    """Work that takes time: not an input, output, collective, wait, view or allocation."""
    if node.op != "call_function" or _is_launch(node) or _is_wait(node) or _is_view(node):
        return False
    return node.target not in (aten.empty.memory_format, aten.t.default)


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place (mutable schema arguments, ``out=`` included)."""
    op = _op(node)
    if op is None:
        return []
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            out.extend(optree.tree_leaves(given, is_leaf=lambda x: isinstance(x, fx.Node)))
    return [n for n in out if isinstance(n, fx.Node)]


def _root(node: fx.Node) -> fx.Node:
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


class GraphView:
    """Positions and data dependencies (through in-place writes too) of one scheduled graph."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.writers: dict[fx.Node, list[fx.Node]] = {}
        self.readers: dict[fx.Node, list[fx.Node]] = {}
        for node in self.nodes:
            for target in _written(node):
                self.writers.setdefault(_root(target), []).append(node)
            for arg in node.all_input_nodes:
                self.readers.setdefault(_root(arg), []).append(node)

    def inputs(self, node: fx.Node) -> set[fx.Node]:
        """Nodes whose result ``node`` reads: its arguments and earlier writes to their storage."""
        deps = set(node.all_input_nodes)
        for arg in node.all_input_nodes:
            deps |= {w for w in self.writers.get(_root(arg), []) if self.pos[w] < self.pos[node]}
        return deps - {node}

    def outputs(self, node: fx.Node) -> set[fx.Node]:
        """Nodes that read ``node``'s result: its users, and later readers of what it wrote."""
        deps = set(node.users)
        for target in _written(node):
            deps |= {r for r in self.readers[_root(target)] if self.pos[r] > self.pos[node]}
        return deps - {node}

    def _closure(self, node: fx.Node, step) -> set[fx.Node]:
        seen: set[fx.Node] = set()
        stack = [node]
        while stack:
            for dep in step(stack.pop()):
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
        return seen

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        return self._closure(node, self.inputs)

    def descendants(self, node: fx.Node) -> set[fx.Node]:
        return self._closure(node, self.outputs)

    def launches(self) -> list[fx.Node]:
        return [n for n in self.nodes if _is_launch(n)]

    def wait_of(self, launch: fx.Node) -> fx.Node:
        waits = [u for u in launch.users if _is_wait(u)]
        assert len(waits) == 1, f"{launch} has waits {waits}"
        return waits[0]


def _graph(pstep, *args) -> fx.Graph:
    graph = pstep.graph(*args).graph
    assert pstep.retraces == 0, "every step here has one signature, so one program"
    return graph


# --- steps -----------------------------------------------------------------------------------


def _mlp_step(sizes=SIZES, *, bias=False, microbatches=1):
    """Params, a batch, and ``step(params, batch)``: SGD on pmean'd grads, local loss returned.

    The loss is not pmean'd, so every all-reduce in the graph carries gradients. With
    ``microbatches=k`` the gradients of k microbatches are summed in a Python loop first.
    """
    model = _models.mlp(sizes, bias=bias)
    params = fddp.state(model)[0]
    apply = fddp.functional(model)

    def loss_fn(params, batch):
        return F.mse_loss(apply(params, {}, batch["x"]), batch["y"])

    def step(params, batch):
        rows = batch["x"].shape[0] // microbatches
        total, loss = None, 0.0
        for i in range(microbatches):
            micro = optree.tree_map(lambda t, i=i: t[i * rows : (i + 1) * rows], batch)
            loss_i, grads = fddp.value_and_grad(loss_fn)(params, micro)
            total = grads if total is None else optree.tree_map(torch.add, total, grads)
            loss = loss + loss_i
        grads = fddp.pmean(total)
        return optree.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    batch = _models.regression_batch(0, 6 * microbatches, sizes[0], sizes[-1])
    return params, batch, step


def _expected_buckets(leaves: list[tuple[str, int]], cap: int, first_cap: int) -> list[list[str]]:
    """DDP's greedy bucketing: leaves in production order; a bucket closes once it holds
    ``cap`` bytes (``first_cap`` for the first), the leaf that crossed the cap included."""
    buckets: list[list[str]] = []
    used = 0
    for name, size in leaves:
        limit = first_cap if len(buckets) == 1 else cap
        if buckets and used < limit:
            buckets[-1].append(name)
            used += size
        else:
            buckets.append([name])
            used = size
    return buckets


def _weights_in_production_order(sizes) -> list[tuple[str, int]]:
    """Backward produces the last layer's gradient first."""
    names = _models.mlp_weight_names(sizes)
    nbytes = [4 * a * b for a, b in itertools.pairwise(sizes)]
    return list(zip(names, nbytes))[::-1]


def _names(plan) -> list[str]:
    return [leaf.strip("[]'") for leaf in plan.leaves]


# --- bucket pass -----------------------------------------------------------------------------


_plain_steps: dict[tuple[int, int], tuple] = {}


def _plain(cap: int, first_cap: int):
    """The bias-free MLP step compiled with these caps (bytes), once per module."""
    if (cap, first_cap) not in _plain_steps:
        params, batch, step = _mlp_step()
        pstep = fddp.data_parallel(
            step, bucket_cap_mb=cap / MIB, first_bucket_cap_mb=first_cap / MIB
        )
        _plain_steps[cap, first_cap] = (pstep, (params, batch), step)
    return _plain_steps[cap, first_cap]


@pytest.mark.parametrize(
    ("cap", "first_cap"),
    [
        (25 * MIB, 1 * MIB),  # the defaults: this model fits in the first bucket
        (8192, 2048),  # [6, 4] (4 crosses the first cap), [2, 0]
        (6400, 6400),  # [6, 4] (exactly the cap), [2, 0]
        (4096, 1024),  # [6] (alone over the first cap), [4], [2, 0]
        (1024, 1024),  # every leaf larger than the cap: one bucket each
    ],
)
def test_bucket_count_and_contents_follow_the_caps(cap, first_cap):
    pstep, (params, batch), step = _plain(cap, first_cap)
    schedule = pstep.schedule(params, batch)
    expected = _expected_buckets(_weights_in_production_order(SIZES), cap, first_cap)
    assert [_names(b) for b in schedule.buckets] == expected
    assert len(schedule.collectives) == len(schedule.buckets)
    for plan, names in zip(schedule.buckets, expected, strict=True):
        assert plan.nbytes == sum(params[n].numel() * 4 for n in names)
    view = GraphView(_graph(pstep, params, batch))
    assert sum(_is_all_reduce(n) for n in view.nodes) == len(expected)
    new, _ = pstep(params, batch)
    old, _ = step(params, batch)  # a world of one: pmean is the identity
    assert_trees_close(new, old, rtol=1e-6, atol=1e-6)


def test_graph_is_the_program_the_step_runs_and_needs_a_traced_step():
    params, batch, step = _mlp_step()
    pstep = fddp.data_parallel(step)
    graph = pstep.graph(params, batch)
    assert isinstance(graph, fx.GraphModule)
    pstep(params, batch)
    assert pstep.graph(params, batch) is graph and pstep.retraces == 0  # captured once
    with pytest.raises(ValueError, match="trace=False"):
        fddp.data_parallel(step, trace=False).graph(params, batch)


def test_default_cap_is_a_sixteenth_of_the_gradient_bytes():
    sizes = (16,) * 25  # 24 weights of 1024 bytes
    params, batch, step = _mlp_step(sizes)
    first_cap = 1000
    schedule = fddp.data_parallel(step, first_bucket_cap_mb=first_cap / MIB).schedule(params, batch)
    leaves = _weights_in_production_order(sizes)
    cap = sum(size for _, size in leaves) // 16  # 1536: two leaves a bucket
    expected = _expected_buckets(leaves, cap, first_cap)
    assert [_names(b) for b in schedule.buckets] == expected
    assert len(expected) == 1 + 23 // 2 + 1


def test_buckets_group_each_dtype_separately():
    params, batch, step = _mlp_step(bias=True)
    params = {k: v.double() if k.endswith("bias") else v for k, v in params.items()}
    schedule = fddp.data_parallel(step).schedule(params, batch)
    dtypes = sorted(b.dtype for b in schedule.buckets)
    assert dtypes == ["float32", "float64"]
    for plan in schedule.buckets:
        assert all(n.endswith("bias") == (plan.dtype == "float64") for n in _names(plan))


def test_weight_gradients_are_computed_straight_into_their_bucket():
    """A Linear weight's gradient is the whole output of a matmul: the matmul writes it into
    its slice of the bucket (no copy), and the step's results are those of the plain step."""
    pstep, (params, batch), step = _plain(4096, 1024)
    view = GraphView(_graph(pstep, params, batch))
    buckets = {_root(launch.args[0]) for launch in view.launches()}
    into_buckets = [
        n for n in view.nodes if _op(n) is aten.mm.out and _root(n.kwargs["out"]) in buckets
    ]
    assert len(into_buckets) == len(SIZES) - 1  # one per weight, no bias here
    writers = [n for n in view.nodes if any(_root(w) in buckets for w in _written(n))]
    copies = [n for n in writers if not _is_launch(n)]
    assert set(copies) == set(into_buckets), f"also written into buckets: {copies}"
    new, _ = pstep(params, batch)
    old, _ = step(params, batch)
    assert_trees_equal(new, old, "the scheduled step vs the step")


# --- overlap pass ----------------------------------------------------------------------------


def _launch_carrying(view: GraphView, schedule, leaf: str) -> fx.Node:
    """The all-reduce launch of the bucket that holds ``leaf``."""
    index = next(i for i, c in enumerate(schedule.collectives) if leaf in _names(c))
    return view.launches()[index]


def test_first_bucket_launches_before_backward_of_earlier_layers():
    pstep, (params, batch), _ = _plain(1024, 1024)
    schedule = pstep.schedule(params, batch)
    view = GraphView(_graph(pstep, params, batch))
    last_layer, first_layer = _models.mlp_weight_names(SIZES)[-1], "0.weight"
    assert _names(schedule.buckets[0]) == [last_layer]
    launch = _launch_carrying(view, schedule, last_layer)
    # The matmul that computes the first layer's weight gradient, and every matmul of the
    # backward pass that the first layer's gradient needs, after the last layer's gradient.
    needed = view.ancestors(_launch_carrying(view, schedule, first_layer))
    matmuls = [n for n in needed if _op(n) in (aten.mm.default, aten.addmm.default)]
    later = [n for n in matmuls if view.pos[n] > view.pos[launch]]
    assert later, f"the last layer's all-reduce launches after all of the backward:\n{schedule}"
    first = schedule.buckets[0]
    assert first.launch < schedule.buckets[-1].launch and first.overlapped > 0


SMALL_CAPS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.001}
LEAF_CAPS = {"bucket_cap_mb": 1024 / MIB, "first_bucket_cap_mb": 1024 / MIB}  # one leaf each


def _mlp_case(**options):
    params, batch, step = _mlp_step(bias=True)
    return fddp.data_parallel(step, **options), (params, batch), step


def _accumulation_case():
    params, batch, step = _mlp_step(microbatches=2)
    return fddp.data_parallel(step, **LEAF_CAPS), (params, batch), step


def _decoder_case():
    model = _models.tiny_decoder(layers=1)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.adamw(lr=1e-3)

    def step(params, opt_state, ids):
        loss, grads = fddp.value_and_grad(
            lambda p: _models.next_token_loss(apply(p, buffers, ids), ids)
        )(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, **SMALL_CAPS)
    return pstep, (params, opt.init(params), _models.token_batch(0, 2)), step


CASES = {
    "mlp": lambda: _mlp_case(**SMALL_CAPS),
    "mlp-bf16": lambda: _mlp_case(**SMALL_CAPS, comm_dtype=torch.bfloat16),
    "accumulation": _accumulation_case,
    "decoder": _decoder_case,
}
_compiled: dict[str, tuple] = {}


def _case(name: str):
    """``(pstep, args, step, schedule, graph view)`` of a case, captured once per module."""
    if name not in _compiled:
        pstep, args, step = CASES[name]()
        _compiled[name] = (
            pstep,
            args,
            step,
            pstep.schedule(*args),
            GraphView(_graph(pstep, *args)),
        )
    return _compiled[name]


@pytest.fixture(params=list(CASES))
def scheduled(request):
    return _case(request.param)[3:]


def test_every_wait_follows_its_launch_and_precedes_its_first_user(scheduled):
    schedule, view = scheduled
    launches = view.launches()
    assert len(launches) == len(schedule.collectives) > 1
    for launch, plan in zip(launches, schedule.collectives, strict=True):
        wait = view.wait_of(launch)
        assert view.pos[launch] < view.pos[wait]
        assert plan.launch <= plan.wait
        users = view.descendants(wait)
        assert users and min(view.pos[u] for u in users) > view.pos[wait]
        # no other reader of the result: everything downstream of the launch goes via the wait
        assert view.descendants(launch) - {wait} <= users


def test_nothing_touches_a_buffer_while_its_all_reduce_is_in_flight(scheduled):
    _, view = scheduled
    for launch in view.launches():
        wait = view.wait_of(launch)
        buffer = _root(launch.args[0])
        between = view.nodes[view.pos[launch] + 1 : view.pos[wait]]
        for node in between:
            touched = {_root(a) for a in node.all_input_nodes} | {_root(w) for w in _written(node)}
            assert buffer not in touched, f"{node} uses {buffer} while {launch} is in flight"


def test_every_launch_directly_follows_its_inputs(scheduled):
    """Between the last work a collective needs and its launch, only the preparation of
    collectives launched before it (bucket copies ready at the same point) may run."""
    _, view = scheduled
    prepared: set[fx.Node] = set()
    for launch in view.launches():
        needed = view.ancestors(launch)
        last = max(view.pos[n] for n in needed if _is_compute(n))
        between = view.nodes[last + 1 : view.pos[launch]]
        late = [n for n in between if _is_compute(n) and n not in prepared]
        assert not late, f"{launch} launches after {late}, which it does not need"
        prepared |= needed


def test_every_wait_sits_right_before_the_first_use_of_its_result(scheduled):
    """Between a wait and the first node that combines its result with other data, only the
    unpacking of results (work downstream of some wait) may run: other work would have
    overlapped the collective had the wait been placed later."""
    _, view = scheduled
    waits = [view.wait_of(launch) for launch in view.launches()]
    after_waits = set().union(*(view.descendants(w) for w in waits))
    for wait in waits:
        chain = view.descendants(wait)
        uses = [
            n
            for n in chain
            if _is_compute(n) and any(d not in chain and d is not wait for d in view.inputs(n))
        ]
        if not uses:
            continue
        first_use = min(uses, key=view.pos.__getitem__)
        between = view.nodes[view.pos[wait] + 1 : view.pos[first_use]]
        early = [n for n in between if _is_compute(n) and n not in after_waits]
        assert not early, f"{wait} blocks before {early}, which does not need it"


# --- comm_dtype ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_comm_dtype_casts_each_bucket_for_the_all_reduce(dtype):
    if dtype == torch.bfloat16:
        pstep, args, _, schedule, view = _case("mlp-bf16")
    else:
        pstep, args, _ = _mlp_case(**SMALL_CAPS, comm_dtype=dtype)
        schedule, view = pstep.schedule(*args), GraphView(_graph(pstep, *args))
    full = _case("mlp")[3]
    assert [b.leaves for b in schedule.buckets] == [b.leaves for b in full.buckets]
    for cast, plan in zip(schedule.buckets, full.buckets, strict=True):
        assert cast.dtype == str(dtype).removeprefix("torch.")
        assert 2 * cast.nbytes == plan.nbytes
    for launch in view.launches():
        assert launch.args[0].meta["val"].dtype == dtype
    outputs = view.nodes[-1].args[0]
    assert all(n.meta["val"].dtype == torch.float32 for n in outputs)  # cast back


def test_comm_dtype_step_runs_and_stays_close_to_float32():
    pstep, (params, batch), step, _, _ = _case("mlp-bf16")
    new, _ = pstep(params, batch)
    old, _ = step(params, batch)  # a world of one: pmean is the identity
    assert all(new[name].dtype == torch.float32 for name in params)
    assert_trees_close(new, old, rtol=1e-2, atol=1e-3)


# --- gradient accumulation -------------------------------------------------------------------


def test_accumulation_loop_reduces_each_gradient_once():
    _, (params, _), _, schedule, view = _case("accumulation")
    leaves = [leaf for plan in schedule.collectives for leaf in _names(plan)]
    assert sorted(leaves) == sorted(params)  # each gradient in one bucket, not once per microbatch
    assert sum(_is_all_reduce(n) for n in view.nodes) == len(schedule.buckets) == len(params)


def test_accumulated_reduction_overlaps_the_last_microbatch_backward():
    _, _, _, schedule, view = _case("accumulation")
    last_layer = _models.mlp_weight_names(SIZES)[-1]
    launch = _launch_carrying(view, schedule, last_layer)
    needed = view.ancestors(_launch_carrying(view, schedule, "0.weight"))
    last_matmul = max(
        (n for n in needed if _op(n) in (aten.mm.default, aten.addmm.default)),
        key=view.pos.__getitem__,
    )
    assert view.pos[launch] < view.pos[last_matmul]


def test_collective_of_a_collective_result_is_bucketed_separately():
    step = fddp.data_parallel(lambda p, x: fddp.psum(fddp.pmean(x)) + p["w"])
    x = torch.arange(8.0).reshape(2, 4)
    out = step({"w": torch.ones(1)}, x)
    torch.testing.assert_close(out, x + 1)
    assert len(step.schedule({"w": torch.ones(1)}, x).buckets) == 2
