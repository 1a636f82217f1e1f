"""Small queries on aten FX graphs: collectives, views, mutations, sizes, positions."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed
from torch import fx

c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
ALL_REDUCE_INPLACE = c10d.all_reduce_.default
WAIT = c10d.wait_tensor.default

_BOOKKEEPING = {
    "getitem",
    "t",
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "split_with_sizes",
    "slice",
    "as_strided",
    "empty",
}


def group_of(name: object) -> str:
    """A process group by its size: ranks of different subgroups of one axis (data_parallel's
    ``axes``) name their groups differently and still run the same schedule."""
    resolve = torch.distributed.distributed_c10d._resolve_process_group
    group = resolve(cast(Any, name))  # a GroupName, as the graph's collective holds it
    return f"group of {group.size()}"


def _overload(node: fx.Node) -> torch._ops.OpOverload | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target
    return None


def is_collective(node: fx.Node) -> bool:
    """A functional collective launch (not its wait)."""
    op = _overload(node)
    return op is not None and op.namespace == "_c10d_functional" and op is not WAIT


def is_wait(node: fx.Node) -> bool:
    return _overload(node) is WAIT


def is_compute(node: fx.Node) -> bool:
    """A node that does real work: not a placeholder, output, collective, wait or view."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return False
    if getattr(node.target, "_fddp_gate", False):
        return False
    name = getattr(node.target, "__name__", "")
    return name.split(".")[0] not in _BOOKKEEPING


def is_view(node: fx.Node) -> bool:
    """An op whose first output aliases its first input without writing it."""
    op = _overload(node)
    if op is None:
        return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"
    return _returns_view(op)


@functools.cache
def _returns_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return (
        bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    )


# Batch norms that update running_mean/running_var (arguments 3 and 4) in place when training
# (argument 5) although their schemas do not mark them written.
_UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The argument nodes that ``node`` writes in place (including ``out=`` arguments)."""
    op = _overload(node)
    if op is None:
        return []
    out: list[fx.Node] = []
    for i, name in _written_arguments(op):
        given = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        out.extend(_flat_nodes(given))
    if op in _UNDECLARED_WRITES and node.args[5]:
        out.extend(_flat_nodes([node.args[i] for i in _UNDECLARED_WRITES[op]]))
    return out


@functools.cache
def _written_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments ``op``'s schema marks written."""
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def returned_argument(node: fx.Node) -> fx.Node | None:
    """The argument node an in-place or ``out=`` op returns as its one result, if it is one."""
    op = _overload(node)
    if op is None:
        return None
    found = _returned_argument(op)
    if found is None:
        return None
    i, name = found
    given = node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return given if isinstance(given, fx.Node) else None


@functools.cache
def _returned_argument(op: torch._ops.OpOverload) -> tuple[int, str] | None:
    returns = op._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None or not returns[0].alias_info.is_write:
        return None
    alias_set = returns[0].alias_info.before_set
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias_set:
            return i, arg.name
    return None


def _flat_nodes(value: object) -> Iterable[fx.Node]:
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_nodes(v)


def alias_root(node: fx.Node) -> fx.Node:
    """Follow view ops back to the node that owns the storage."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def value(node: fx.Node) -> torch.Tensor:
    """The fake tensor recorded for ``node`` at trace time."""
    return node.meta["val"]


def nbytes(node: fx.Node) -> int:
    val = value(node)
    return val.numel() * val.element_size()


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index, for costs and plans that count nodes (comparing two nodes needs
    none: ``a < b``)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def in_place_writes(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each storage root, the nodes that write it in place.

    Nodes compare by their place in the graph (``a < b``: ``a`` runs first), also after a pass
    moves them, so the lists stay true while nodes move, as long as no writer is added.
    """
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        add_writes(out, node)
    return out


def add_writes(writes: dict[fx.Node, list[fx.Node]], node: fx.Node) -> None:
    """Record ``node``'s in-place writes in ``writes`` (see :func:`in_place_writes`)."""
    for arg in mutated_inputs(node):
        writes.setdefault(alias_root(arg), []).append(node)


def ready_node(writes: dict[fx.Node, list[fx.Node]], source: fx.Node, reader: fx.Node) -> fx.Node:
    """The node after which ``source`` holds the value ``reader`` sees: ``source``, or its last
    in-place write before ``reader``."""
    return max([source, *(w for w in writes.get(alias_root(source), ()) if w < reader)])


def replace_uses(replacements: dict[fx.Node, fx.Node]) -> None:
    """Every use of each key of ``replacements`` reads its value instead. Each user's arguments
    are rebuilt once: ``replace_all_uses_with`` rebuilds a foreach op's list of N leaves once
    per leaf, N^2 in all."""
    users = {user: None for old in replacements for user in old.users}
    for user in users:
        user.args = fx.node.map_arg(user.args, lambda n: replacements.get(n, n))
        user.kwargs = fx.node.map_arg(user.kwargs, lambda n: replacements.get(n, n))


def remove_double_waits(graph: fx.Graph) -> None:
    """``wait(wait(x))`` is ``wait(x)``: the traced collectives wrap each result twice."""
    for node in list(graph.nodes):
        if is_wait(node) and is_wait(node.args[0]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


Storage = int  # a storage's address: the graph's values (node.meta) keep every storage alive


def storage(t: torch.Tensor) -> Storage:
    """Which storage ``t`` views: equal for tensors that share memory."""
    return t.untyped_storage()._cdata
