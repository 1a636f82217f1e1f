"""Scale by simulation: fddp's and DDP's step time and scaling efficiency on 8 to 1024 ranks.

Predicted from the captured step with fddp's cost model and alpha-beta models of ring and tree
all-reduce.

    python benchmarks/simulate_scaling.py                      # both models, both links, validation
    python benchmarks/simulate_scaling.py --models gpt2-small --validate-ranks ""   # no ranks

What it does, top to bottom:

- **the step**: a GPT-style model (``workloads.GPT`` with fused causal attention) is built on
  the meta device and its whole training step (forward, backward, ``pmean`` of the gradients,
  AdamW) is captured at full size into fddp's aten graph, on fake tensors: nothing is computed
  and no process group is needed beyond fddp's world of one.
- **the compute**: each node costs what fddp's cost model says (``_cost.node_seconds``: FLOPs
  from torch's flop counter, else bytes moved) on an assumed accelerator (``Accelerator``),
  issued asynchronously: a kernel launch costs the host ``launch_s`` and the kernel starts when
  it is issued and the one before it is done (a GPU stream), so small kernels hide behind big
  ones.
- **the wire**: one all-reduce of ``b`` bytes on ``N`` ranks costs ``steps(N) * alpha + b *
  factor(N) / beta`` (``AllReduce``): ring ``2(N-1)`` steps and ``2(N-1)/N`` of the bytes,
  tree ``2 ceil(log2 N)`` steps and twice the bytes. Each ``N`` becomes a ``Machine`` whose
  ``latency`` and ``seconds_per_byte`` are those figures, as fddp would measure them.
- **fddp**: its bucket policy chooses the cap for each ``N`` (``CapPolicy.choose`` with
  ``_cost.predictor``), then fddp's own passes schedule the graph (bucket, rewrite, overlap:
  each bucket's optimizer update waits only for that bucket) and the scheduled graph is
  replayed (``run_program``).
- **DDP**: the same graph bucketed DDP's way (reverse parameter order, a 1 MiB first bucket,
  then 25 MiB, launched in bucket order), launches as early as the gradients allow, and every
  wait before the optimizer (it starts when ``backward()`` has returned and all buckets are in).
- **efficiency**: one rank's compute on its local batch (the same graph without collectives)
  over the predicted step time; weak scaling, the per-rank batch fixed.
- **validation**: 2, 3 and 4 gloo ranks on this CPU time fddp's step on a small workload
  beside ``compare_ddp``'s local step and flat all-reduce, and compare it with the replay of
  the step's own scheduled graph under the ``Machine`` fddp's probe measures
  (``fddp._ranks._machine.measure``), raw and calibrated by the measured compute and
  all-reduce, with fddp's cost model's own prediction beside it.

Writes ``results/<UTC stamp>_scaling_simulation.md`` and ``.png``. ``run_program`` and the
program builders are the testable core (``tests/test_simulate_scaling.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import fx, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts
import provenance
import workloads

import fddp
import fddp.optim as optim
from fddp._base._annotations import BUCKET
from fddp._collectives._bucket_policy import (
    DDP_CAP_BYTES,
    FIRST_CAP_BYTES,
    CapPolicy,
    candidates,
    rule_of_thumb,
)
from fddp._compiler._capture._trace import capture_step
from fddp._compiler._graph import is_collective, is_compute, is_wait, nbytes
from fddp._compiler._passes import _bucket, _overlap
from fddp._compiler._passes._cost import node_seconds, predictor
from fddp._ranks._machine import Machine, measure, measured

MIB = 2**20
WORLDS = tuple(2**k for k in range(3, 11))  # 8 ... 1024
LINKS_GBIT = (100.0, 400.0)
EXTRA_CAPS = (64 * MIB, 128 * MIB, 256 * MIB)  # beyond fddp's candidates: what a larger cap buys
_PACK_NODES = 6  # nodes a bucket adds (fddp's _cost counts the same): empty, copies, split, views


# ---- assumptions ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """The compute side: an A100-class GPU by default."""

    name: str = "A100-class GPU"
    peak_flops: float = 312e12  # dense bf16 tensor cores
    mfu: float = 0.45  # the fraction of peak the counted FLOPs (matmuls, attention) run at
    memory_bandwidth: float = 1.5e12  # bytes/s for memory-bound ops
    launch_s: float = 5e-6  # host time to issue one kernel
    activation_bytes: float = 0.5  # forward/backward move bf16 (autocast) of the fp32 graph's bytes

    def machine(self, latency: float = 0.0, seconds_per_byte: float = 0.0) -> Machine:
        """fddp's ``Machine`` for this accelerator behind a wire of these figures."""
        return Machine(
            latency,
            seconds_per_byte,
            1 / (self.peak_flops * self.mfu),
            1 / self.memory_bandwidth,
            self.launch_s,
        )


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """The alpha-beta cost of one all-reduce on ``n`` ranks, each with its own link."""

    algorithm: str  # "ring" or "tree"
    alpha: float  # seconds per step (message latency)
    bandwidth: float  # bytes per second of one rank's link

    def steps(self, n: int) -> int:
        if self.algorithm == "ring":
            return 2 * (n - 1)
        return 2 * math.ceil(math.log2(n))  # reduce up a tree, broadcast down

    def byte_factor(self, n: int) -> float:
        """Bytes on each rank's link per byte of the buffer."""
        return 2 * (n - 1) / n if self.algorithm == "ring" else 2.0

    def seconds(self, n: int, nbytes: int) -> float:
        return self.steps(n) * self.alpha + nbytes * self.byte_factor(n) / self.bandwidth

    def machine(self, n: int, accelerator: Accelerator) -> Machine:
        """The figures fddp's ``_machine.measure`` would find: latency and seconds per byte."""
        return accelerator.machine(self.steps(n) * self.alpha, self.byte_factor(n) / self.bandwidth)


# ---- the models -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    dim: int
    layers: int
    heads: int
    vocab: int = 50257
    seq: int = 1024
    batch: int = 8  # sequences per rank

    @property
    def title(self) -> str:
        return f"{self.name} ({self.layers} layers, width {self.dim}, {self.heads} heads)"


MODELS = {
    m.name: m
    for m in (
        ModelSpec("gpt2-small", dim=768, layers=12, heads=12),
        ModelSpec("gpt-1b", dim=2048, layers=18, heads=16),
    )
}


