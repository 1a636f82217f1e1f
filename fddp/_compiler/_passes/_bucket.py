"""Bucket pass: merge the per-leaf all-reduces into one all-reduce per flat bucket."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._prims_common import make_contiguous_strides_for

from fddp._base._annotations import BUCKET, BUCKET_LEAVES, EXACT_SUM, LEAF_PATH
from fddp._collectives._bucket_policy import pack
from fddp._compiler._capture._quick_record import view_value
from fddp._compiler._graph import (
    ALL_REDUCE,
    ALL_REDUCE_INPLACE,
    WAIT,
    add_writes,
    in_place_writes,
    is_collective,
    is_view,
    nbytes,
    positions,
    ready_node,
    replace_uses,
    returned_argument,
    value,
)

aten = torch.ops.aten


class Reduction(NamedTuple):
    """What bucketing reads of a per-leaf all-reduce: where its input is ready and its result
    first needed, what it may share a bucket with, its bytes. Plain values (see
    ``_cost.Profile``)."""

    ready: int
    first_use: int
    key: tuple
    nbytes: int

    @classmethod
    def of(cls, member: Member) -> Reduction:
        return cls(member.ready, member.first_use, tuple(map(str, member.key)), member.nbytes)


@dataclasses.dataclass
class Member:
    """One per-leaf all-reduce: its input, its result, and where it is ready and first needed."""

    collective: fx.Node
    wait: fx.Node
    source: fx.Node
    ready: int
    first_use: int
    key: tuple
    path: str
    nbytes: int


@dataclasses.dataclass
class BucketNodes:
    """The nodes that one bucket added to the graph."""

    index: int
    members: list[Member]
    nbytes: int
    launch: fx.Node
    wait: fx.Node


def find_members(graph: fx.Graph) -> list[Member]:
    """Every all-reduce whose result is consumed only through one wait, in ready order."""
    pos = positions(graph)
    writes = in_place_writes(graph)
    members = []
    for node in graph.nodes:
        if node.target is not ALL_REDUCE or len(node.users) != 1:
            continue
        (wait,) = node.users
        if wait.target is not WAIT or not wait.users:
            continue
        ready = pos[ready_node(writes, node.args[0], node)]
        first_use = min(pos[u] for u in wait.users)
        source, op, group = node.args
        val = value(source)
        path = node.meta.get("custom", {}).get(LEAF_PATH, source.name)
        key = (group, op, val.dtype, val.device)
        members.append(Member(node, wait, source, ready, first_use, key, path, nbytes(source)))
    members.sort(key=lambda m: m.ready)
    return members


Bucketed = TypeVar("Bucketed", Member, Reduction)


def total_bytes(members: Sequence[Member | Reduction]) -> int:
    """The bytes of the gradients ``members`` reduce."""
    return sum(m.nbytes for m in members)


def assign(members: Sequence[Bucketed], cap: int, first_cap: int) -> list[list[Bucketed]]:
    """Group members (sorted by ready position) into buckets; pure, no graph changes."""
    packed = pack(
        [m.nbytes for m in members],
        [m.key for m in members],
        cap,
        first_cap=first_cap,
        ready=[m.ready for m in members],
        first_use=[m.first_use for m in members],
    )
    done = [[members[i] for i in bucket] for bucket in packed]
    done.sort(key=lambda b: max(m.ready for m in b))
    return done


def _divisor(member: Member) -> float | None:
    """The ``n`` of ``wait / n`` when pmean's division is the result's only use."""
    if len(member.wait.users) != 1:
        return None
    (user,) = member.wait.users
    divisor = user.args[1] if user.target is aten.div.Tensor else None
    return divisor if isinstance(divisor, (int, float)) and user.args[0] is member.wait else None


def rewrite(
    graph: fx.Graph,
    buckets: list[list[Member]],
    comm_dtype: torch.dtype | None,
    *,
    functional: bool = False,
) -> list[BucketNodes]:
    """Replace each bucket's per-leaf all-reduces with one all-reduce of a flat buffer.

    When every member's result was only divided by the same ``n`` (a pmean), the division
    moves before the reduction, fused with the packing. By default each gradient is written
    (divided, cast to ``comm_dtype``) into its slice of a fresh flat buffer that is reduced in
    place; a gradient that is the whole output of a matmul or sum is computed straight into its
    slice instead (see ``_direct_write``), as DDP's ``gradient_as_bucket_view`` avoids the
    copy; ``functional=True`` packs with ``cat`` and reduces out of place instead, for backends
    that need a functional graph (Inductor). Each former result becomes a view of the reduced
    buffer. The new nodes go right after the last member becomes ready; the overlap pass moves
    the waits down to their first use.
    """
    out = []
    writes = in_place_writes(graph)  # kept up to date as the chains add writers
    for index, bucket in enumerate(buckets):
        for m in bucket:  # an earlier bucket may have replaced the node this one reduces
            m.source = cast(fx.Node, m.collective.args[0])
        ready = max(ready_node(writes, m.source, m.collective) for m in bucket)
        meta: dict[str, Any] = {BUCKET: index}
        if all(EXACT_SUM in m.collective.meta.get("custom", {}) for m in bucket):
            meta[EXACT_SUM] = True  # the invariant mode's exponents: waited for where they stand
        chain = _Chain(graph, ready, meta, writes)
        dtype = value(bucket[0].source).dtype
        divisors = {_divisor(m) for m in bucket}
        divisor = divisors.pop() if len(divisors) == 1 else None
        # integers (an fddp.Loss's token count, a psum'd counter) are never cast
        wire = comm_dtype if comm_dtype is not None and dtype.is_floating_point else dtype
        pack = _pack_functional if functional else _pack_in_place
        launch = pack(chain, bucket, divisor, wire)
        launch.meta[BUCKET_LEAVES] = tuple(m.path for m in bucket)
        wait = chain.add(WAIT, launch)
        result = wait if wire == dtype else chain.add(aten._to_copy.default, wait, dtype=dtype)
        _unpack(chain, graph, bucket, result, divisor is not None)
        chain.fill_meta()
        out.append(BucketNodes(index, bucket, total_bytes(bucket), launch, wait))
    return out


@dataclasses.dataclass(frozen=True)
class _DirectWrite:
    """A gradient computed straight into its bucket slot: ``producer`` (a matmul or sum whose
    whole output the gradient is, through views only) is replaced by its ``out=`` variant."""

    producer: fx.Node
    dead: list[fx.Node]  # the producer and the views between it and the all-reduce, in order
    out_variant: torch._ops.OpOverload
    alpha: float | None  # the pmean's 1/n folded into a matmul as addmm's alpha


_OUT_VARIANTS = {
    aten.mm.default: aten.mm.out,
    aten.bmm.default: aten.bmm.out,
    aten.sum.dim_IntList: aten.sum.IntList_out,
}


def _direct_write(source: fx.Node, divisor: float | None, wire: torch.dtype) -> _DirectWrite | None:
    """How ``source`` can be produced in its bucket slot, or None when it must be copied.

    The gradient must be the producer's entire output in the same memory order (a contiguous
    view of the same numel at offset 0: ``t(t(mm))`` of a Linear weight, ``view(sum)`` of a
    bias), read by nothing else. A pmean's division is folded in only where it is exact: for a
    matmul, a power-of-two ``n`` becomes gemm's alpha (scaling by 2^-k is exact, so the result is
    bitwise the division's); otherwise the copy path divides as it packs.
    """
    grad = value(source)
    if grad.dtype != wire or not grad.is_contiguous() or len(source.users) != 1:
        return None
    dead, node = [source], source
    while is_view(node):
        node = cast(fx.Node, node.args[0])
        if len(node.users) != 1:
            return None
        dead.append(node)
    out_variant = _OUT_VARIANTS.get(cast(Any, node.target))
    produced = value(node)
    if (
        out_variant is None
        or not produced.is_contiguous()
        or produced.numel() != grad.numel()
        or produced.storage_offset() != grad.storage_offset()
    ):
        return None
    alpha = None
    if divisor is not None and divisor != 1:
        mantissa = math.frexp(float(divisor))[0]
        if node.target is not aten.mm.default or mantissa != 0.5:
            return None
        alpha, out_variant = 1 / float(divisor), aten.addmm.out
    return _DirectWrite(node, dead, out_variant, alpha)


def _slot(add: Callable[..., fx.Node], flat: fx.Node, offset: int, shape: torch.Size) -> fx.Node:
    """The view of ``flat`` at ``offset`` that holds a contiguous tensor of ``shape``."""
    return add(
        aten.as_strided.default, flat, list(shape), list(make_contiguous_strides_for(shape)), offset
    )


def _write_directly(chain: _Chain, direct: _DirectWrite, flat: fx.Node, offset: int) -> None:
    producer = direct.producer
    before = functools.partial(chain.add_before, producer)
    slot = _slot(before, flat, offset, value(producer).shape)
    if direct.alpha is None:
        before(direct.out_variant, *producer.args, **producer.kwargs, out=slot)
    else:  # mm(a, b) / n == addmm(ignored, a, b, beta=0, alpha=1/n)
        before(direct.out_variant, slot, *producer.args, beta=0, alpha=direct.alpha, out=slot)


def _pack_in_place(
    chain: _Chain, bucket: list[Member], divisor: float | None, wire: torch.dtype
) -> fx.Node:
    flat = _pack_into_flat(chain, [m.source for m in bucket], divisor, wire)
    group, op = bucket[0].collective.args[2], bucket[0].collective.args[1]
    return chain.add(ALL_REDUCE_INPLACE, flat, op, group)


def _pack_into_flat(
    chain: _Chain,
    sources: list[fx.Node],
    divisor: float | None,
    wire: torch.dtype,
    padding: int = 0,
) -> fx.Node:
    """A fresh flat buffer holding ``sources`` one after another (each divided by ``divisor``,
    cast to ``wire``), then ``padding`` zeros: computed there where ``_direct_write`` allows,
    else copied in at the chain's end."""
    add = chain.add
    sizes = [value(s).numel() for s in sources]
    device = value(sources[0]).device
    once = {s for s in sources if sources.count(s) == 1}  # a producer can write one slot
    direct = [_direct_write(s, divisor, wire) if s in once else None for s in sources]
    producers = [d.producer for d in direct if d is not None]
    empty = (aten.empty.memory_format, [sum(sizes) + padding])
    if producers:
        first = min(producers)
        flat = chain.add_before(first, *empty, dtype=wire, device=device)
    else:
        flat = add(*empty, dtype=wire, device=device)
    for source, offset, d in zip(sources, _offsets(sizes), direct):
        if d is not None:
            _write_directly(chain, d, flat, offset)
            chain.dead.extend(d.dead)
            continue
        slot = _slot(add, flat, offset, value(source).shape)
        if divisor is None:
            add(aten.copy_.default, slot, source)
        elif wire == value(source).dtype:
            add(aten.div.Scalar_out, source, divisor, out=slot)
        else:  # out= cannot cast: divide in the gradient's precision, then copy_ casts
            add(aten.copy_.default, slot, add(aten.div.Tensor, source, divisor))
    if padding:
        add(aten.zero_.default, add(aten.slice.Tensor, flat, 0, sum(sizes), sum(sizes) + padding))
    return flat


