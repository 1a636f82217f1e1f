"""Where the replicated arguments' trees differ between ranks, named alike on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError
from fddp._base._tree import leaves_with_paths
from fddp._ranks import _digests, _runtime
from fddp._ranks._agree import Line, find_difference
from fddp._sharding import per_rank_leaves
from fddp._step._call_inputs import describe_tensor


def compare_trees(
    name: str, group: dist.ProcessGroup | None, argnums: tuple[int, ...], args: tuple
) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank if the replicated arguments' trees
    (``argnums`` of the step ``name``) differ (structure, shapes, dtypes, bits; a sharded
    layout's per-rank leaves by shape alone); collective. Run when the signatures differ, to
    name the leaf."""
    if not argnums or _runtime.world_size(group) <= 1:
        return
    checked = [n % len(args) for n in argnums if -len(args) <= n < len(args)]
    per_rank = set(per_rank_leaves(tuple(args[n] for n in checked)))
    paths, leaves, spec = leaves_with_paths([args[n] for n in checked])
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    digests = iter(_digests.digests(tensors))
    lines: list[Line] = []
    for k, (path, leaf) in enumerate(zip(paths, leaves)):
        digest = next(digests) if isinstance(leaf, torch.Tensor) else None
        if digest is None:
            text = repr(leaf)
        elif k in per_rank:
            text = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}"
        else:
            text = describe_tensor(leaf, digest)
        lines.append((f"leaf {path}", text))
    lines.append(("the tree structure", str(spec)))
    difference = find_difference(lines, group)
    if difference is not None:
        raise ReplicaMismatchError(
            f"arguments {list(argnums)} of {name} differ between ranks: "
            f"{difference}. Replicas must start from the same values: create them from "
            "the same seed and model code, or call fddp.replicate(tree) before training."
        )