class _FusedAttentionBlock(workloads._Block):
    """``workloads._Block`` with the fused (flash) causal attention an accelerator runs: the
    flop counter knows it, and no T x T score matrix is moved. Meta tensors only (capture)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        att = torch.ops.aten._scaled_dot_product_flash_attention(*qkv, 0.0, True)[0]
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _FusedGPT(workloads.GPT):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec.vocab, spec.seq, spec.dim, spec.heads, spec.layers)
        blocks = (_FusedAttentionBlock(spec.dim, spec.heads) for _ in range(spec.layers))
        self.blocks = nn.ModuleList(blocks)


def _training_step(model: nn.Module, opt: optim.GradientTransformation) -> Callable:
    """The pure step fddp schedules: gradients averaged over ranks, AdamW (the loss is not)."""
    apply = fddp.functional(model)
    loss = workloads.WORKLOADS["gpt"].loss

    def step(params: dict, opt_state: Any, buffers: dict, batch: tuple) -> tuple:
        def loss_fn(p: dict) -> torch.Tensor:
            return loss(apply(p, buffers, batch[0]), batch[1])

        value, grads = fddp.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, value

    return step


@dataclasses.dataclass
class Captured:
    spec: ModelSpec
    graph: fx.GraphModule  # as captured, never modified: copied for each schedule
    params: int
    param_order: list[str]  # DDP's bucket order is its reverse
    seconds: float


def capture_model(spec: ModelSpec) -> Captured:
    """The whole training step of ``spec`` as one aten graph on fake tensors (a world of one)."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = _FusedGPT(spec)
    params, buffers = fddp.state(model)
    opt = optim.adamw(lr=1e-3, weight_decay=0.01)
    tokens = torch.zeros(spec.batch, spec.seq, dtype=torch.long, device="meta")
    args = (params, opt.init(params), buffers, (tokens, tokens))
    captured = capture_step(_training_step(model, opt), args)
    count = sum(p.numel() for p in params.values())
    return Captured(spec, captured.graph, count, list(params), time.perf_counter() - start)


# ---- the core: a step as a program of compute, launches and waits, replayed ------------------


class Compute(NamedTuple):
    launch: float  # host seconds to issue it (0 for views and bookkeeping)
    work: float  # device seconds


class Launch(NamedTuple):
    bucket: int
    nbytes: int


class Wait(NamedTuple):
    bucket: int


Op = Compute | Launch | Wait
NO_COST = Compute(0.0, 0.0)


def run_program(
    program: Sequence[Op],
    latency: float,
    seconds_per_byte: float,
    *,
    launch_s: float,
    asynchronous: bool,
) -> float:
    """Seconds of ``program``: compute on one queue, all-reduces on the wire, one at a time.

    ``asynchronous`` (an accelerator) keeps two clocks: the host issues each op (``launch``) and
    the device runs it once issued and free; a wait stalls the device, not the host. Otherwise
    (a CPU) there is one clock and each op costs ``launch + work``, as in fddp's ``predict``.
    An all-reduce starts when its input is computed and the wire is free.
    """
    host = device = wire = 0.0
    arrival: dict[int, float] = {}
    for op in program:
        if isinstance(op, Compute):
            if asynchronous:
                host += op.launch
                device = max(device, host) + op.work
            else:
                device += op.launch + op.work
        elif isinstance(op, Launch):
            if asynchronous:
                host += launch_s
                start = max(host, device, wire)
            else:
                device += launch_s
                start = max(device, wire)
            wire = start + latency + op.nbytes * seconds_per_byte
            arrival[op.bucket] = wire
        else:
            device = max(device, arrival[op.bucket])
    return max(host, device, wire)


def step_seconds(program: Sequence[Op], machine: Machine, *, asynchronous: bool) -> float:
    """:func:`run_program` under ``machine``'s wire."""
    return run_program(
        program,
        machine.latency,
        machine.seconds_per_byte,
        launch_s=machine.seconds_per_node,
        asynchronous=asynchronous,
    )


def downstream_of_waits(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that need a reduced value: the optimizer's update (and pmean's division)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if is_wait(node) or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def node_costs(
    graph: fx.Graph, machine: Machine, *, asynchronous: bool, activation_bytes: float = 1.0
) -> list[Compute]:
    """Each node's cost from fddp's cost model (``_cost.node_seconds``).

    Synchronous: fddp's figure as it is (dispatch plus work). Asynchronous: the launch only for
    nodes that run a kernel (``is_compute``), the work apart; memory-bound nodes of the forward
    and backward move ``activation_bytes`` of the recorded (fp32) bytes, the optimizer all.
    """
    if not asynchronous:
        return [Compute(0.0, s) for s in node_seconds(graph, machine)]
    free = dataclasses.replace(machine, seconds_per_node=0.0)
    full = node_seconds(graph, free)
    per_byte = machine.seconds_per_byte_moved * activation_bytes
    light = node_seconds(graph, dataclasses.replace(free, seconds_per_byte_moved=per_byte))
    tail = downstream_of_waits(graph)
    return [
        Compute(machine.seconds_per_node if is_compute(n) else 0.0, f if n in tail else a)
        for n, f, a in zip(graph.nodes, full, light)
    ]


def program_from_graph(
    graph: fx.Graph, costs: Sequence[Compute], *, ddp: bool = False, local: bool = False
) -> list[Op]:
    """The program a scheduled graph runs, in its order.

    ``ddp``: DDP's reducer instead of the graph's waits: bucket ``k`` launches only after
    buckets ``0..k-1`` (the rewrite's bucket index), and once the last is launched the step
    waits for all of them (``backward()`` returns when every bucket is reduced; the optimizer
    runs after it). ``local``: no collectives and no pmean division (one rank's own step).
    """
    launches = sum(1 for n in graph.nodes if is_collective(n))
    ops: list[Op] = []
    index: dict[fx.Node, int] = {}
    pending: dict[int, Launch] = {}  # ddp: launched in the graph, not yet by the reducer
    issued = 0
    divisions = {u for n in graph.nodes if is_wait(n) for u in n.users} if local else set()
    for node, cost in zip(graph.nodes, costs):
        if is_collective(node):
            if local:
                continue
            index[node] = node.meta.get(BUCKET, len(index)) if ddp else len(index)
            pending[index[node]] = Launch(index[node], nbytes(node.args[0]))
            while (issued if ddp else index[node]) in pending:
                ops.append(pending.pop(issued if ddp else index[node]))
                issued += 1
            if ddp and issued == launches:
                ops += [Wait(i) for i in range(launches)]
        elif is_wait(node):
            assert not ddp or issued == launches, "a wait before the last launch"
            if not local and not ddp:
                ops.append(Wait(index[node.args[0]]))
        elif node not in divisions and (cost.launch or cost.work):
            ops.append(cost)
    return ops


