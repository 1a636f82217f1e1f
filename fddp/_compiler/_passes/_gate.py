"""The gate before a step's first collective: the call's signature check must have passed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from torch import fx

from fddp._compiler._graph import is_collective

_armed = threading.local()


def signature_gate() -> None:
    """Called by the scheduled graph just before its first collective."""
    settle = getattr(_armed, "settle", None)
    if settle is not None:
        _armed.settle = None
        settle()


signature_gate._fddp_gate = True  # type: ignore[attr-defined]  # not compute (see _graph)


@contextlib.contextmanager
def armed(settle: Callable[[], None]) -> Iterator[None]:
    """Within the block, the gate runs ``settle`` (once)."""
    _armed.settle = settle
    try:
        yield
    finally:
        _armed.settle = None


def insert(graph: fx.Graph) -> fx.Node | None:
    """Place the gate before the first collective; None if the graph has none."""
    first = next((n for n in graph.nodes if is_collective(n)), None)
    if first is None:
        return None
    with graph.inserting_before(first):
        return graph.call_function(signature_gate, ())
