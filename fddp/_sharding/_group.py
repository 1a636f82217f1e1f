"""The process group a sharded layout was cut over, and the checks that refuse another one."""

from __future__ import annotations

import dataclasses

import optree

from fddp._base import _axes
from fddp._base._errors import UsageValueError
from fddp._collectives._ops import ProcessAxis, named_axis
from fddp._ranks import _mesh


@dataclasses.dataclass(frozen=True)
class Members:
    """The process group a sharded layout was cut over: its ranks in the group's order, in
    global numbering. A pytree node without leaves: it travels in the tree's structure."""

    ranks: tuple[int, ...]
    axis_name: str  # the axis that was bound to the group

    def __repr__(self) -> str:
        # A step's argument tree is compared across its ranks, and under hybrid sharding each
        # pair cuts its layout over its own pair: only the group's size is the same everywhere.
        return f"Members({len(self.ranks)} ranks of axis {self.axis_name!r})"


optree.register_pytree_node(
    Members,
    lambda m: ((), m),  # itself as the node's metadata, shown by its repr
    lambda m, _: m,
    namespace=optree.registry.__GLOBAL_NAMESPACE,  # the namespace fddp flattens in
)


def members_of(axis_name: str) -> Members | None:
    """The process group ``axis_name`` is bound to here (None: not a process group)."""
    axis = named_axis(axis_name)
    if not isinstance(axis, ProcessAxis):
        return None
    return Members(_mesh.ranks_of(axis.group_name), axis_name)


def ranks_of(members: Members | None) -> tuple[int, ...] | None:
    return None if members is None else members.ranks


def check_members(cut: Members | None, here: Members | None, axis_name: str, where: str) -> None:
    """Refuse a state cut over the group ``cut`` where ``axis_name`` is bound to ``here``."""
    if cut is None or here is None or cut.ranks == here.ranks:
        return
    raise UsageValueError(
        f"{where}: this state was cut over the group of ranks {cut.ranks}, but "
        f"axis {axis_name!r} is bound to ranks {here.ranks} here; its shards would be updated "
        "with other ranks' gradients. Run the update over the group the state was made on "
        "(init it where the step binds the axis: the same group= or axes=), or move the state "
        "to this group through fddp.save_sharded and fddp.load_sharded."
    )


def check_hybrid(axis_name: str, replicate_axis: str | None, shard: Members) -> None:
    """Refuse a ``replicate_axis`` that is not orthogonal to ``axis_name`` and, without one, a
    step that has such an axis (hybrid sharding that would not average across the groups)."""
    own = set(shard.ranks)
    if replicate_axis is not None:  # checked where it is bound (update needs it there)
        replicate = members_of(replicate_axis) if _axes.find(replicate_axis) else None
        if replicate is not None and len(own & set(replicate.ranks)) != 1:
            raise UsageValueError(
                f"shard_state(axis_name={axis_name!r}, replicate_axis={replicate_axis!r}): the "
                f"groups meet in ranks {sorted(own & set(replicate.ranks))} (shard group "
                f"{shard.ranks}, replicate group {replicate.ranks}); a replicate group holds one "
                f"rank of each {axis_name!r} group (with pairs {{0, 1}} and {{2, 3}}: "
                "{0, 2} and {1, 3}), neither the whole world nor the shard group itself. Pass "
                "those groups in data_parallel(..., axes=...)."
            )
        return
    for axis in _axes.bound_axes():
        if axis.name == axis_name or not isinstance(axis, ProcessAxis) or axis.size() < 2:
            continue
        other = set(_mesh.ranks_of(axis.group_name))
        if len(own & other) == 1:
            raise UsageValueError(
                f"shard_state(axis_name={axis_name!r}) in a step whose axis {axis.name!r} "
                f"(ranks {tuple(sorted(other))}) crosses the shard groups (this one: "
                f"{shard.ranks}): each {axis_name!r} group would train alone and the groups "
                f"drift apart. For hybrid sharding pass replicate_axis={axis.name!r} to "
                "shard_state, which averages each gradient shard across the groups."
            )
