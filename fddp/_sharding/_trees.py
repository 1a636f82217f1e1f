"""Which sharded parameters and states a tree holds, and the group they were cut over."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fddp._base._errors import UsageValueError
from fddp._base._tree import path_str
from fddp._sharding._group import ranks_of
from fddp._sharding._params import ShardedParams
from fddp._sharding._state import ShardedState

_SHARDED = (ShardedParams, ShardedState)


def cut_ranks(tree: Any) -> tuple[int, ...] | None:
    """The ranks (global numbering, in the group's order) of the process group over which the
    sharded layouts in ``tree`` were cut: its ``ShardedParams`` and ``shard_state``'s
    ``ShardedState``. None when it holds none that recorded one (made under ``fddp.vmap``).

    Raises:
        UsageValueError: if it holds layouts cut over different groups.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, _SHARDED)
    )
    found: dict[tuple[int, ...], str] = {}
    for path, leaf in zip(paths, leaves):
        ranks = None
        if isinstance(leaf, ShardedParams):
            ranks = leaf.layout.ranks
        elif isinstance(leaf, ShardedState):
            ranks = ranks_of(leaf.members)
        if ranks is not None:
            found.setdefault(ranks, path_str(path) or "<root>")
    if len(found) > 1:
        listed = "; ".join(f"{where} over ranks {ranks}" for ranks, where in found.items())
        raise UsageValueError(
            f"this tree holds sharded layouts cut over different process groups ({listed}); "
            "a tree is saved, loaded or resharded over one group. Keep the layouts of each "
            "group in a tree of their own."
        )
    return next(iter(found), None)


def states(args: tuple) -> list[ShardedState]:
    """The ``shard_state`` states in ``args``."""
    leaves = optree.tree_leaves(args, is_leaf=lambda x: isinstance(x, ShardedState))
    return [x for x in leaves if isinstance(x, ShardedState)]


def sharded_positions(args: tuple) -> tuple[int, ...]:
    """The positions of ``args`` that hold :class:`ShardedParams`."""
    return tuple(i for i, a in enumerate(args) if isinstance(a, ShardedParams))


def per_rank_leaves(args: Any) -> dict[int, str]:
    """The leaves of ``args`` (their indices in ``optree.tree_leaves(args)``) whose values a
    sharded layout makes differ per rank, each with the layout that does: the shards of
    :class:`ShardedParams`, and of a :class:`ShardedState` its ``pieces`` and the shard lists
    of its inner state (one 1-d tensor per bucket). Its other leaves (a step count, an
    injected hyperparameter) are the same on every rank."""
    found: dict[int, str] = {}
    offset = 0
    for node in optree.tree_leaves(args, is_leaf=lambda x: isinstance(x, _SHARDED)):
        if isinstance(node, ShardedParams):
            count = len(optree.tree_leaves(node))
            found.update({offset + i: "shard_params' shards" for i in range(count)})
        elif isinstance(node, ShardedState):
            count = _state_per_rank(node, offset, found)
        else:
            count = 1
        offset += count
    return found


def _state_per_rank(state: ShardedState, offset: int, found: dict[int, str]) -> int:
    buckets = state.pieces.shape[0] if isinstance(state.pieces, torch.Tensor) else -1

    def shards(x: Any) -> bool:
        return (
            type(x) is list
            and len(x) == buckets
            and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in x)
        )

    count = 0
    for node in optree.tree_leaves(state.inner, is_leaf=shards):
        size = len(node) if shards(node) else 1
        if shards(node):
            found.update({offset + count + i: "shard_state's shards" for i in range(size)})
        count += size
    pieces = len(optree.tree_leaves(state.pieces))
    found.update({offset + count + i: "shard_state's pieces" for i in range(pieces)})
    return count + pieces + len(optree.tree_leaves(state.members))
