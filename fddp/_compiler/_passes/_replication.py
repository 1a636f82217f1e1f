"""Replication analysis: which outputs of a captured step can differ between ranks."""

from __future__ import annotations

import torch
from torch import fx

from fddp._base._annotations import AXIS_INDEX
from fddp._compiler._graph import alias_root, is_collective, mutated_inputs

# Annotation on the nodes whose value is this rank's own: axis_index, and the all-to-all a
# reduce-scatter is made of on gloo (the same op carries replicated copies in an all-gather).
# Collectives whose result differs between ranks: each rank receives its own block of the sum.
PER_RANK_RESULTS = {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def generator_bit(rank_bit: int) -> int:
    """The bit that stands for the random generator's state, the one above the rank's."""
    return rank_bit << 1


def drawn_bit(rank_bit: int) -> int:
    """The bit of a value computed from a random draw through collectives or not, the one
    above the generator's (a seed drawn for dropout that the step never applies sets none)."""
    return rank_bit << 2


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (its result depends on the state)."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def dependencies(graph: fx.Graph) -> tuple[list[int], int]:
    """For each graph output, the placeholders it depends on without a collective in between.

    Returns:
        One bitset per output (bit ``k`` for the ``k``-th placeholder), and the bit that stands
        for the rank itself (set on outputs computed from ``axis_index``); the bit above it
        (:func:`generator_bit`) is set on outputs computed from a random draw, and the one
        above that (:func:`drawn_bit`) also where a collective lies in between.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    rank_bit = 1 << len(placeholders)
    deps: dict[fx.Node, int] = {n: 1 << k for k, n in enumerate(placeholders)}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        reads_rank = bool(node.meta.get("custom", {}).get(AXIS_INDEX))
        drawn = drawn_bit(rank_bit)
        if is_collective(node):  # its wait, and all that reads only results, are replicated
            bits = rank_bit if reads_rank or node.target in PER_RANK_RESULTS else 0
            for arg in node.all_input_nodes:
                bits |= deps.get(arg, 0) & drawn
            deps[node] = bits
            continue
        bits = rank_bit if reads_rank else 0
        if draws_random(node):
            bits |= generator_bit(rank_bit) | drawn
        for arg in node.all_input_nodes:
            bits |= deps.get(arg, 0)
        deps[node] = bits
        for target in mutated_inputs(node):  # later readers see the written value
            root = alias_root(target)
            deps[root] = deps.get(root, 0) | bits
            deps[target] = deps.get(target, 0) | bits
    (output,) = [n for n in graph.nodes if n.op == "output"]
    results = output.args[0]
    results = results if isinstance(results, (list, tuple)) else [results]
    return [deps.get(r, 0) if isinstance(r, fx.Node) else 0 for r in results], rank_bit