def program_from_members(
    seconds: Sequence[Compute],
    buckets: Sequence[Sequence[_bucket.Member]],
    optimizer: Sequence[tuple[Compute, int | None]],
    *,
    overlap_optimizer: bool,
    pack: Compute = NO_COST,
    in_order: bool = False,
) -> list[Op]:
    """A step from a member list, without scheduling a graph (the analytic model).

    ``seconds[p]`` is the compute at graph position ``p``; a bucket launches (after ``pack``)
    once its last member is ready, in index order with ``in_order``. ``optimizer`` is the
    update, op by op, each with the bucket whose leaves alone it reads, or None for an op over
    every leaf (a foreach op). With ``overlap_optimizer`` (fddp) the update of bucket ``k`` waits
    for bucket ``k`` only: each foreach op is split by bucket, its work shared by bytes, its
    launch repeated. Without it (DDP) the whole update waits for every bucket.
    """
    sizes = [_bucket.total_bytes(list(b)) for b in buckets]
    launch_at: dict[int, list[int]] = {}
    earliest = -1
    for i, b in enumerate(buckets):
        position = max(m.ready for m in b)
        earliest = max(earliest, position) if in_order else position
        launch_at.setdefault(earliest, []).append(i)
    ops: list[Op] = []
    for position, cost in enumerate(seconds):
        ops.append(cost)
        for i in launch_at.pop(position, ()):
            ops += [pack, Launch(i, sizes[i])]
    assert not launch_at, "a bucket is ready after the last position"
    if not overlap_optimizer:
        return ops + [Wait(i) for i in range(len(buckets))] + [c for c, _ in optimizer]
    total = sum(sizes)
    for i, size in enumerate(sizes):
        ops.append(Wait(i))
        for cost, owner in optimizer:
            if owner is None:
                ops.append(Compute(cost.launch, cost.work * size / total))
            elif owner == i:
                ops.append(cost)
    return ops


# ---- schedules: fddp's and DDP's buckets on the captured graph ------------------------------


def leaf_name(member: _bucket.Member) -> str:
    """The parameter name in a member's leaf path (``['blocks.0.fc.weight']``)."""
    match = re.fullmatch(r"\['(.*)'\]", member.path)
    return match.group(1) if match else member.path


def ddp_buckets(members: Sequence[_bucket.Member], param_order: Sequence[str]) -> list[list]:
    """DDP's assignment: parameters in reverse order, a bucket closes once it holds its limit
    (1 MiB for the first, then 25 MiB), the tensor that crosses it included."""
    rank = {name: i for i, name in enumerate(param_order)}
    ordered = sorted(members, key=lambda m: -rank[leaf_name(m)])
    buckets: list[list] = []
    current: list = []
    size = 0
    for m in ordered:
        current.append(m)
        size += nbytes(m.source)
        if size >= (FIRST_CAP_BYTES if not buckets else DDP_CAP_BYTES):
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


@dataclasses.dataclass
class Schedule:
    """A scheduled graph replayed as a program (its costs do not depend on the wire)."""

    label: str
    program: list[Op]
    buckets: int
    ddp: bool


def schedule(
    captured: Captured,
    accelerator: Accelerator,
    cap: int | None,
) -> Schedule:
    """fddp's passes on a copy of the graph with ``cap`` (None: DDP's buckets and no optimizer
    split, every wait before the update)."""
    gm = copy.deepcopy(captured.graph)
    graph = gm.graph
    _overlap.hoist_gradient_sums(graph)
    members = _bucket.find_members(graph)
    if cap is None:
        buckets = ddp_buckets(members, captured.param_order)
    else:
        buckets = _bucket.assign(members, cap, FIRST_CAP_BYTES)
    _bucket.rewrite(graph, buckets, None, functional=False)
    _bucket.pack_concatenations_in_place(graph)
    if cap is None:
        _overlap.hoist_launches(graph)
        _overlap.sink_waits(graph)
    else:
        _overlap.overlap(graph)
    costs = node_costs(
        graph,
        accelerator.machine(),
        asynchronous=True,
        activation_bytes=accelerator.activation_bytes,
    )
    program = program_from_graph(graph, costs, ddp=cap is None)
    label = "ddp" if cap is None else f"{cap / MIB:g}"
    return Schedule(label, program, len(buckets), cap is None)


@dataclasses.dataclass
class Analysed:
    """What the capture gives once: fddp's view of the graph, the local step, the analytic
    model's inputs."""

    captured: Captured
    members: list[_bucket.Member]
    predict_graph: fx.Graph  # after hoist_gradient_sums, as fddp's pipeline predicts from
    local: float  # one rank's step, no collectives (seconds)
    model_flops: float  # 6 * params * tokens


def analyse(captured: Captured, accelerator: Accelerator) -> Analysed:
    graph = copy.deepcopy(captured.graph).graph
    _overlap.hoist_gradient_sums(graph)
    members = _bucket.find_members(graph)
    costs = node_costs(
        graph,
        accelerator.machine(),
        asynchronous=True,
        activation_bytes=accelerator.activation_bytes,
    )
    local = run_program(
        program_from_graph(graph, costs, local=True), 0.0, 0.0, launch_s=0.0, asynchronous=True
    )
    tokens = captured.spec.batch * captured.spec.seq
    return Analysed(captured, members, graph, local, 6.0 * captured.params * tokens)


def analytic_program(analysed: Analysed, accelerator: Accelerator, cap: int | None) -> list[Op]:
    """:func:`program_from_members` for the captured graph: the cross-check of the schedules."""
    graph = analysed.predict_graph
    costs = node_costs(
        graph,
        accelerator.machine(),
        asynchronous=True,
        activation_bytes=accelerator.activation_bytes,
    )
    tail = downstream_of_waits(graph)
    members = analysed.members
    if cap is None:
        buckets = ddp_buckets(members, analysed.captured.param_order)
    else:
        buckets = _bucket.assign(members, cap, FIRST_CAP_BYTES)
    owner = {m.wait: i for i, b in enumerate(buckets) for m in b}
    nodes = list(graph.nodes)
    seconds = [Compute(0.0, 0.0) if n in tail else c for n, c in zip(nodes, costs)]
    optimizer = []
    for node, cost in zip(nodes, costs):
        if node in tail and not is_wait(node) and (cost.launch or cost.work):
            waits = [a for a in node.all_input_nodes if a in owner]
            optimizer.append((cost, owner[waits[0]] if len(waits) == 1 else None))
    pack = Compute(_PACK_NODES * accelerator.launch_s, 0.0)
    return program_from_members(
        seconds,
        buckets,
        optimizer,
        overlap_optimizer=cap is not None,
        pack=pack,
        in_order=cap is None,
    )


