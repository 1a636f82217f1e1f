"""Rematerialisation: a region's values its backward needs are recomputed there, not kept."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch._prims import rng_prims
from torch.fx import traceback as fx_traceback

from fddp._base import _model_calls
from fddp._base._annotations import FORWARD, REMAT_BLOCK, REMAT_NAME, REMAT_RECOMPUTED, REMAT_REGION
from fddp._base._errors import UsageValueError
from fddp._compiler._capture import _repeated
from fddp._compiler._graph import Storage, is_collective, is_wait, mutated_inputs, storage
from fddp._compiler._passes import _cost, _generator_replay
from fddp._func import _remat
from fddp._func._remat import Policy
from fddp._ranks import _machine

_aten = torch.ops.aten
# matrix products whose operands carry no batch dimension (JAX's dot_general without batch dims)
_DOTS = {_aten.mm.default, _aten.addmm.default, _aten.linear.default}
_BATCHED_DOTS = {
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
_BATCH_NORM = _aten.native_batch_norm.default
_REGION_KEYS = (FORWARD, REMAT_REGION, REMAT_BLOCK)  # what a recomputed copy does not carry
_SAVE_RNG = rng_prims.run_and_save_rng_state
_REPLAY_RNG = rng_prims.run_with_rng_state
# how a copy replays a random op, by the generator it draws from: its device's default
# generator, or an explicit torch.Generator (a graph constant, passed to the replay)
_REPLAYS = {_REPLAY_RNG: 1, _generator_replay.draw_with_state: 2}  # the op's argument index


@dataclasses.dataclass(frozen=True)
class SavedValue:
    """A value kept from the forward pass for the backward: ``kind`` is ``"kept"`` (the region
    computed it) or ``"input"`` (the region read it; its recomputation reads it again)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str


