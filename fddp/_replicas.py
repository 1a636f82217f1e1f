"""Check that values meant to be replicated really are identical on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fddp._tree import leaves_with_paths


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different values for something that must be the same everywhere."""


def _checksums(leaves: list[torch.Tensor]) -> torch.Tensor:
    """Two float64 numbers per leaf: the sum and the 2-norm of its values."""
    sums = []
    for t in leaves:
        t = t.detach()
        if t.is_floating_point() or t.is_complex():
            sums.append(
                torch.stack(
                    [t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)]
                )
            )
        else:
            sums.append(torch.stack([t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)]))
    return torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)


def check_identical(tree: Any, group: dist.ProcessGroup, what: str) -> None:
    """Raise on every rank if the tensor leaves of ``tree`` differ between ranks.

    First the trees' layouts (structure, leaf paths, shapes, dtypes) are compared, so that the
    checksum all-gather below has the same size on every rank; then one small all-gather of two
    checksums per leaf; NaNs compare equal to NaNs.
    """
    paths, leaves, spec = leaves_with_paths(tree)
    tensors = [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]
    layout = (str(spec), [(p, tuple(x.shape), str(x.dtype)) for p, x in tensors])
    layouts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, layout, group=group)
    for r, (their_spec, theirs) in enumerate(layouts[1:], start=1):
        if (their_spec, theirs) != layouts[0]:
            ours = layouts[0][1]
            first = next(
                ((a, b) for a, b in zip([*theirs, None], [*ours, None]) if a != b),
                (their_spec, layouts[0][0]),
            )
            raise ReplicaMismatchError(
                f"{what} differ between ranks: rank {r} holds a differently shaped tree than "
                f"rank 0 (first difference: {first[0]} on rank {r}, {first[1]} on rank 0). "
                "Build the same tree on every rank (same model code and config)."
            )
    local = _checksums([x for _, x in tensors])
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    reference = everyone[0]
    for r, sums in enumerate(everyone[1:], start=1):
        same = (sums == reference) | (sums.isnan() & reference.isnan())
        if not bool(same.all()):
            leaf = int((~same.all(dim=1)).nonzero()[0])
            raise ReplicaMismatchError(
                f"{what} differ between ranks: leaf {tensors[leaf][0]} on rank {r} is not equal to "
                f"rank 0's (checksums {sums[leaf].tolist()} vs {reference[leaf].tolist()}). "
                "Replicas must start from the same values: create them from the same seed or "
                "call fddp.replicate(tree) before training."
            )
