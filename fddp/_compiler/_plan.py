"""The compiled plan as data: buckets, launch and wait positions, overlap, printable as a table."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import fx

from fddp._base._annotations import BUCKET_LEAVES, LEAF_PATH
from fddp._compiler._graph import group_of, is_collective, is_compute, nbytes
from fddp._compiler._passes import _param_gathers
from fddp._compiler._passes._bucket import BucketNodes
from fddp._compiler._passes._rematerialize import RematPlan


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
    """One collective in launch order.

    Attributes:
        kind: the functional-collective op, e.g. ``all_reduce``.
        bucket: the bucket index for a bucketed all-reduce, else None.
        leaves: the pytree paths of the leaves it carries.
        nbytes: bytes of its input.
        dtype: dtype on the wire.
        launch: compute nodes that run before the launch.
        wait: compute nodes that run before the wait.
        gather: for a gather of fully sharded parameters, which: ``"params 0.3, 2 of 2"`` is
            the second of two gathers of bucket 3 of argument 0; else empty.
        freed: for such a gather, compute nodes that run before the gathered parameters'
            last use (they are freed after it); else -1.
    """

    kind: str
    bucket: int | None
    leaves: tuple[str, ...]
    nbytes: int
    dtype: str
    launch: int
    wait: int
    gather: str = ""
    freed: int = -1

    @property
    def overlapped(self) -> int:
        """Compute nodes that run while this collective is in flight."""
        return self.wait - self.launch


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``data_parallel`` will run for one input signature."""

    collectives: tuple[CollectivePlan, ...]
    compute_nodes: int
    capture_seconds: float
    captured_with: str = "make_fx"  # or "dynamo", for steps make_fx cannot trace
    replication: tuple[tuple[str, str], ...] = ()  # (output leaf, "replicated" or why per-rank)
    bucket_cap: str = ""  # the cap and where it came from
    across_steps: str = ""  # with overlap_steps: what is deferred to the next call, and if it is
    remat: RematPlan | None = None  # with rematerialisation: what is saved and recomputed

    @property
    def buckets(self) -> tuple[CollectivePlan, ...]:
        return tuple(c for c in self.collectives if c.bucket is not None)

    @property
    def gathers(self) -> tuple[CollectivePlan, ...]:
        """The gathers of fully sharded parameters, in launch order."""
        return tuple(c for c in self.collectives if c.gather)

    def __str__(self) -> str:
        head = f"{'#':>3} {'kind':<14} {'MiB':>8} {'dtype':<9} {'launch':>7} {'wait':>7} "
        head += f"{'overlap':>8}  leaves"
        rows = [head]
        for i, c in enumerate(self.collectives):
            leaves = ", ".join(c.leaves[:3]) + (
                f" (+{len(c.leaves) - 3})" if len(c.leaves) > 3 else ""
            )
            if c.gather:
                leaves = f"gather {c.gather}, freed after node {c.freed}: {leaves}"
            rows.append(
                f"{i:>3} {c.kind:<14} {c.nbytes / 2**20:>8.3f} {c.dtype:<9} {c.launch:>7} "
                f"{c.wait:>7} {c.overlapped:>8}  {leaves}"
            )
        n, b, g = len(self.collectives), len(self.buckets), len(self.gathers)
        gathers = f", {g} parameter gather{'s' * (g != 1)}" if g else ""
        rows.append(
            f"{n} collective{'s' * (n != 1)} "
            f"({b} bucketed all-reduce{'s' * (b != 1)}{gathers}) over "
            f"{self.compute_nodes} compute nodes; captured with {self.captured_with} in "
            f"{self.capture_seconds:.2f} s"
        )
        if self.bucket_cap:
            rows.append(self.bucket_cap)
        if self.across_steps:
            rows.append(self.across_steps)
        if self.remat is not None:
            rows.append(str(self.remat))
        if self.replication:
            rows.append(self._outputs_summary())
        return "\n".join(rows)

    def outputs_table(self) -> str:
        """Each output leaf, one a line: replicated, or per-rank and from what.

        ``str(plan)`` sums this up in one line; empty before the first call with these arguments.

        >>> from fddp.typing import Plan
        >>> how = (("[0]", "replicated"), ("[1]", "per-rank (from argument leaf [1])"))
        >>> plan = Plan((), 0, 0.0, replication=how)
        >>> print(str(plan).splitlines()[-1])
        outputs: 1 replicated, 1 per-rank: [1] (from argument leaf [1]); outputs_table() lists each
        >>> print(plan.outputs_table())
        [0]                            replicated
        [1]                            per-rank (from argument leaf [1])
        """
        return "\n".join(f"{path:<30} {how}" for path, how in self.replication)

    def _outputs_summary(self) -> str:
        per_rank = [(path, how) for path, how in self.replication if how != "replicated"]
        line = f"outputs: {len(self.replication) - len(per_rank)} replicated"
        if per_rank:
            named = [f"{path} {how.removeprefix('per-rank ')}" for path, how in per_rank[:4]]
            more = f" (+{len(per_rank) - 4})" if len(per_rank) > 4 else ""
            line += f", {len(per_rank)} per-rank: {', '.join(named)}{more}"
        return line + "; outputs_table() lists each"


def describe(
    graph: fx.Graph, buckets: list[BucketNodes], capture_seconds: float, captured_with: str
) -> Plan:
    by_launch = {b.launch: b for b in buckets}
    compute_before: dict[fx.Node, int] = {}
    count = 0
    for node in graph.nodes:
        compute_before[node] = count
        count += is_compute(node)
    gathers = _param_gathers.describe(graph)
    plans = []
    for node in graph.nodes:
        if not is_collective(node):
            continue
        wait = next(iter(node.users))
        bucket = by_launch.get(node)
        source = node.args[0]
        gathered = gathers.get(node)
        leaves = tuple(m.path for m in bucket.members) if bucket else (source.name,)
        plans.append(
            CollectivePlan(
                kind=node.target._opname,
                bucket=bucket.index if bucket else None,
                leaves=gathered.leaves if gathered else leaves,
                nbytes=nbytes(source),
                dtype=str(source.meta["val"].dtype).removeprefix("torch."),
                launch=compute_before[node],
                wait=compute_before[wait],
                gather=gathered.which if gathered else "",
                freed=compute_before[gathered.last_use] if gathered else -1,
            )
        )
    return Plan(tuple(plans), count, capture_seconds, captured_with)


@functools.cache
def _argument_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    return tuple(a.name for a in op._schema.arguments)


def collective_sequence(graph: fx.Graph) -> list[str]:
    """One line per collective, in launch order: op, shape, dtype, non-tensor arguments and the
    leaves it carries (a bucket's leaves in packing order), so that two ranks whose buckets have
    the same size but hold different gradients do not pass for the same schedule."""
    lines = []
    for node in graph.nodes:
        if is_collective(node):
            val = node.args[0].meta["val"]
            extra = [
                group_of(a) if name == "group_name" else a
                for name, a in zip(_argument_names(node.target)[1:], node.args[1:])
                if not isinstance(a, fx.Node)
            ]
            shape = "x".join(map(str, val.shape))
            leaves = node.meta.get(BUCKET_LEAVES) or node.meta.get("custom", {}).get(LEAF_PATH)
            lines.append(f"{node.target._opname}({shape}, {val.dtype}, {extra}, {leaves})")
    return lines
