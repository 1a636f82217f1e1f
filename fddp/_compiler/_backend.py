"""Backends: run the scheduled aten graph as Python (FX) or hand it to Inductor."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import linecache
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

BACKENDS = ("fx", "inductor")  # run the scheduled FX graph, or compile it with Inductor
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def fx_runner(gm: fx.GraphModule) -> Runner:
    """Run the graph's generated Python code; each collective launches where it stands."""
    return as_runner(direct_calls(gm))


def as_runner(forward: Callable[..., Any]) -> Runner:
    return lambda inputs: forward(*inputs)


# One dotted operator call as FX writes it: torch.ops.<namespace>.<op>.<overload>(
_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


@dataclasses.dataclass(frozen=True)
class Generated:
    """A graph's forward as a code object and the globals it runs with; ``operators`` names
    the globals bound to an operator (namespace, name, overload), the rest are FX's."""

    code: types.CodeType
    fx_globals: dict[str, Any]
    operators: dict[str, tuple[str, str, str]]
    source: str  # for tracebacks

    def forward(self, holder: Any) -> Callable[..., Any]:
        """The forward bound to ``holder`` (what the code reads as ``self``: the graph
        module, or anything that holds its constants)."""
        namespace = {**self.fx_globals, **{n: _entry(*op) for n, op in self.operators.items()}}
        filename, lines = self.code.co_filename, self.source.splitlines(keepends=True)
        linecache.cache[filename] = (len(self.source), None, lines, filename)
        exec(self.code, namespace)
        return functools.partial(namespace["forward"], holder)


def _entry(namespace: str, name: str, overload: str) -> Any:
    """The operator's C++ entry point where its Python ``__call__`` only forwards to it."""
    found = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    plain = type(found).__call__ is torch._ops.OpOverload.__call__
    return found._op if plain else found


def generate(gm: fx.GraphModule, code: fx.graph.PythonCode | None = None) -> Generated:
    """``gm``'s forward, with each operator bound as a global and called without its Python
    wrapper.

    FX writes ``torch.ops.aten.mul.Tensor(a, b)``: four attribute lookups, then the operator's
    Python ``__call__``, about 1 us per node above the dispatcher's own cost. Here each call
    goes straight to the operator's C++ entry point (what ``__call__`` forwards to), so a graph
    of many small nodes runs closer to eager. Same operators, same order, same results.
    ``code`` is the graph's code as ``gm.recompile()`` returned it, if the caller has it.
    """
    code = code or gm.graph.python_code(root_module="self")
    operators: dict[str, tuple[str, str, str]] = {}

    def bind(match: re.Match) -> str:
        name = f"_op_{match[1]}_{match[2]}_{match[3]}"
        operators[name] = (match[1], match[2], match[3])
        return name + "("

    src = _OP_CALL.sub(bind, code.src)
    filename = f"<fddp graph {hashlib.sha1(src.encode()).hexdigest()[:12]}>"
    return Generated(compile(src, filename, "exec"), dict(code.globals), operators, src)


def direct_calls(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s forward as :func:`generate` writes it, bound to ``gm``."""
    return generate(gm).forward(gm)


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


def build(
    gm: fx.GraphModule, backend: str, code: fx.graph.PythonCode | None = None
) -> tuple[Runner, Generated | None]:
    """Run ``gm`` as Python code (``"fx"``, whose generated code comes back too; ``code`` as
    for :func:`generate`) or compiled by Inductor (``"inductor"``)."""
    if backend == "inductor":
        return inductor_runner(gm), None
    generated = generate(gm, code)
    return as_runner(generated.forward(gm)), generated