def fddp_choice(analysed: Analysed, machine: Machine) -> tuple[int, float]:
    """fddp's own default: ``CapPolicy`` with ``_cost.predictor`` on the captured graph, as
    ``_pipeline.schedule_graph`` calls them; the cap and the cost model's predicted seconds."""
    members = analysed.members
    predict = predictor(analysed.predict_graph, members, FIRST_CAP_BYTES, machine)
    choice = CapPolicy(None, FIRST_CAP_BYTES).choose(_bucket.total_bytes(members), machine, predict)
    return choice.cap, predict(choice.cap)


def overlap_aware_choice(total: int, machine: Machine, predicted: dict[int, float]) -> int:
    """The cap fddp's policy would choose if its predictions were the scheduled programs'
    (``predicted`` must hold every candidate and the rule of thumb)."""
    return CapPolicy(None, FIRST_CAP_BYTES).choose(total, machine, predicted.__getitem__).cap


# ---- the simulation -------------------------------------------------------------------------


@dataclasses.dataclass
class Point:
    model: str
    link_gbit: float
    algorithm: str
    world: int
    local_ms: float
    fddp_cap: int
    fddp_ms: float
    fddp_own_ms: float  # fddp's cost model (no optimizer overlap, additive dispatch)
    ddp_ms: float
    aware_cap: int
    best_cap: int
    best_ms: float

    @property
    def fddp_eff(self) -> float:
        return self.local_ms / self.fddp_ms

    @property
    def ddp_eff(self) -> float:
        return self.local_ms / self.ddp_ms


def simulate(
    analysed: Analysed,
    accelerator: Accelerator,
    links_gbit: Sequence[float],
    worlds: Sequence[int],
    alpha: float,
    log: Callable[[str], None] = print,
) -> tuple[list[Point], dict[str, Any]]:
    captured = analysed.captured
    total = _bucket.total_bytes(analysed.members)
    wires = [
        (link, AllReduce(alg, alpha, link * 1e9 / 8))
        for link in links_gbit
        for alg in ("ring", "tree")
    ]
    choices = {
        (link, w.algorithm, n): fddp_choice(analysed, w.machine(n, accelerator))
        for link, w in wires
        for n in worlds
    }
    preferred = {
        rule_of_thumb(total, FIRST_CAP_BYTES, w.machine(n, accelerator))
        for _, w in wires
        for n in worlds
    }
    caps = {*candidates(total, FIRST_CAP_BYTES), *preferred, *(c for c, _ in choices.values())}
    caps = sorted({*caps, *(c for c in EXTRA_CAPS if c < total), total})  # total: one bucket
    start = time.perf_counter()
    schedules: dict[int | None, Schedule] = {c: schedule(captured, accelerator, c) for c in caps}
    schedules[None] = schedule(captured, accelerator, None)
    log(f"  {len(schedules)} schedules in {time.perf_counter() - start:.1f} s")
    points = []
    for link, w in wires:
        for n in worlds:
            machine = w.machine(n, accelerator)
            seconds = {
                c: step_seconds(s.program, machine, asynchronous=True) for c, s in schedules.items()
            }
            cap, own = choices[(link, w.algorithm, n)]
            real_caps = {c: s for c, s in seconds.items() if c is not None}
            best = min(real_caps, key=real_caps.__getitem__)
            points.append(
                Point(
                    captured.spec.name,
                    link,
                    w.algorithm,
                    n,
                    analysed.local * 1e3,
                    cap,
                    seconds[cap] * 1e3,
                    own * 1e3,
                    seconds[None] * 1e3,
                    overlap_aware_choice(total, machine, real_caps),
                    best,
                    seconds[best] * 1e3,
                )
            )
    # the analytic model against the scheduled graphs, at 256 ranks (or the largest simulated)
    n = 256 if 256 in worlds else worlds[-1]
    check = {}
    for link, w in wires:
        machine = w.machine(n, accelerator)
        for cap in (DDP_CAP_BYTES, 4 * MIB, None):
            if cap is not None and cap not in schedules:
                continue
            graph_s = step_seconds(schedules[cap].program, machine, asynchronous=True)
            model_s = step_seconds(
                analytic_program(analysed, accelerator, cap), machine, asynchronous=True
            )
            label = "DDP" if cap is None else f"fddp {cap / MIB:g} MiB"
            check[f"{link:g} Gbit/s {w.algorithm}, {label}"] = (graph_s * 1e3, model_s * 1e3)
    info = {
        "total_bytes": total,
        "buckets": {s.label: s.buckets for s in schedules.values()},
        "check_world": n,
        "check": check,
    }
    return points, info


# ---- validation on this machine's CPU: gloo ranks -------------------------------------------


