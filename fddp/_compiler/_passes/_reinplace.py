"""Reinplace pass: run pointwise ops in place when the buffer they read is dead afterwards."""

from __future__ import annotations

import itertools
import operator
from typing import cast

import torch
from torch import fx

from fddp._compiler._graph import Storage, is_collective, is_wait, replace_uses, storage

aten = torch.ops.aten

_POINTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "lerp",
    "addcmul",
    "addcdiv",
    "neg",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "exp",
    "abs",
    "sign",
    "pow",
    "clamp",
    "clamp_min",
    "clamp_max",
    "sigmoid",
    "tanh",
    "relu",
    "maximum",
    "minimum",
}


def _inplace_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    name = op._opname
    base = name.removeprefix("_foreach_")
    if base not in _POINTWISE:
        return None
    packet = getattr(aten, name + "_", None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


class _Storages:
    """Which nodes hold (views of) each storage, and the last position any of them is read."""

    def __init__(self, graph: fx.Graph) -> None:
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.last_read: dict[Storage, int] = {}
        self.of_node: dict[fx.Node, list[Storage]] = {}
        for node in graph.nodes:
            keys = [storage(t) for t in _tensors(node.meta.get("val"))]
            self.of_node[node] = keys
            last = max((self.pos[u] for u in node.users), default=self.pos[node])
            for key in keys:
                self.last_read[key] = max(self.last_read.get(key, -1), last)

    def dead_after(self, node: fx.Node, arg: fx.Node) -> bool:
        keys = self.of_node.get(arg, [])
        return bool(keys) and all(self.last_read[k] <= self.pos[node] for k in keys)

    def alias(self, node: fx.Node, like: fx.Node) -> None:
        """``node`` now holds ``like``'s storage: its readers read that storage."""
        self.of_node[node] = self.of_node[like]
        self.extend_reads(node)

    def extend_reads(self, node: fx.Node) -> None:
        last = max((self.pos[u] for u in node.users), default=self.pos[node])
        for key in self.of_node[node]:
            self.last_read[key] = max(self.last_read[key], last)


def _protected(graph: fx.Graph, donated: set[fx.Node]) -> set[Storage]:
    """Storages that must keep their contents: inputs not donated, constants, outputs, comms."""
    keep: set[Storage] = set()
    for node in graph.nodes:
        vals = _tensors(node.meta.get("val"))
        if (node.op in ("placeholder", "get_attr") and node not in donated) or is_collective(node):
            keep.update(storage(t) for t in vals)
        if is_wait(node) or is_collective(node):
            for arg in node.all_input_nodes:
                keep.update(storage(t) for t in _tensors(arg.meta.get("val")))
        if node.op == "output":
            for arg in node.all_input_nodes:
                keep.update(storage(t) for t in _tensors(arg.meta.get("val")))
    return keep


def _same_layout(out: object, self_val: object) -> bool:
    outs, selfs = _tensors(out), _tensors(self_val)
    return len(outs) == len(selfs) > 0 and all(
        o.shape == s.shape and o.dtype == s.dtype and o.device == s.device
        for o, s in zip(outs, selfs)
    )


def _dense(t: torch.Tensor) -> bool:
    """Some permutation of ``t``'s dims is contiguous: no element is stored twice, no gaps."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _disjoint(tensors: list[torch.Tensor]) -> bool:
    """Each tensor is dense without self-overlap, and no two share memory (disjoint slices of
    one storage are fine)."""
    spans: dict[Storage, list[tuple[int | torch.SymInt, int | torch.SymInt]]] = {}
    for t in tensors:
        if not _dense(t):
            return False
        if not t.is_contiguous():
            return len(tensors) == 1
        start = t.storage_offset()
        spans.setdefault(storage(t), []).append((start, start + t.numel()))
    for ranges in spans.values():
        ranges.sort()
        if any(a_end > b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges)):
            return False
    return True


def reinplace(
    graph: fx.Graph, donated: set[fx.Node], *, donated_writable_after: fx.Node | None = None
) -> int:
    """Rewrite eligible pointwise ops to their in-place form; returns how many were rewritten.

    Donated placeholders count as dead after their last read, so the optimizer's final
    ``params + updates`` (and the moment updates) land in the donated buffers; only ops after
    ``donated_writable_after`` (when given) may write into them.
    """
    storages = _Storages(graph)
    protected = _protected(graph, donated)
    after = donated_writable_after
    first_write = storages.pos[after] if after is not None else -1
    donated_storages = {k for n in donated for k in storages.of_node.get(n, [])}
    rewritten = 0
    for node in list(graph.nodes):
        op = node.target if node.op == "call_function" else None
        inplace = _inplace_variant(op) if isinstance(op, torch._ops.OpOverload) else None
        if inplace is None or not node.args:
            continue
        selfs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        if not all(isinstance(s, fx.Node) for s in selfs) or len(set(selfs)) != len(selfs):
            continue
        if not _same_layout(node.meta.get("val"), [s.meta.get("val") for s in selfs]):
            continue
        keys = [k for s in selfs for k in storages.of_node.get(s, [])]
        if any(k in protected for k in keys) or not _disjoint([s.meta["val"] for s in selfs]):
            continue
        if storages.pos[node] < first_write and any(k in donated_storages for k in keys):
            continue
        if not all(storages.dead_after(node, s) for s in selfs):
            continue
        node.target = inplace
        if isinstance(node.args[0], (list, tuple)):
            assert all(user.target is operator.getitem for user in node.users)
            sources = {user: selfs[cast(int, user.args[1])] for user in node.users}
            replace_uses(sources)
            for user, source in sources.items():
                graph.erase_node(user)
                storages.extend_reads(source)
            node.meta["val"] = None
        else:
            storages.alias(node, selfs[0])
            node.meta["val"] = selfs[0].meta["val"]
        rewritten += 1
    return rewritten
