"""Fingerprint of a graph's collective sequence, compared across ranks before the first run."""

from __future__ import annotations

import hashlib

import torch.distributed as dist
from torch import fx

from fddp._schedule._graph import is_collective


class ScheduleMismatchError(RuntimeError):
    """Ranks compiled different collective sequences; running them would hang."""


def collective_sequence(graph: fx.Graph) -> list[str]:
    """One line per collective, in launch order: op, shape, dtype, non-tensor arguments and the
    leaves it carries (a bucket's leaves in packing order), so that two ranks whose buckets have
    the same size but hold different gradients do not pass for the same schedule."""
    lines = []
    for node in graph.nodes:
        if is_collective(node):
            val = node.args[0].meta["val"]
            extra = [a for a in node.args[1:] if not isinstance(a, fx.Node)]
            shape = "x".join(map(str, val.shape))
            leaves = node.meta.get("fddp_leaves") or node.meta.get("custom", {}).get("fddp_leaf")
            lines.append(f"{node.target._opname}({shape}, {val.dtype}, {extra}, {leaves})")
    return lines


def fingerprint(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def agree(lines: list[str] | None, error: BaseException | None, group: dist.ProcessGroup) -> None:
    """Exchange each rank's collective sequence (or its capture error); raise on every rank alike.

    A rank whose capture failed makes every rank raise, so no rank waits forever on a peer that
    never reaches the first collective.
    """
    mine = ("error", f"{type(error).__name__}: {error}") if error else ("ok", lines)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [r for r, (kind, _) in enumerate(everyone) if kind == "error"]
    if failed:
        if error is not None:
            raise error
        raise RuntimeError(
            f"ranks {failed} failed to capture the step ({everyone[failed[0]][1]}); this rank "
            "stops too instead of waiting for them."
        )
    sequences = [seq for _, seq in everyone]
    reference = sequences[0]
    for r, seq in enumerate(sequences):
        if seq != reference:
            index = next(
                (i for i, (a, b) in enumerate(zip(seq, reference)) if a != b),
                min(len(seq), len(reference)),
            )
            theirs = seq[index] if index < len(seq) else "<none>"
            ours = reference[index] if index < len(reference) else "<none>"
            raise ScheduleMismatchError(
                f"rank {r} compiled a different collective sequence than rank 0: collective "
                f"#{index} is {theirs} on rank {r} but {ours} on rank 0 ({len(seq)} vs "
                f"{len(reference)} collectives). The step must issue the same collectives with "
                "the same shapes on every rank: check that every rank passes batches of the same "
                "shape and that no branch depends on the rank."
            )