def pack_concatenations_in_place(graph: fx.Graph) -> None:
    """Buckets packed by the step itself for a collective (``shard_state``'s ``cat`` of
    flattened gradients, zero-padded to a multiple of the replicas): packed as this pass packs
    its own, with the gradients computed in place where they can be."""
    for launch in [n for n in graph.nodes if is_collective(n)]:
        packed = launch.args[0]
        if not isinstance(packed, fx.Node) or len(packed.users) != 1:
            continue
        concatenated, padding = packed, 0
        if packed.target is aten.constant_pad_nd.default:
            widths = cast("list[int]", packed.args[1])
            fill = packed.args[2] if len(packed.args) > 2 else 0
            if len(widths) != 2 or widths[0] != 0 or fill != 0:
                continue
            concatenated, padding = cast(fx.Node, packed.args[0]), widths[1]
        if concatenated.target is aten.cat.default and len(concatenated.users) == 1:
            parts = cast("list[fx.Node]", concatenated.args[0])
        elif padding:
            parts, concatenated = [concatenated], packed
        else:
            continue
        if any(value(p).dim() != 1 for p in parts) or len({value(p).dtype for p in parts}) != 1:
            continue
        chain = _Chain(graph, packed.prev, {}, {})
        flat = _pack_into_flat(chain, parts, None, value(parts[0]).dtype, padding)
        chain.fill_meta()
        packed.replace_all_uses_with(flat)
        for node in dict.fromkeys([packed, concatenated]):
            graph.erase_node(node)
        chain.erase_dead()


