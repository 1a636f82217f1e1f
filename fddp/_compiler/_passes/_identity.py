"""Program identity: a captured step as lines the ranks compare, every constant by value."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fddp._base._annotations import AXIS_INDEX
from fddp._base._names import qualified_name
from fddp._compiler._graph import group_of, is_collective
from fddp._ranks._agree import Line
from fddp._ranks._digests import digests

_GROUP_ARGUMENT = "group_name"


def per_rank_reason(node: fx.Node) -> str | None:
    """What makes ``node``'s constants differ per rank by construction (the annotation the rank
    axis or a sharded layout left on it), None for a node that must be the same everywhere."""
    reason = node.meta.get("custom", {}).get(AXIS_INDEX)
    if not reason:
        return None
    return reason if isinstance(reason, str) else "the rank (fddp.axis_index)"


def program_lines(
    gm: fx.GraphModule,
    inputs: list[int | torch.Tensor],
    held: list[tuple[str, torch.Tensor]],
) -> list[Line]:
    """Every node of a captured step's graph ``gm`` as a labelled line: its operator, its
    arguments and every constant among them by value (integers, floats by their shortest exact repr,
    strings, tensor constants by a digest of their bits). ``inputs`` are the capture's inputs
    (``Captured.inputs``): an argument's index, or a tensor the step closes over, compared by
    value too (``held``: those and the tensor constants, as :func:`held_tensors` finds them).

    Left out is only what differs per rank by construction and is named so: the constants of
    nodes a sharded layout or the rank axis annotated (:func:`per_rank_reason`, written in
    their place), a device's index (rank ``r`` computes on ``cuda:r``), and a collective's
    process group, written as its size (each rank of an axis holds its own subgroup)."""
    found = digests([t for _, t in held])
    tensor_text = {id(t): _tensor_text(t, d) for (_, t), d in zip(held, found)}
    placeholders = iter(inputs)
    lines = []
    for node in gm.graph.nodes:
        reason = per_rank_reason(node)
        if node.op == "placeholder":
            source = next(placeholders)
            text = f"argument {source}" if isinstance(source, int) else "closed over"
            if not isinstance(source, int):
                text += " " + (tensor_text[id(source)] if reason is None else "")
        elif node.op == "get_attr":
            value = _attr(gm, node)
            text = tensor_text.get(id(value)) or f"constant {type(value).__name__}"
            if reason is not None:
                text = f"constant, per rank: {reason}"
        elif node.op == "call_function":
            text = f"{_target(node.target)}({_arguments(node, reason)})"
        else:
            text = f"{node.op}({_portable(node.args, None)})"
        lines.append((f"node '{node.name}'", text))
    return lines


def held_tensors(
    gm: fx.GraphModule, inputs: list[int | torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors a captured step's graph ``gm`` holds by reference that :func:`program_lines`
    compares by value: those the step closes over (among ``inputs``) and its tensor constants,
    each once, named by its first node; those a sharded layout or the rank axis made per rank
    are left out. A write into one after the compile changes what the program computes."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, source in zip(placeholders, inputs):
        if isinstance(source, torch.Tensor) and per_rank_reason(node) is None:
            found.setdefault(id(source), (node.name, source))
    for node, value in _constants(gm):
        found.setdefault(id(value), (node.name, value))
    return list(found.values())


def _constants(gm: fx.GraphModule) -> list[tuple[fx.Node, torch.Tensor]]:
    out = []
    for node in gm.graph.nodes:
        value = _attr(gm, node) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor) and per_rank_reason(node) is None:
            out.append((node, value))
    return out


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _tensor_text(t: torch.Tensor, digest: torch.Tensor) -> str:
    bits = int(digest[0]) & (2**64 - 1)
    return f"constant {str(t.dtype).removeprefix('torch.')} {list(t.shape)} digest {bits:016x}"


def _arguments(node: fx.Node, reason: str | None) -> str:
    if not is_collective(node):
        return f"{_portable(node.args, reason)}, {_portable(node.kwargs, reason)}"
    schema = node.target._schema.arguments  # type: ignore[union-attr]
    return ", ".join(
        group_of(value) if argument.name == _GROUP_ARGUMENT else _portable(value, reason)
        for argument, value in zip(schema, node.args)
    )


def _target(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return qualified_name(target)


def _portable(value: Any, reason: str | None) -> str:
    """``value`` as text that two ranks that built the step alike write alike; integers of a
    per-rank node (``reason``) as the reason."""
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if reason is None else f"<per rank: {reason}>"
    if isinstance(value, float):
        return repr(value) if reason is None else f"<per rank: {reason}>"
    if isinstance(value, (str, torch.dtype, torch.layout, torch.memory_format)):
        return repr(value)
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_portable(v, reason) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_portable(v, reason)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_portable((value.start, value.stop, value.step), reason)})"
    return type(value).__name__
