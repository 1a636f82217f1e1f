"""What recoverable refuses: options that cannot survive a shrink, and state no survivor holds."""

from __future__ import annotations

import math
from typing import Any

import optree

from fddp._base._types import GradientTransformation


def check_options(
    optimizer: GradientTransformation,
    *,
    world_size: int,
    micro_batches: int,
    min_world_size: int,
    invariant: bool,
    join: bool,
    timeout: float,
    settle: float,
    compile_timeout: float,
    admit_every: int,
) -> None:
    """Refuse, before a group is formed, options that fail now or at a later shrink."""
    if not isinstance(micro_batches, int) or (micro_batches < world_size and not join):
        raise ValueError(
            f"recoverable: micro_batches={micro_batches!r} must be an int >= world_size "
            f"({world_size}): every member needs at least one micro-batch."
        )
    if not isinstance(admit_every, int) or admit_every < 1:
        raise ValueError(f"recoverable: admit_every={admit_every!r} must be an int >= 1.")
    if not isinstance(min_world_size, int) or not 1 <= min_world_size <= max(world_size, 1):
        raise ValueError(
            f"recoverable: min_world_size={min_world_size!r} must be an int in "
            f"[1, world_size={world_size}]: the fewest members the job goes on with."
        )
    if timeout <= 0 or settle <= 0 or compile_timeout <= 0:
        raise ValueError(
            "recoverable: timeout, settle and compile_timeout must be positive (seconds)."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"recoverable: optimizer is a {type(optimizer).__name__}; pass an fddp.optim "
            "transformation (e.g. fddp.optim.adamw(1e-3))."
        )
    if invariant and not join:
        _check_even_shrinks(micro_batches, world_size, min_world_size)


def _check_even_shrinks(micro_batches: int, world_size: int, min_world_size: int) -> None:
    """Invariant mode needs whole micro-batches per member on every world the job may have."""
    sizes = range(world_size, min_world_size - 1, -1)
    uneven = [n for n in sizes if micro_batches % n]
    if uneven:
        lcm = math.lcm(*sizes)
        raise ValueError(
            f"recoverable(invariant=True): micro_batches={micro_batches} does not split evenly "
            f"over {_sizes(uneven)} members, and the job may shrink to any of {_sizes(sizes)} "
            f"members (world_size={world_size}, min_world_size={min_world_size}); the exact "
            "mean over the global batch cannot weigh padding. Choose micro_batches as a "
            f"multiple of {lcm}, or raise min_world_size= (the job then ends instead of "
            "shrinking below it)."
        )


def _sizes(sizes: Any) -> str:
    sizes = list(sizes)
    return ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])


def refuse_unrecoverable(opt_state: Any) -> None:
    """State that lives on one rank only cannot be recovered from the survivors: its type says
    so, and why, with a ``lost_with_its_rank()`` method."""
    nodes = optree.tree_flatten(opt_state, is_leaf=_lost_with_its_rank)[0]
    for node in [opt_state, *nodes]:
        if _lost_with_its_rank(node):
            raise ValueError(f"recoverable: {node.lost_with_its_rank()}")


def _lost_with_its_rank(node: Any) -> bool:
    return callable(getattr(node, "lost_with_its_rank", None))
