"""A random op's explicit ``torch.Generator``: its state saved in the forward, replayed later."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


def generator_argument(node: fx.Node) -> fx.Node | None:
    """The graph node of the explicit generator the random op ``node`` draws from (a constant
    of the graph: a step that passes or closes over one is traced with it), or None when it
    draws from its device's default generator."""
    op = node.target
    assert isinstance(op, torch._ops.OpOverload)
    for i, argument in enumerate(op._schema.arguments):
        if "Generator" not in str(argument.type):
            continue
        found = node.kwargs.get(argument.name, node.args[i] if i < len(node.args) else None)
        return found if isinstance(found, fx.Node) else None
    return None


def generator_of(node: fx.Node) -> torch.Generator:
    """The ``torch.Generator`` a generator node (a graph constant) holds."""
    module = node.graph.owning_module
    assert node.op == "get_attr" and module is not None, node.format_node()
    generator = getattr(module, str(node.target))
    assert isinstance(generator, torch.Generator)
    return generator


def draw_saving_state(generator: torch.Generator, op: Any, /, *args: Any, **kwargs: Any) -> tuple:
    """``op(*args, **kwargs)``, which draws from ``generator``, and the state it drew from
    (the op's own arguments name the generator too, hence positional-only parameters)."""
    state = generator.get_state()
    return state, op(*args, **kwargs)


def draw_with_state(
    state: torch.Tensor, generator: torch.Generator, op: Any, /, *args: Any, **kwargs: Any
) -> Any:
    """``op(*args, **kwargs)`` drawing from ``generator`` set to ``state``: the numbers of the
    call that saved ``state``; ``generator`` is left where it was."""
    now = generator.get_state()
    generator.set_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        generator.set_state(now)
