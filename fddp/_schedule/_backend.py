"""Backends: run the scheduled aten graph as Python (FX) or hand it to Inductor."""

from __future__ import annotations

import functools
import linecache
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def fx_runner(gm: fx.GraphModule) -> Runner:
    """Run the graph's generated Python code; each collective launches where it stands."""
    forward = direct_calls(gm)
    return lambda inputs: forward(*inputs)


# One dotted operator call as FX writes it: torch.ops.<namespace>.<op>.<overload>(
_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def direct_calls(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s forward, with each operator bound as a global and called without its Python
    wrapper.

    FX writes ``torch.ops.aten.mul.Tensor(a, b)``: four attribute lookups, then the operator's
    Python ``__call__``, about 1 us per node above the dispatcher's own cost. Here each call
    goes straight to the operator's C++ entry point (what ``__call__`` forwards to), so a graph
    of many small nodes runs closer to eager. Same operators, same order, same results.
    """
    gm.recompile()
    code = gm.graph.python_code(root_module="self")
    bound: dict[str, Any] = {}

    def bind(match: re.Match) -> str:
        overload = getattr(getattr(getattr(torch.ops, match[1]), match[2]), match[3])
        name = f"_op_{match[1]}_{match[2]}_{match[3]}"
        plain = type(overload).__call__ is torch._ops.OpOverload.__call__
        bound[name] = overload._op if plain else overload
        return name + "("

    src = _OP_CALL.sub(bind, code.src)
    filename = f"<fddp graph {id(gm):x}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace = {**code.globals, **bound}
    exec(compile(src, filename, "exec"), namespace)
    return functools.partial(namespace["forward"], gm)


# Inductor would otherwise reorder for peak memory, pulling each bucket's optimizer update (and
# so its wait) up to right after the launch; sinking waits keeps them at their first use.
_KEEP_COMM_PLACEMENT = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits"],
}


def inductor_runner(gm: fx.GraphModule) -> Runner:
    """Compile the scheduled graph with Inductor on its first run (it needs real inputs)."""
    from torch._inductor.compile_fx import compile_fx

    compiled: list[Callable] = []

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not compiled:
            with torch._inductor.config.patch(_KEEP_COMM_PLACEMENT):
                fn = compile_fx(gm, inputs)
                assert callable(fn)  # code or weights come back only from AOT compilation
                compiled.append(fn)
        return compiled[0](*inputs)

    return run


def build(gm: fx.GraphModule, backend: str) -> Runner:
    """Run ``gm`` as Python code (``"fx"``) or compiled by Inductor (``"inductor"``)."""
    return inductor_runner(gm) if backend == "inductor" else fx_runner(gm)