def _pack_functional(
    chain: _Chain, bucket: list[Member], divisor: float | None, wire: torch.dtype
) -> fx.Node:
    add = chain.add
    flats = [add(aten.reshape.default, m.source, [-1]) for m in bucket]
    flat = add(aten.cat.default, flats) if len(flats) > 1 else flats[0]
    if divisor is not None:
        flat = add(aten.div.Tensor, flat, divisor)
    if wire != value(bucket[0].source).dtype:
        flat = add(aten._to_copy.default, flat, dtype=wire)
    group, op = bucket[0].collective.args[2], bucket[0].collective.args[1]
    return add(ALL_REDUCE, flat, op, group)


def _unpack(
    chain: _Chain, graph: fx.Graph, bucket: list[Member], result: fx.Node, divided: bool
) -> None:
    """Hand each member's users a view of the reduced buffer; drop the per-leaf nodes."""
    add = chain.add
    sizes = [value(m.source).numel() for m in bucket]
    parts = add(aten.split_with_sizes.default, result, sizes) if len(bucket) > 1 else None
    replacements = {}
    for i, m in enumerate(bucket):
        part = add(operator.getitem, parts, i) if parts is not None else result
        leaf = add(aten.view.default, part, list(value(m.source).shape))
        replacements[next(iter(m.wait.users)) if divided else m.wait] = leaf
    replace_uses(replacements)
    for m, old in zip(bucket, replacements):
        for node in (old, m.wait, m.collective) if divided else (old, m.collective):
            graph.erase_node(node)
    chain.erase_dead()


