"""Pytree helpers on optree: readable leaf paths, tensor checks, flat packing."""

from __future__ import annotations

from typing import Any

import optree
import torch


def path_str(path: tuple[Any, ...]) -> str:
    """Render an optree leaf path as indexing code, e.g. ``['blocks'][0]['weight']``."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def leaves_with_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into (readable paths, leaves, treespec); None is an empty subtree."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return [path_str(p) for p in paths], leaves, spec


def tensor_leaves(tree: Any, what: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree`` and require every leaf to be a tensor.

    Raises:
        TypeError: naming the path of the first leaf that is not a tensor.
    """
    paths, leaves, spec = leaves_with_paths(tree)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {path} is a {type(leaf).__name__}, not a torch.Tensor. "
                f"Every leaf of {what} must be a tensor: convert it with torch.as_tensor, "
                "or move it out of this argument."
            )
    return leaves, spec


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of any dtypes into one flat uint8 buffer."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split a buffer made by :func:`pack_bytes` back into tensors shaped like ``like``.

    Each tensor gets its own storage: a chunk's byte offset in ``flat`` need not be a multiple
    of its dtype's size, which ``Tensor.view(dtype)`` requires.
    """
    sizes = [t.numel() * t.element_size() for t in like]
    chunks = flat.split(sizes)
    return [c.clone().view(t.dtype).reshape(t.shape) for c, t in zip(chunks, like)]