def _validate_rank(
    rank: int, world: int, port: int, workload_name: str, steps: int, out: str
) -> None:
    """One rank: fddp's step, a plain local step and one all-reduce of every gradient
    (``compare_ddp``'s variants), interleaved step by step, with fddp's probe after each."""
    import json

    import compare_ddp
    import ranks
    import torch.distributed as dist

    ranks.join_world(rank, world, port, threads=1)
    device = torch.device("cpu")
    workload = workloads.WORKLOADS[workload_name]
    batches = workloads.rank_batches(workload, world, rank, device)
    model = workloads.build_model(workload, device)
    params, buffers = fddp.state(model)
    opt = optim.adamw(lr=compare_ddp.LR, weight_decay=compare_ddp.WEIGHT_DECAY)
    params = fddp.replicate(params)
    state = [params, opt.init(params), buffers]
    pstep = fddp.data_parallel(
        compare_ddp._pure_step(model, workload, opt, average_grads=True), donate_argnums=(0, 1)
    )

    def fddp_step(batch: tuple) -> None:
        p, s, b, _ = pstep(*state, batch)
        state[:] = fddp.block_until_ready([p, s, b])

    built = {
        "fddp": fddp_step,
        **{
            k: compare_ddp.build(compare_ddp.Spec(k), workload, device).step
            for k in ("local", "allreduce")
        },
    }
    times: dict[str, list[float]] = {k: [] for k in built}
    cpu: dict[str, list[float]] = {k: [] for k in built}  # this process's CPU seconds
    probes = []  # fddp's link and compute probe, once per timed step, interleaved with them
    for i in range(steps + 3):  # three warm-up steps (the first captures and measures)
        names = list(built)
        for name in names[i % 3 :] + names[: i % 3]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            built[name](batches[i % len(batches)])
            if i >= 3:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
        if i >= 3:
            probes.append(dataclasses.astuple(measure(None, device)))
    slowest = {k: [max(s) for s in zip(*compare_ddp._gather(v))] for k, v in times.items()}
    chose_with = measured(None, device)  # the one probe fddp chose its cap from
    machine = Machine(*(statistics.median(column) for column in zip(*probes)))
    graph = pstep.graph(*state, batches[0]).graph
    plan = pstep.schedule(*state, batches[0])
    if rank == 0:
        costs = node_costs(graph, machine, asynchronous=False)
        own = re.search(r"predicted step ([0-9.]+) ms", plan.bucket_cap)
        result = {
            "world": world,
            "machine": dataclasses.astuple(machine),
            "chose_with": str(chose_with),
            "loadavg": os.getloadavg()[0],
            "cap": plan.bucket_cap.split(",")[0].removeprefix("bucket cap "),
            "buckets": sum(1 for c in plan.collectives if c.kind.startswith("all_red")),
            "gradient_bytes": 4 * workloads.param_count(model),
            **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in slowest.items()},
            **{f"{k}_min_ms": min(v) * 1e3 for k, v in slowest.items()},
            **{f"{k}_cpu_ms": statistics.median(v) * 1e3 for k, v in cpu.items()},
            "program": [[*op, type(op).__name__] for op in program_from_graph(graph, costs)],
            "local_program": [
                [*op, type(op).__name__] for op in program_from_graph(graph, costs, local=True)
            ],
            "own_ms": float(own.group(1)) if own else None,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


_OPS = {"Compute": Compute, "Launch": Launch, "Wait": Wait}


def _scaled(machine: Machine, compute: float, link: float) -> Machine:
    return Machine(
        machine.latency * link,
        machine.seconds_per_byte * link,
        machine.seconds_per_flop * compute,
        machine.seconds_per_byte_moved * compute,
        machine.seconds_per_node * compute,
    )


def validate(worlds: Sequence[int], workload: str, steps: int) -> list[dict[str, Any]]:
    """fddp's step on ``worlds`` gloo ranks of this CPU, measured, beside its replay under the
    probed ``Machine``; the probed link beside a measured all-reduce and the ring model's
    extrapolation from the first world; and the replay with compute and link calibrated by
    the local step and the all-reduce measured in the same run."""
    import json

    import ranks
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    for world in worlds:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            mp.spawn(
                _validate_rank,
                args=(world, ranks.free_port(), workload, steps, path),
                nprocs=world,
                join=True,
            )
            with open(path) as f:
                row = json.load(f)
        machine = Machine(*row["machine"])
        program = [_OPS[op[-1]](*op[:-1]) for op in row.pop("program")]
        local = [_OPS[op[-1]](*op[:-1]) for op in row.pop("local_program")]
        row["predicted_ms"] = step_seconds(program, machine, asynchronous=False) * 1e3
        row["compute_ms"] = step_seconds(local, machine, asynchronous=False) * 1e3
        nbytes = row["gradient_bytes"]
        row["allreduce_predicted_ms"] = (machine.latency + nbytes * machine.seconds_per_byte) * 1e3
        if rows:  # the ring model from the first world's probed latency and bandwidth
            first, n0 = Machine(*rows[0]["machine"]), rows[0]["world"]
            alpha = first.latency / (2 * (n0 - 1))
            beta = 2 * (n0 - 1) / n0 / first.seconds_per_byte
            row["ring_allreduce_ms"] = AllReduce("ring", alpha, beta).seconds(world, nbytes) * 1e3
        compute = row["local_ms"] / row["compute_ms"]
        link = row["allreduce_ms"] / row["allreduce_predicted_ms"]
        row["calibration"] = (compute, link)
        calibrated = [
            Compute(op.launch * compute, op.work * compute) if isinstance(op, Compute) else op
            for op in program
        ]
        wire = _scaled(machine, compute, link)
        row["calibrated_ms"] = step_seconds(calibrated, wire, asynchronous=False) * 1e3
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        print(
            f"  {world} ranks: fddp measured {row['fddp_ms']:.1f} ms, replay "
            f"{row['predicted_ms']:.1f} ms, calibrated {row['calibrated_ms']:.1f} ms "
            f"({row['wall_s']:.0f} s)",
            flush=True,
        )
    return rows


# ---- the report -----------------------------------------------------------------------------

# Published scaling (see the report's section): what each measured, as the papers state it.
PUBLISHED = (
    (
        "PyTorch DDP (Li et al., VLDB 2020)",
        "ResNet50, BERT",
        "up to 256 GPUs (V100 servers, 8 GPUs each)",
        "near-linear scaling to 256 GPUs (the paper's headline; NCCL, overlap and 25 MiB buckets)",
    ),
    (
        "Horovod (Sergeev & Del Balso, 2018)",
        "Inception V3, ResNet-101 (VGG-16)",
        "up to 512 GPUs (servers of 4 Pascal GPUs, 25 Gbit/s RoCE)",
        "about 90 % scaling efficiency for Inception V3 and ResNet-101, 68 % for VGG-16",
    ),
)