def _offsets(sizes: list[int]) -> list[int]:
    return [0, *itertools.accumulate(sizes)][:-1]


class _Chain:
    """Appends new nodes one after another, starting right after ``anchor``; records their
    in-place writes in ``writes``."""

    def __init__(
        self, graph: fx.Graph, anchor: fx.Node, meta: dict, writes: dict[fx.Node, list[fx.Node]]
    ) -> None:
        self.graph, self.anchor, self.last, self.meta = graph, anchor, anchor, meta
        self.writes = writes
        self.nodes: list[fx.Node] = []
        self.dead: list[fx.Node] = []

    def erase_dead(self) -> None:
        """Drop the gradients' former producers, now that their slots are computed in place."""
        for node in self.dead:
            self.graph.erase_node(node)
        self.dead = []

    def add_before(
        self,
        where: fx.Node,
        target: Callable[..., Any],
        *args: fx.node.Argument,
        **kwargs: fx.node.Argument,
    ) -> fx.Node:
        """A new node placed before ``where`` (the chain's end does not move)."""
        with self.graph.inserting_before(where):
            node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        self.nodes.append(node)
        add_writes(self.writes, node)
        return node

    def add(
        self, target: Callable[..., Any], *args: fx.node.Argument, **kwargs: fx.node.Argument
    ) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        self.last.append(node)
        self.last = node
        self.nodes.append(node)
        add_writes(self.writes, node)
        return node

    def fill_meta(self) -> None:
        """Record the fake value of each new node, as make_fx would have (an in-place or
        ``out=`` op's value is the tensor it writes: nothing to run)."""
        inputs = [a.meta.get("val") for n in self.nodes for a in n.all_input_nodes]
        fake_mode = detect_fake_mode([self.anchor.meta.get("val"), *inputs])
        assert fake_mode is not None  # the captured graph's values are fake tensors
        with fake_mode:
            for node in self.nodes:
                written = returned_argument(node)
                if written is not None:
                    node.meta["val"] = written.meta["val"]
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                val = view_value(node.target, args, kwargs)  # the bucket's slots and parts
                if val is None:
                    val = cast(Callable[..., Any], node.target)(*args, **kwargs)
                node.meta["val"] = val