@dataclasses.dataclass(frozen=True)
class RegionPlan:
    """One remat region: where it comes from, its policy, what it keeps and recomputes."""

    index: int
    source: str  # "fddp.remat", "block" (a repeated block) or "forward" (a whole forward pass)
    policy: str
    saved: tuple[SavedValue, ...]
    recomputed: tuple[str, ...]  # the recomputed ops, in order

    @property
    def saved_bytes(self) -> int:
        return sum(v.nbytes for v in self.saved)


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What rematerialisation did to the step: its regions, and the bytes the forward passes
    keep for the backward (each storage once; the step's arguments not counted) with and
    without it. ``random``: how a recomputed random op gets its numbers again."""

    policy: str
    regions: tuple[RegionPlan, ...]
    saved_bytes: int
    saved_bytes_without: int
    random: str

    def __str__(self) -> str:
        mib = 2**20
        rows = [
            f"remat ({self.policy}): saved for backward {self.saved_bytes / mib:.3f} MiB, "
            f"{self.saved_bytes_without / mib:.3f} MiB without remat; "
            f"{len(self.regions)} region{'s' * (len(self.regions) != 1)}; random ops "
            f"{self.random}"
        ]
        for r in self.regions:
            ops = collections.Counter(self._short(op) for op in r.recomputed)
            common = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in ops.most_common(6))
            more = f" (+{len(ops) - 6} kinds)" if len(ops) > 6 else ""
            rows.append(
                f"  region {r.index} ({r.source}, {r.policy}): keeps {len(r.saved)} values, "
                f"{r.saved_bytes / mib:.3f} MiB; recomputes {len(r.recomputed)} ops: "
                f"{common}{more}"
            )
        return "\n".join(rows)

    def table(self) -> str:
        """Every region's saved values, one a line: value, kind, shape, dtype, bytes."""
        rows = []
        for r in self.regions:
            rows.append(f"region {r.index} ({r.source}, {r.policy})")
            for v in r.saved:
                shape = "x".join(map(str, v.shape)) or "scalar"
                rows.append(f"  {v.name:<28} {v.kind:<6} {shape:<18} {v.dtype:<9} {v.nbytes:>12}")
            rows.append(f"  recomputed: {', '.join(self._short(op) for op in r.recomputed)}")
        return "\n".join(rows)

    @staticmethod
    def _short(op: str) -> str:
        return op.removeprefix("aten.").removesuffix(".default")


def _custom(node: fx.Node) -> dict[str, Any]:
    return node.meta.get("custom") or {}


def _is_forward(node: fx.Node) -> bool:
    return bool(_custom(node).get(FORWARD))


def _tensor(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def forward_runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """The forward passes: runs of nodes a differentiated function emitted, each ended by the
    first node of its backward (a node outside them that reads one of them)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    members: set[fx.Node] = set()
    for node in graph.nodes:
        if _is_forward(node):
            current.append(node)
            members.add(node)
        elif current and any(a in members for a in node.all_input_nodes):
            runs.append(current)
            current, members = [], set()
    if current:
        runs.append(current)
    return runs


def _run_ends(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    return {n: run[-1] for run in forward_runs(graph) for n in run}


def _writers(graph: fx.Graph) -> dict[Storage, list[fx.Node]]:
    """The nodes that write each storage in place, in graph order."""
    found: dict[Storage, list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        for written in mutated_inputs(node):
            if (t := _tensor(written)) is not None:
                found[storage(t)].append(node)
    return found


def _read_after_a_write(
    node: fx.Node, recompute: set[fx.Node], until: fx.Node, writers: dict[Storage, list[fx.Node]]
) -> bool:
    """Whether a value ``node`` reads from outside ``recompute`` is written in place after
    ``node`` ran and before ``until`` (where its copy would run): the copy would read another
    value than the forward did."""
    for a in node.all_input_nodes:
        t = _tensor(a)
        if a in recompute or t is None:
            continue
        if any(node < w < until for w in writers.get(storage(t), ())):
            return True
    return False


def _late_users(node: fx.Node, end: fx.Node) -> list[fx.Node]:
    """Users of ``node`` after its forward pass ended, outside forward passes: its backward."""
    return [u for u in node.users if u > end and not _is_forward(u)]


def saved_values(graph: fx.Graph) -> dict[int, tuple[fx.Node, int]]:
    """The storages the forward passes keep for later (their first node, their bytes),
    the step's arguments' storages aside."""
    arguments = {
        storage(t) for n in graph.nodes if n.op == "placeholder" if (t := _tensor(n)) is not None
    }
    found: dict[int, tuple[fx.Node, int]] = {}
    for run in forward_runs(graph):
        end = run[-1]
        for node in run:
            t = _tensor(node)
            if t is None or not _late_users(node, end):
                continue
            key = storage(t)
            if key not in arguments and key not in found:
                found[key] = (node, _storage_bytes(t))
    return found


def saved_bytes(graph: fx.Graph) -> int:
    """Bytes the forward passes of ``graph`` keep for their backward (see :func:`saved_values`)."""
    return sum(b for _, b in saved_values(graph).values())


# ---- regions ----


@dataclasses.dataclass
class _Region:
    nodes: list[fx.Node]
    policy: Policy
    source: str


def _regions(graph: fx.Graph, step_policy: Policy | None) -> list[_Region]:
    """The step's regions in graph order: those ``fddp.remat`` marked (their own policy, else
    the step's, else nothing saveable); without any, the repeated blocks, else each forward
    pass, under the step's policy."""
    forward = [n for n in graph.nodes if _is_forward(n)]
    marked: dict[Any, list[fx.Node]] = {}
    policies: dict[Any, Policy | None] = {}
    for node in forward:
        tag = _custom(node).get(REMAT_REGION)
        if tag is not None:
            token, fields = tag
            marked.setdefault(token, []).append(node)
            policies[token] = None if fields is None else Policy(*fields)
    if marked:
        return [
            _Region(nodes, policies[t] or step_policy or _remat.nothing_saveable, "fddp.remat")
            for t, nodes in marked.items()
        ]
    if step_policy is None:
        return []
    blocks: dict[Any, list[fx.Node]] = {}
    for node in forward:
        token = _custom(node).get(REMAT_BLOCK)
        if token is not None:
            blocks.setdefault(token, []).append(node)
    if blocks:
        return [_Region(nodes, step_policy, "block") for nodes in blocks.values()]
    return [_Region(run, step_policy, "forward") for run in forward_runs(graph)]


def _strip_names(graph: fx.Graph) -> dict[fx.Node, set[str]]:
    """Remove ``fddp.remat_name``'s markers; the names of the values they marked."""
    names: dict[fx.Node, set[str]] = collections.defaultdict(set)
    for node in list(graph.nodes):
        name = _custom(node).get(REMAT_NAME)
        if name is None or node.target is not _aten.alias.default:
            continue
        source = node.args[0]
        assert isinstance(source, fx.Node)
        names[source].add(name)
        node.replace_all_uses_with(source)
        graph.erase_node(node)
    return names


# ---- what a region keeps and what it recomputes ----


def _statistics_only(node: fx.Node) -> bool:
    """Training-mode batch norm: it writes only the running statistics, which its recomputation
    leaves alone (``_native_batch_norm_legit.no_stats`` computes the same outputs)."""
    return node.target is _BATCH_NORM and bool(node.args[5])


def _is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def _recomputable(node: fx.Node, replay_rng: bool) -> bool:
    """Whether copying ``node`` into the backward computes the same value again."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return False
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and _recomputable(parent, replay_rng)
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if _is_random(node):
        return replay_rng and not mutated_inputs(node)
    return True


def _saveable(node: fx.Node, policy: Policy, names: dict[fx.Node, set[str]]) -> bool:
    """Whether ``policy`` keeps ``node``'s value (a getitem takes its producer's op)."""
    kind = policy.kind
    if kind == "everything_saveable":
        return True
    if kind in ("save_only_these_names", "save_any_names_but_these"):
        own = names.get(node, set())
        if kind == "save_only_these_names":
            return bool(own & set(policy.names))
        return bool(own) and not own & set(policy.names)
    producer = node.args[0] if node.target is operator.getitem else node
    target = producer.target if isinstance(producer, fx.Node) else None
    if kind == "dots_saveable":
        return target in _DOTS or target in _BATCHED_DOTS
    if kind == "dots_with_no_batch_dims_saveable":
        return target in _DOTS
    return False  # nothing_saveable; memory_budget decides by its own choice


@dataclasses.dataclass
class _Choice:
    """A region's decision: the values it keeps, the nodes it recomputes, the values whose
    later uses read the recomputed copies instead."""

    kept: set[fx.Node]
    recompute: list[fx.Node]
    needed: list[fx.Node]


def _choose(
    region: _Region,
    ends: dict[fx.Node, fx.Node],
    saveable: Callable[[fx.Node], bool],
    replay_rng: bool,
    graph_writers: dict[Storage, list[fx.Node]],
) -> _Choice:
    members = set(region.nodes)
    writers: dict[int, list[fx.Node]] = collections.defaultdict(list)
    for node in region.nodes:
        for written in mutated_inputs(node):
            if (t := _tensor(written)) is not None:
                writers[storage(t)].append(node)
    kept: set[fx.Node] = set()
    for node in region.nodes:
        users = node.users
        leaves = any(u not in members and (_is_forward(u) or u.op == "output") for u in users)
        if leaves or saveable(node) or not _recomputable(node, replay_rng):
            kept.add(node)
    forced: set[fx.Node] = set()  # recomputed because the forward wrote a recomputed value
    while True:
        needed = [n for n in region.nodes if n not in kept and _late_users(n, ends[n])]
        recompute: set[fx.Node] = set()
        pending = needed + [n for n in forced if n not in kept]
        while pending:
            node = pending.pop()
            if node in recompute:
                continue
            recompute.add(node)
            pending += [a for a in node.all_input_nodes if a in members and a not in kept]
        grown = False
        until = min((u for n in needed for u in _late_users(n, ends[n])), default=None)
        for node in recompute:
            parent = node.args[0] if node.target is operator.getitem else None
            if until is not None and _read_after_a_write(node, recompute, until, graph_writers):
                kept.add(node)
                grown = True
                continue
            # a write into a value the forward keeps (or that is not the region's) would happen
            # twice; a getitem of a kept tuple would keep all of it alive
            writes = [] if _statistics_only(node) else mutated_inputs(node)
            if any(w not in recompute for w in writes) or parent in kept:
                kept.add(node)
                grown = True
                continue
            if (t := _tensor(node)) is not None:
                for writer in writers.get(storage(t), []):
                    if writer > node and writer not in recompute:
                        if writer in kept:
                            kept.add(node)
                        else:
                            forced.add(writer)
                        grown = True
        if not grown:
            order = sorted(recompute)
            return _Choice(kept, order, [n for n in order if n in needed])


def _rng_state_value(node: fx.Node) -> torch.Tensor:
    """A fake tensor laid out as the generator state the random op ``node``'s save returns
    (``run_and_save_rng_state``'s, or an explicit generator's ``get_state()``)."""
    val = node.meta["val"]
    first = val[0] if isinstance(val, (list, tuple)) else val
    device = first.device
    generator = _generator_replay.generator_argument(node)
    if generator is not None:
        numel = _generator_replay.generator_of(generator).get_state().numel()
        device = torch.device("cpu")  # get_state() is a CPU tensor for every device
    elif device.type == "cuda":
        numel = torch.cuda.get_rng_state(device).numel()
    else:
        numel = torch.get_rng_state().numel()
    with first.fake_mode:
        return torch.empty(numel, dtype=torch.uint8, device=device)


def _rewrite(
    graph: fx.Graph, choice: _Choice, index: int, ends: dict[fx.Node, fx.Node]
) -> dict[fx.Node, fx.Node]:
    """Copy ``choice.recompute`` just before the first later use of what it recomputes and
    point those uses at the copies; a random op saves its generator state in the forward and
    replays it. The copies, by the node each recomputes."""
    if not choice.needed:
        return {}
    late = {n: _late_users(n, ends[n]) for n in choice.needed}
    anchor = min(u for users in late.values() for u in users)
    randoms = {n: _save_rng_state(graph, n) for n in choice.recompute if _is_random(n)}
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(anchor):
        for node in choice.recompute:
            if node in randoms:
                replay, leading, args, kwargs = randoms[node]
                args = fx.node.map_arg(args, lambda a: copies.get(a, a))
                kwargs = fx.node.map_arg(kwargs, lambda a: copies.get(a, a))
                copy = graph.call_function(replay, (*leading, *args), kwargs)
            elif _statistics_only(node):
                x, weight, bias, _, _, _, momentum, eps = fx.node.map_arg(
                    node.args, lambda a: copies.get(a, a)
                )
                copy = graph.call_function(
                    _aten._native_batch_norm_legit.no_stats, (x, weight, bias, True, momentum, eps)
                )
            else:
                copy = graph.node_copy(node, lambda a: copies.get(a, a))
            copy.meta = {k: v for k, v in node.meta.items() if k != "custom"}
            custom = {k: v for k, v in _custom(node).items() if k not in _REGION_KEYS}
            copy.meta["custom"] = {**custom, REMAT_RECOMPUTED: index}
            copies[node] = copy
    for node, users in late.items():
        for user in users:
            user.replace_input_with(node, copies[node])
    return copies


def _save_rng_state(graph: fx.Graph, node: fx.Node) -> tuple[Callable, tuple, tuple, dict]:
    """Run the random op ``node`` through a save of the generator state it draws from in the
    forward (``run_and_save_rng_state`` for its device's default generator,
    ``draw_saving_state`` for an explicit one), ``node`` becoming the getitem of its result.
    How to replay it: the replay, its leading arguments (the state node, the generator node,
    the op), the op's arguments and keyword arguments."""
    op, args, kwargs = node.target, node.args, dict(node.kwargs)
    assert isinstance(op, torch._ops.OpOverload)
    generator = _generator_replay.generator_argument(node)
    lead: tuple[fx.Node, ...] = () if generator is None else (generator,)
    save: Callable[..., Any] = _SAVE_RNG
    replay: Callable[..., Any] = _REPLAY_RNG
    if generator is not None:
        save, replay = _generator_replay.draw_saving_state, _generator_replay.draw_with_state
    with graph.inserting_before(node):
        both = graph.call_function(save, (*lead, op, *args), kwargs)
        state = graph.call_function(operator.getitem, (both, 0))
    state_val = _rng_state_value(node)
    both.meta = {**node.meta, "val": (state_val, node.meta["val"])}
    state.meta = {**node.meta, "val": state_val}
    node.target, node.args, node.kwargs = operator.getitem, (both, 1), {}
    return replay, (state, *lead, op), args, kwargs


# ---- the pass ----


def rematerialise(
    graph: fx.Graph,
    step_policy: Policy | None,
    *,
    replay_rng: bool,
    machine: _machine.Machine = _machine.DEFAULT,
) -> RematPlan | None:
    """Recompute in the backward what the regions' policies do not keep; the plan, or None
    when the step has no region (the graph is then unchanged but for ``remat_name`` markers).

    ``replay_rng``: a recomputed random op replays the generator state the forward used
    (``run_and_save_rng_state``/``run_with_rng_state``); without it (Inductor, which draws
    random numbers its own way) random ops' outputs are kept. ``machine``: the figures a
    ``memory_budget`` weighs a recompute's seconds with (``_cost``'s model).
    """
    names = _strip_names(graph)
    regions = _regions(graph, step_policy)
    _check_names(regions, names)
    if not regions:
        return None
    without = saved_bytes(graph)
    ends = _run_ends(graph)
    writers = _writers(graph)
    budget = _budget_nodes(
        graph, regions, ends, names, step_policy, without, replay_rng, writers, machine
    )
    choices = []
    for region in regions:
        if region.policy.kind == "memory_budget":
            saveable: Callable[[fx.Node], bool] = lambda n: n not in budget
        else:
            saveable = functools.partial(_saveable, policy=region.policy, names=names)
        choices.append(_choose(region, ends, saveable, replay_rng, writers))
    described = []
    for index, (region, choice) in enumerate(zip(regions, choices)):
        copies = _rewrite(graph, choice, index, ends)
        described.append(_describe(graph, region, index, copies, ends))
    graph.lint()
    return RematPlan(
        policy=repr(step_policy) if step_policy is not None else "per region",
        regions=tuple(described),
        saved_bytes=saved_bytes(graph),
        saved_bytes_without=without,
        random="replay the generator state" if replay_rng else "keep their outputs",
    )


def _describe(
    graph: fx.Graph,
    region: _Region,
    index: int,
    copies: dict[fx.Node, fx.Node],
    ends: dict[fx.Node, fx.Node],
) -> RegionPlan:
    arguments = {
        storage(t) for n in graph.nodes if n.op == "placeholder" if (t := _tensor(n)) is not None
    }
    members = set(region.nodes)
    found: dict[int, SavedValue] = {}

    def add(node: fx.Node, kind: str) -> None:
        t = _tensor(node)
        if t is None or storage(t) in arguments or storage(t) in found:
            return
        found[storage(t)] = SavedValue(
            node.name, tuple(t.shape), str(t.dtype).removeprefix("torch."), _storage_bytes(t), kind
        )

    recomputed = set(copies.values())
    for node in region.nodes:
        if _late_users(node, ends[node]):
            add(node, "kept")
    states = {c.args[0] for c in copies.values() if c.target in _REPLAYS}
    for copy in copies.values():
        for a in copy.all_input_nodes:
            if a not in recomputed:
                add(a, "kept" if a in members or a in states else "input")
    ops = tuple(
        str(c.args[_REPLAYS[c.target]]) if c.target in _REPLAYS else str(c.target)
        for c in copies.values()
        if c.target is not operator.getitem
    )
    return RegionPlan(index, region.source, repr(region.policy), tuple(found.values()), ops)


def _check_names(regions: list[_Region], names: dict[fx.Node, set[str]]) -> None:
    """A name policy must name values its regions compute."""
    everywhere = set().union(*names.values()) if names else set()
    for region in regions:
        policy = region.policy
        if policy.kind not in ("save_only_these_names", "save_any_names_but_these"):
            continue
        inside = set().union(*(names.get(n, set()) for n in region.nodes))
        for name in policy.names:
            if name in inside or any(name in names.get(n, ()) for r in regions for n in r.nodes):
                continue
            if name in everywhere:
                raise UsageValueError(
                    f"remat policy {policy!r}: the value named {name!r} is computed outside "
                    "every remat region, so no region can keep it. Call fddp.remat_name(x, "
                    f"{name!r}) inside the function fddp.remat wraps (or inside the "
                    "differentiated function, for the step's own regions)."
                )
            known = ", ".join(sorted(map(repr, everywhere))) or "none"
            raise UsageValueError(
                f"remat policy {policy!r}: no value is named {name!r} (names in the step: "
                f"{known}). Name it with fddp.remat_name(x, {name!r}) inside the region, or "
                "fix the policy's names."
            )


# ---- memory_budget: recompute the cheapest bytes first until the rest fits ----


def _budget_nodes(
    graph: fx.Graph,
    regions: list[_Region],
    ends: dict[fx.Node, fx.Node],
    names: dict[fx.Node, set[str]],
    step_policy: Policy | None,
    without: int,
    replay_rng: bool,
    writers: dict[Storage, list[fx.Node]],
    machine: _machine.Machine,
) -> set[fx.Node]:
    """The nodes ``memory_budget`` regions recompute: whole storages, cheapest recompute per
    byte first, the fewest that bring the step's saved bytes within the budget."""
    budgeted = [r for r in regions if r.policy.kind == "memory_budget"]
    if not budgeted:
        return set()
    policy = budgeted[0].policy
    if any(r.policy != policy for r in budgeted):
        raise UsageValueError(
            f"remat: regions with different memory budgets ({policy!r} and "
            f"{next(r.policy for r in budgeted if r.policy != policy)!r}); a budget is the "
            "step's: give the step remat=memory_budget(...) and leave the regions' policy "
            "unset, or give them one budget."
        )
    target = policy.budget_bytes if policy.fraction is None else policy.fraction * without
    assert target is not None
    by_storage: dict[int, list[fx.Node]] = collections.defaultdict(list)
    for region in budgeted:
        for node in region.nodes:
            t = _tensor(node)
            if t is not None and _recomputable(node, replay_rng):
                by_storage[storage(t)].append(node)
    late = {key for key, nodes in by_storage.items() if any(_late_users(n, ends[n]) for n in nodes)}
    candidates = {n for key in late for n in by_storage[key]}
    units = []
    for key in late:
        nodes = by_storage[key]
        cost = _cost.seconds_of(nodes, machine)
        size = max(_storage_bytes(_tensor(n)) for n in nodes)  # type: ignore[arg-type]
        units.append((cost / max(size, 1), min(nodes), nodes, size))
    units.sort(key=lambda u: (u[0], u[1]))
    predict = _Prediction(graph, regions, ends, names, candidates, replay_rng, writers)

    def saved_with(k: int, skipped: frozenset[int] = frozenset()) -> int:
        return predict.saved_bytes(
            {n for i, unit in enumerate(units[:k]) if i not in skipped for n in unit[2]}
        )

    low, high = 0, len(units)
    if saved_with(high) > target:
        floor = saved_with(high)
        raise UsageValueError(
            f"remat policy {policy!r}: the budget ({int(target)} bytes) is below what the "
            f"step must keep even when its regions recompute everything they can ({floor} "
            f"bytes: the regions' inputs and what cannot be recomputed; {without} bytes "
            "without remat). Raise the budget, or mark smaller regions with fddp.remat."
        )
    while low < high:
        middle = (low + high) // 2
        if saved_with(middle) <= target:
            high = middle
        else:
            low = middle + 1
    # the last one chosen may have freed more than needed: keep again, dearest first, those
    # the budget still has room for
    skipped: frozenset[int] = frozenset()
    room = target - saved_with(low)
    for i in reversed(range(low)):
        if units[i][3] <= room and saved_with(low, skipped | {i}) <= target:
            skipped |= {i}
            room = target - saved_with(low, skipped)
    chosen = {n for i, unit in enumerate(units[:low]) if i not in skipped for n in unit[2]}
    return chosen | ({n for r in budgeted for n in r.nodes} - candidates)


class _Prediction:
    """:func:`saved_bytes` of the graph a budget's choice would make, without making it:
    each region's part computed once per choice within it."""

    def __init__(
        self,
        graph: fx.Graph,
        regions: list[_Region],
        ends: dict[fx.Node, fx.Node],
        names: dict[fx.Node, set[str]],
        candidates: set[fx.Node],
        replay_rng: bool,
        writers: dict[Storage, list[fx.Node]],
    ) -> None:
        self.regions, self.ends, self.replay_rng = regions, ends, replay_rng
        self.writers = writers
        self.candidates = candidates
        self.arguments = {
            storage(t)
            for n in graph.nodes
            if n.op == "placeholder"
            if (t := _tensor(n)) is not None
        }
        members = {n for r in regions for n in r.nodes}
        self.fixed: dict[Any, int] = {}  # what forward nodes outside budget regions keep
        for run in forward_runs(graph):
            for node in run:
                t = _tensor(node)
                if node not in members and t is not None and _late_users(node, run[-1]):
                    self.fixed[storage(t)] = _storage_bytes(t)
        for region in regions:
            if region.policy.kind != "memory_budget":
                saveable = functools.partial(_saveable, policy=region.policy, names=names)
                choice = _choose(region, ends, saveable, replay_rng, writers)
                self.fixed.update(self._kept(choice, region))
        self.memo: dict[tuple[int, frozenset[fx.Node]], dict[Any, int]] = {}

    def _kept(self, choice: _Choice, region: _Region) -> dict[Any, int]:
        found: dict[Any, int] = {}
        needed = set(choice.needed)
        recompute = set(choice.recompute)
        for node in region.nodes:
            t = _tensor(node)
            if t is not None and node not in needed and _late_users(node, self.ends[node]):
                found[storage(t)] = _storage_bytes(t)
        for node in choice.recompute:
            if _is_random(node):
                found[("generator state", node)] = _storage_bytes(_rng_state_value(node))
            for a in node.all_input_nodes:
                t = _tensor(a)
                if t is not None and a not in recompute:
                    found[storage(t)] = _storage_bytes(t)
        return found

    def saved_bytes(self, chosen: set[fx.Node]) -> int:
        found = dict(self.fixed)
        for i, region in enumerate(self.regions):
            if region.policy.kind != "memory_budget":
                continue
            mine = frozenset(n for n in region.nodes if n in chosen)
            if (i, mine) not in self.memo:
                keep = self.candidates - mine
                choice = _choose(
                    region, self.ends, keep.__contains__, self.replay_rng, self.writers
                )
                self.memo[i, mine] = self._kept(choice, region)
            found.update(self.memo[i, mine])
        return sum(b for k, b in found.items() if k not in self.arguments)


# ---- the step policy's default regions: the model's repeated blocks ----


def marking_blocks(step_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``step_fn`` whose calls mark each call of a model's repeated blocks (children of a
    ``ModuleList`` or ``Sequential`` with an identical sibling) as a region for the step's
    policy; the models are those ``fddp.functional`` runs."""

    @functools.wraps(step_fn)
    def step(*args: Any) -> Any:
        if torch.compiler.is_compiling():  # Dynamo's capture: each forward pass is a region
            return step_fn(*args)
        with _model_calls.watching(functools.partial(_marking, _model_calls._HOOK.get())):
            return step_fn(*args)

    return step


@contextlib.contextmanager
def _marking(outer: _model_calls.Hook | None, model: nn.Module) -> Iterator[None]:
    blocks = {id(b) for b in _repeated_blocks(model)}
    with outer(model) if outer is not None else contextlib.nullcontext():
        if not blocks:
            yield
            return
        call = nn.Module.__call__

        def marked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if id(self) not in blocks:
                return call(self, *args, **kwargs)
            with fx_traceback.annotate({REMAT_BLOCK: next(_remat._CALLS)}):
                return call(self, *args, **kwargs)

        nn.Module.__call__ = marked  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.__call__ = call  # type: ignore[method-assign]


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    found = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds: dict[Any, list[nn.Module]] = collections.defaultdict(list)
        for child in module.children():
            key = _repeated._structure(child)
            if key is not None:
                kinds[key].append(child)
        found += [c for group in kinds.values() if len(group) >= 2 for c in group]
    return found