def _ms(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _mib(cap: int) -> str:
    return f"{cap / MIB:.3g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def _by(points: list[Point], **where: Any) -> list[Point]:
    return [p for p in points if all(getattr(p, k) == v for k, v in where.items())]


def report(
    args: argparse.Namespace,
    accelerator: Accelerator,
    results: dict[str, tuple[Analysed, list[Point], dict[str, Any]]],
    validation: list[dict[str, Any]],
    started: datetime.datetime,
    plot_name: str | None,
) -> str:
    points = [p for _, pts, _ in results.values() for p in pts]
    links = sorted({p.link_gbit for p in points})
    worlds = sorted({p.world for p in points})
    lines = [
        "# Scaling by simulation: fddp's schedule against DDP's, "
        f"{worlds[0]} to {worlds[-1]} ranks",
        "",
        f"`python benchmarks/simulate_scaling.py {' '.join(args.argv)}`".replace(" `", "`"),
        f"({started:%Y-%m-%d %H:%M} UTC, fddp commit {provenance.commit()}, "
        f"torch {torch.__version__}, "
        f"{time.perf_counter() - args.t0:.0f} s). A prediction, not a measurement: the compute "
        "comes from fddp's cost model on an assumed accelerator, the wire from alpha-beta "
        "models; only the last section measures anything (this machine's CPU, 2-4 ranks).",
        "",
        "## Headline: scaling efficiency",
        "",
        "Efficiency = one rank's compute on its local batch / the predicted step time (weak "
        "scaling, fixed per-rank batch). fddp at the cap its own policy chooses for each N; "
        "DDP at its defaults.",
        "",
    ]
    head_worlds = [n for n in (256, 1024) if n in worlds] or worlds[-1:]
    header = ["model", "link", "all-reduce"]
    header += [f"{who} @{n}" for n in head_worlds for who in ("fddp", "DDP")]
    rows = []
    for name in results:
        for link in links:
            for alg in ("ring", "tree"):
                row: list[Any] = [name, f"{link:g} Gbit/s", alg]
                for n in head_worlds:
                    (p,) = _by(points, model=name, link_gbit=link, algorithm=alg, world=n)
                    row += [f"**{p.fddp_eff:.2f}**", f"{p.ddp_eff:.2f}"]
                rows.append(row)
    lines += _table(header, rows)
    if plot_name:
        lines += ["", f"![efficiency against ranks]({plot_name})"]
    lines += ["", "## Assumptions", ""]
    lines += _assumptions(args, accelerator, results)
    lines += ["", "## Step time and efficiency per N", ""]
    for analysed, pts, info in results.values():
        spec = analysed.captured.spec
        lines += [
            f"### {spec.title}",
            "",
            f"{analysed.captured.params / 1e6:.1f}M parameters, "
            f"{info['total_bytes'] / MIB:.0f} MiB of fp32 gradients; per rank {spec.batch} x "
            f"{spec.seq} tokens; one rank's compute (no collectives) "
            f"**{analysed.local * 1e3:.1f} ms**, i.e. "
            f"{analysed.model_flops / analysed.local / accelerator.peak_flops:.0%} MFU by 6 x "
            "params x tokens. Times in ms, efficiency in brackets; 'fddp model' is fddp's own "
            "cost model's prediction at its chosen cap (no optimizer overlap, dispatch added to "
            "every node).",
            "",
        ]
        for link in links:
            header = ["N", "ring fddp", "ring DDP", "ring fddp model", "tree fddp", "tree DDP"]
            header += ["tree fddp model"]
            rows = []
            for n in worlds:
                ring, tree = (
                    _by(pts, link_gbit=link, algorithm=a, world=n)[0] for a in ("ring", "tree")
                )
                rows.append(
                    [
                        n,
                        f"{_ms(ring.fddp_ms)} ({ring.fddp_eff:.2f})",
                        f"{_ms(ring.ddp_ms)} ({ring.ddp_eff:.2f})",
                        _ms(ring.fddp_own_ms),
                        f"{_ms(tree.fddp_ms)} ({tree.fddp_eff:.2f})",
                        f"{_ms(tree.ddp_ms)} ({tree.ddp_eff:.2f})",
                        _ms(tree.fddp_own_ms),
                    ]
                )
            lines += [f"**{link:g} Gbit/s**", "", *_table(header, rows), ""]
    lines += ["## fddp's bucket cap per N", ""]
    lines += [
        "MiB. 'chosen': fddp's default policy (`CapPolicy.choose` with `_cost.predictor`, the "
        "cost model's predictions of the captured graph under the N-rank wire). 'aware': what "
        "the same policy would choose from the scheduled programs' predictions (optimizer "
        "overlap included). 'best': the fastest simulated cap of any size, up to one bucket "
        "for everything after the first, with the efficiency it gives.",
        "",
    ]
    for name, (_, pts, info) in results.items():
        header = ["link, all-reduce", *(str(n) for n in worlds)]
        rows = []
        for link in links:
            for alg in ("ring", "tree"):
                cells = {"chosen": [], "aware": [], "best": []}
                for n in worlds:
                    (p,) = _by(pts, link_gbit=link, algorithm=alg, world=n)
                    cells["chosen"].append(_mib(p.fddp_cap))
                    cells["aware"].append(_mib(p.aware_cap))
                    cells["best"].append(f"{_mib(p.best_cap)} ({p.local_ms / p.best_ms:.2f})")
                for kind, row in cells.items():
                    rows.append([f"{link:g} Gbit/s {alg}, {kind}", *row])
        buckets = ", ".join(
            f"{k} MiB: {v}" if k != "ddp" else f"DDP: {v}" for k, v in info["buckets"].items()
        )
        lines += [f"**{name}** (buckets per cap: {buckets})", "", *_table(header, rows), ""]
    lines += ["## Cross-check: the member-list model against the scheduled graphs", ""]
    lines += [
        "`program_from_members` (buckets from the member list, the backward's per-node costs, "
        "the optimizer's ops split by bucket bytes: no graph scheduled) against the replay of "
        "the graph fddp's passes scheduled, at "
        f"{next(iter(results.values()))[2]['check_world']} ranks, in ms:",
        "",
    ]
    rows = []
    for name, (_, _, info) in results.items():
        for label, (graph_ms, model_ms) in info["check"].items():
            rows.append(
                [name, label, _ms(graph_ms), _ms(model_ms), f"{model_ms / graph_ms - 1:+.1%}"]
            )
    lines += _table(["model", "case", "scheduled graph", "member-list model", "difference"], rows)
    lines += ["", "## Validation on this machine: 2, 3, 4 gloo ranks", ""]
    lines += _validation(args, validation)
    lines += ["", "## Against published figures", ""]
    lines += _published(results, accelerator)
    return "\n".join(lines) + "\n"


def _assumptions(
    args: argparse.Namespace,
    accelerator: Accelerator,
    results: dict[str, tuple[Analysed, list[Point], dict[str, Any]]],
) -> list[str]:
    a = accelerator
    return [
        f"- **Accelerator**: {a.name}: {a.peak_flops / 1e12:.0f} TFLOP/s peak bf16, the FLOPs "
        f"torch's flop counter sees (matmuls, fused attention) at {a.mfu:.0%} of it "
        f"({a.peak_flops * a.mfu / 1e12:.0f} TFLOP/s); memory-bound ops at "
        f"{a.memory_bandwidth / 1e12:.2g} TB/s on the bytes the graph records, the forward's "
        f"and backward's at {a.activation_bytes:g} of them (bf16 activations under autocast; "
        "gradients, master weights and AdamW state fp32); "
        f"{a.launch_s * 1e6:g} us of host time per kernel launch, launches asynchronous (a "
        "kernel starts when issued and the previous one is done; views cost nothing).",
        "- **Costs per node**: fddp's `_cost.node_seconds` on the captured graph (FLOPs where "
        "torch's counter knows the op, else bytes read and written), computed without its "
        "dispatch term and with the launch added as above. fddp's own choice of cap uses "
        "`_cost.predictor` unchanged (dispatch added to every node, the optimizer after all "
        "buckets).",
        f"- **Wire**: every rank has its own {' or '.join(f'{x:g}' for x in args.link_list)} "
        f"Gbit/s link; alpha = {args.alpha_us:g} us per step; ring all-reduce: 2(N-1) steps, "
        "2(N-1)/N of the buffer on each link; tree (double binary tree, recursive halving-"
        "doubling's latency): 2 ceil(log2 N) steps, twice the buffer. A flat topology: no "
        "faster links inside a node, no hierarchy, no congestion, no SM contention between "
        "NCCL kernels and compute, one all-reduce on the wire at a time.",
        "- **Models**: `workloads.GPT` (pre-norm blocks, learned positions, tied head) with "
        "fused causal attention (`aten._scaled_dot_product_flash_attention`; the flop counter "
        "counts it as non-causal, about 2x the attention FLOPs a causal kernel does), built "
        "on the meta device and captured whole (forward, backward, pmean, fddp's AdamW) by "
        "fddp's capture (make_fx on fake tensors, a world of one): "
        + "; ".join(
            f"{n}: {an.captured.params / 1e6:.1f}M params, {len(an.captured.graph.graph.nodes)} "
            f"nodes, captured in {an.captured.seconds:.1f} s"
            for n, (an, _, _) in results.items()
        )
        + ".",
        "- **fddp's schedule**: for each N, `CapPolicy(None, 1 MiB).choose` (the default) with "
        "`_cost.predictor` under a `Machine` whose latency and seconds per byte are the N-rank "
        "all-reduce's; then fddp's passes on a copy of the graph (`hoist_gradient_sums`, "
        "`assign`, `rewrite`, `pack_concatenations_in_place`, `overlap`: the optimizer's "
        "foreach ops split by bucket, each bucket's update right after its wait), replayed op by "
        "op. `reinplace` is not run (it changes which buffers are written, not the bytes moved).",
        "- **DDP's schedule**: the same graph and packing, DDP's buckets (parameters in reverse "
        "order, a bucket closes at 1 MiB for the first, then 25 MiB), launched in bucket order "
        "as soon as their gradients exist, every wait before the first optimizer op: AdamW as "
        "foreach ops over all parameters after the last all-reduce (`torch.optim.AdamW("
        "foreach=True)` after `backward()`). Gradients copied into buckets as fddp packs them.",
        "- **Not modelled**: data loading, the loss's all-reduce (none is taken), gradient "
        "clipping, stragglers, the signature check fddp settles before its first collective "
        "(one small all-reduce per step), Python overhead of fddp's FX interpreter beyond the "
        "launches.",
    ]


def _validation(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["Not run (`--validate-ranks` empty)."]
    w = workloads.WORKLOADS[args.validate_workload]
    lines = [
        f"Workload `{w.name}` of `benchmarks/workloads.py` ({rows[0]['gradient_bytes'] / MIB:.0f} "
        f"MiB of gradients, {w.per_rank} rows per rank, fddp's AdamW, default bucket cap), one "
        f"thread per rank, {args.validate_steps} timed steps after 3 warm-ups. In the same run, "
        "step by step in rotating order: fddp's step, a plain eager step on the rank's batch "
        "('local') and one all-reduce of a flat buffer of all gradients (`compare_ddp`'s "
        "`local` and `allreduce` variants); each time the slowest rank, then the median. After "
        "each step fddp's probe (`fddp._ranks._machine.measure`) runs once; the `Machine` used is "
        "the median of each figure (a single probe, as fddp takes it, is at the mercy of the "
        "load). 'replay' is `run_program` on the step's own scheduled graph (`pstep.graph()`) with "
        "fddp's per-node costs (`node_seconds`) under that `Machine`, synchronous (a CPU: "
        "dispatch, then the work); 'fddp model' is what fddp's cost model predicted for the "
        "cap it chose (from `schedule().bucket_cap`, its own single probe); 'calibrated' "
        "replays with the compute figures scaled by local measured / local predicted and the "
        "link figures by all-reduce measured / all-reduce predicted, both from this run: what "
        "is left of its error is the schedule's (overlap, waits, packing), not the machine's. "
        "The local step's CPU time (its process's CPU seconds, which waiting for a core does "
        "not add to) checks fddp's compute costs apart from the load.",
        "",
    ]
    table = []
    for r in rows:
        measured = r["fddp_ms"]

        def err(x: float | None, measured: float = measured) -> str:
            return f"{x / measured - 1:+.0%}" if x else "-"

        table.append(
            [
                r["world"],
                f"{_ms(measured)} ({_ms(r['fddp_min_ms'])})",
                _ms(r["predicted_ms"]),
                err(r["predicted_ms"]),
                _ms(r["own_ms"]) if r["own_ms"] else "-",
                err(r["own_ms"]),
                _ms(r["calibrated_ms"]),
                err(r["calibrated_ms"]),
                f"{r['local_ms'] / measured:.2f} / {r['local_ms'] / r['calibrated_ms']:.2f}",
                f"{r['cap']}, {r['buckets']}",
            ]
        )
    header = ["ranks", "fddp measured (min)", "replay", "error", "fddp model", "error"]
    header += ["calibrated", "error", "local/step measured / calibrated", "cap, buckets"]
    lines += _table(header, table)
    lines += ["", "The parts, in ms (the probe's link figures beside them):", ""]
    table = []
    for r in rows:
        m = Machine(*r["machine"])
        ring = r.get("ring_allreduce_ms")
        table.append(
            [
                r["world"],
                _ms(r["local_ms"]),
                _ms(r["local_cpu_ms"]),
                _ms(r["compute_ms"]),
                f"{r['calibration'][0]:.2f}",
                _ms(r["allreduce_ms"]),
                _ms(r["allreduce_predicted_ms"]),
                f"{r['calibration'][1]:.2f}",
                f"{_ms(ring)} ({ring / r['allreduce_ms'] - 1:+.0%})" if ring else "-",
                f"{m.latency * 1e6:.0f} us + {1 / m.seconds_per_byte / 1e9:.2f} GB/s",
                f"{r['loadavg']:.1f}",
            ]
        )
    header = ["ranks", "local measured", "its CPU time", "compute predicted", "ratio"]
    header += [
        "all-reduce measured",
        "predicted",
        "ratio",
        f"ring from {rows[0]['world']} (error)",
        "probe link",
    ]
    lines += _table([*header, "load average"], table)
    lines += [
        "",
        "Probes fddp chose its caps from (one each): "
        + "; ".join(f"{r['world']} ranks: {r['chose_with']}" for r in rows)
        + ".",
    ]
    return lines


def _published(
    results: dict[str, tuple[Analysed, list[Point], dict[str, Any]]], accelerator: Accelerator
) -> list[str]:
    lines = _table(["source", "models", "scale", "reported"], PUBLISHED)
    worlds = {p.world for _, pts, _ in results.values() for p in pts}
    n = 256 if 256 in worlds else max(worlds)
    lines += [
        "",
        "What decides efficiency in all of these is how long one all-reduce of all gradients "
        "takes against one rank's compute: with overlap, communication hides behind the "
        "backward until it is longer than the backward. This simulation's ratio (ring "
        f"bandwidth term at {n} ranks, alpha left out) and the efficiency it predicts there:",
        "",
    ]
    rows = []
    for name, (analysed, pts, info) in results.items():
        for link in sorted({p.link_gbit for p in pts}):
            comm = AllReduce("ring", 0.0, link * 1e9 / 8).seconds(n, info["total_bytes"])
            (p,) = _by(pts, link_gbit=link, algorithm="ring", world=n)
            (t,) = _by(pts, link_gbit=link, algorithm="tree", world=n)
            rows.append(
                [
                    name,
                    f"{link:g} Gbit/s",
                    f"{comm * 1e3:.0f} / {analysed.local * 1e3:.0f} ms = "
                    f"{comm / analysed.local:.2f}",
                    f"{p.fddp_eff:.2f} / {p.ddp_eff:.2f}",
                    f"{t.fddp_eff:.2f} / {t.ddp_eff:.2f}",
                ]
            )
    header = ["model", "link", "all-reduce / compute", f"ring fddp / DDP @{n}"]
    lines += _table([*header, f"tree fddp / DDP @{n}"], rows)
    return lines


def plot(points: list[Point], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    combos = sorted({(p.model, p.link_gbit) for p in points})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, alg in zip(axes, ("ring", "tree")):
        for (model, link), colour in zip(combos, colours):
            pts = sorted(
                _by(points, model=model, link_gbit=link, algorithm=alg), key=lambda p: p.world
            )
            xs = [p.world for p in pts]
            ax.plot(
                xs, [p.fddp_eff for p in pts], "-o", color=colour, label=f"{model} {link:g}G fddp"
            )
            ax.plot(
                xs,
                [p.ddp_eff for p in pts],
                "--s",
                color=colour,
                alpha=0.7,
                label=f"{model} {link:g}G DDP",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_title(f"{alg} all-reduce")
        ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (local compute / step)")
    axes[1].legend(fontsize=7, loc="lower left")
    fig.suptitle("Predicted weak-scaling efficiency, fddp (solid) vs DDP (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="from: " + ", ".join(MODELS))
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="rank counts")
    p.add_argument("--links", default=",".join(f"{x:g}" for x in LINKS_GBIT), help="Gbit/s")
    p.add_argument("--alpha-us", type=float, default=5.0, help="all-reduce latency per step")
    p.add_argument("--peak-tflops", type=float, default=312.0)
    p.add_argument("--mfu", type=float, default=0.45, help="fraction of peak for counted FLOPs")
    p.add_argument("--hbm-tbs", type=float, default=1.5, help="memory bandwidth, TB/s")
    p.add_argument("--launch-us", type=float, default=5.0, help="host time per kernel launch")
    p.add_argument(
        "--activation-bytes", type=float, default=0.5, help="forward/backward bytes per fp32 byte"
    )
    p.add_argument("--batch", type=int, help="sequences per rank (default: 8)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: 1024)")
    p.add_argument(
        "--validate-ranks", default="2,3,4", help="gloo worlds to measure on this CPU ('' skips)"
    )
    p.add_argument("--validate-workload", default="mlp", choices=sorted(workloads.WORKLOADS))
    p.add_argument("--validate-steps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc)
    accelerator = Accelerator(
        peak_flops=args.peak_tflops * 1e12,
        mfu=args.mfu,
        memory_bandwidth=args.hbm_tbs * 1e12,
        launch_s=args.launch_us * 1e-6,
        activation_bytes=args.activation_bytes,
    )
    worlds = [int(n) for n in args.worlds.split(",")]
    links = args.link_list = [float(x) for x in args.links.split(",")]
    results = {}
    for name in args.models.split(","):
        spec = MODELS[name]
        spec = dataclasses.replace(spec, batch=args.batch or spec.batch, seq=args.seq or spec.seq)
        print(f"{spec.title}: capturing", flush=True)
        analysed = analyse(capture_model(spec), accelerator)
        print(
            f"  {analysed.captured.params / 1e6:.1f}M params, captured in "
            f"{analysed.captured.seconds:.1f} s; local step {analysed.local * 1e3:.1f} ms",
            flush=True,
        )
        points, info = simulate(analysed, accelerator, links, worlds, args.alpha_us * 1e-6)
        for p in points:
            if p.world in (worlds[0], 256, worlds[-1]):
                print(
                    f"  {p.link_gbit:g}G {p.algorithm} N={p.world}: fddp {p.fddp_ms:.1f} ms "
                    f"({p.fddp_eff:.2f}, cap {_mib(p.fddp_cap)} MiB), DDP {p.ddp_ms:.1f} ms "
                    f"({p.ddp_eff:.2f})",
                    flush=True,
                )
        results[name] = (analysed, points, info)
    validation = []
    if args.validate_ranks:
        print("validation on this CPU:", flush=True)
        ranks = [int(n) for n in args.validate_ranks.split(",")]
        validation = validate(ranks, args.validate_workload, args.validate_steps)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{started:%Y%m%dT%H%M%S}_scaling_simulation")
    plot_name = None
    if not args.no_plot:
        plot([p for _, pts, _ in results.values() for p in pts], stem + ".png")
        plot_name = os.path.basename(stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(report(args, accelerator, results, validation, started, plot_name))
    print(f"wrote {stem}.md" + ("" if args.no_plot else " and .png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
