"""A mesh of named subgroups (``data_parallel(axes=...)``): its groups' member ranks, agreed."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch.distributed as dist

from fddp._base._errors import ScheduleMismatchError, UsageValueError
from fddp._ranks._agree import gather_lines

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

Ranks = tuple[int, ...]  # a group's members in the group's order, global numbering


def group_ranks(group: dist.ProcessGroup) -> Ranks:
    return tuple(dist.get_process_group_ranks(group))


def ranks_of(group_name: GroupName) -> Ranks:
    """The members of the process group registered as ``group_name``."""
    return group_ranks(dist.distributed_c10d._resolve_process_group(group_name))


def group_over(ranks: Ranks) -> dist.ProcessGroup | None:
    """A process group of this process whose members are ``ranks`` in this order (the world
    first), or None if none is."""
    world = dist.group.WORLD
    if world is not None and group_ranks(world) == ranks:
        return world
    for group, members in dist.distributed_c10d._world.pg_group_ranks.items():
        if tuple(sorted(members, key=members.__getitem__)) == ranks:
            return group
    return None


def check_axes(axes: Mapping[str, object], group: dist.ProcessGroup | None) -> None:
    """Refuse, on every rank alike, a mesh whose axes do not cut ``group`` (default: the
    world) into the same partition on every rank, or whose groups of two axes do not meet in
    the same number of ranks everywhere (a collective over ``group``)."""
    outer = group_ranks(group if group is not None else _world())
    mine = [(f"axes[{name!r}]", repr(_members(sub))) for name, sub in axes.items()]
    everyone = gather_lines(mine, group)
    names = [[label for label, _ in lines] for lines in everyone]
    for rank, theirs in zip(outer, names):
        if theirs != names[0]:
            raise ScheduleMismatchError(
                f"data_parallel: rank {rank} names the axes {theirs}, but rank {outer[0]} "
                f"names {names[0]}; every rank passes the same names in axes=, each with its "
                "own group."
            )
    members = [{label: ast.literal_eval(value) for label, value in lines} for lines in everyone]
    by_rank = dict(zip(outer, members))
    for label in names[0]:
        _check_partition(label, {rank: m[label] for rank, m in by_rank.items()})
    for a, b in itertools.combinations(names[0], 2):
        _check_meetings(a, b, by_rank)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None  # the caller made the default group
    return world


def _members(sub: object) -> Ranks | None:
    return group_ranks(sub) if isinstance(sub, dist.ProcessGroup) else None


def _check_partition(label: str, groups: dict[int, Ranks | None]) -> None:
    for rank, members in groups.items():
        if members is None or rank not in members:
            raise UsageValueError(
                f"data_parallel: {label} on rank {rank} is not a process group that rank "
                "belongs to; every rank passes its own group of each axis (from "
                "dist.new_group, which every rank calls for every group, or a DeviceMesh)."
            )
        for other in members:
            if other not in groups:
                raise UsageValueError(
                    f"data_parallel: {label} on rank {rank} holds rank {other}, which is "
                    "outside the step's group; each axis must cut the step's group "
                    f"{tuple(groups)} into subgroups."
                )
            if groups[other] != members:
                raise ScheduleMismatchError(
                    f"data_parallel: {label} is the group of ranks {members} on rank {rank}, "
                    f"but rank {other}, one of them, passes ranks {groups[other]}: the groups "
                    "of an axis must cut the step's group into disjoint groups, the same on "
                    "every rank (pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])], then "
                    "each rank passes pairs[rank // 2]). Running the step would wait on ranks "
                    "that never join."
                )
    sizes = sorted({len(m) for m in groups.values() if m is not None})
    if len(sizes) > 1:
        found = sorted({m for m in groups.values() if m is not None})
        raise UsageValueError(
            f"data_parallel: {label} cuts the step's group into groups of different sizes "
            f"{found}; the groups of one axis must all have the same size (each is one "
            "replica of the layout sharded over it)."
        )


def _check_meetings(a: str, b: str, by_rank: dict[int, dict[str, Ranks]]) -> None:
    meetings = {rank: len(set(m[a]) & set(m[b])) for rank, m in by_rank.items()}
    if len(set(meetings.values())) > 1:
        ranks = sorted(meetings, key=meetings.__getitem__)
        low, high = ranks[0], ranks[-1]
        raise UsageValueError(
            f"data_parallel: the groups of {a} and {b} meet in {meetings[low]} rank(s) on rank "
            f"{low} ({by_rank[low][a]} and {by_rank[low][b]}) but in {meetings[high]} on rank "
            f"{high} ({by_rank[high][a]} and {by_rank[high][b]}): the axes are not a mesh. "
            "In a 2-D mesh each group of one axis meets each group of the other in one rank."
        )
