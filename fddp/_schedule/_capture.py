"""Capture a step as one aten graph on fake tensors, so nothing real runs while capturing.

First choice: ``make_fx`` on the flattened step. It runs the step's Python once on fake tensors
(a fraction of a second for a small model) and records every aten op, ``torch.func`` transforms
and functional collectives included. Steps it cannot trace, typically model code that branches
on tensor values unless ``torch.compiler.is_compiling()`` (Hugging Face's mask utilities), go
through Dynamo (``fullgraph=True``), whose graph make_fx then lowers to aten: slower (seconds),
but it evaluates such code the way ``torch.compile`` would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fddp._schedule._graph import remove_double_waits


class CaptureError(RuntimeError):
    """The step could not be captured as one graph."""


class _CaptureOnly(Exception):
    """Raised by the compiled stub to stop Dynamo from running the step right after capture."""


@dataclasses.dataclass
class Captured:
    """An aten graph, where each of its inputs comes from and where the step's outputs go.

    ``inputs[k]`` is an index into the step's flat tensor arguments, or a tensor the step closes
    over (a module buffer, a constant), held by reference. ``outputs`` lists, per leaf of the
    step's output, ``("graph", k)`` for graph output ``k``, ``("arg", i)`` for tensor argument
    ``i`` returned as it is, or ``("const", value)``; with ``out_spec`` it rebuilds the output.
    A Dynamo capture learns them on its first run (until then they are None).
    """

    graph: fx.GraphModule
    inputs: list[int | torch.Tensor]
    seconds: float
    outputs: list[tuple[str, Any]] | None = None
    out_spec: optree.PyTreeSpec | None = None
    method: str = "make_fx"


def _tidy(gm: fx.GraphModule) -> fx.GraphModule:
    remove_double_waits(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def trace_with_make_fx(fn: Callable[..., Any], args: tuple) -> Captured:
    """Capture ``fn(*args)`` by running it once on fake tensors under make_fx.

    Tensors ``fn`` closes over become graph constants held by reference; non-tensor leaves of
    ``args`` and of the output are constants of this capture.
    """
    start = time.perf_counter()
    leaves, spec = optree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    outputs: dict[str, Any] = {}

    def flat_step(*tensors: torch.Tensor) -> list[torch.Tensor]:
        it = iter(tensors)
        full = [next(it) if t else x for t, x in zip(is_tensor, leaves)]
        out_leaves, outputs["spec"] = optree.tree_flatten(fn(*optree.tree_unflatten(spec, full)))
        outputs["leaves"] = out_leaves
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(x) for x, t in zip(leaves, is_tensor) if t]
    with fake_mode, fx_traceback.preserve_node_meta():
        gm = make_fx(flat_step)(*fakes)
    mapping, k = [], 0
    for leaf in outputs["leaves"]:
        if isinstance(leaf, torch.Tensor):
            mapping.append(("graph", k))
            k += 1
        else:
            mapping.append(("const", leaf))
    return Captured(
        _tidy(gm), list(range(len(fakes))), time.perf_counter() - start, mapping, outputs["spec"]
    )


def lower_to_aten(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> fx.GraphModule:
    """Re-trace a Dynamo graph into aten ops on fake tensors, keeping node annotations."""
    fake_mode = detect_fake_mode(example_inputs)
    fakes = [fake_mode.from_tensor(t) for t in example_inputs]
    with fake_mode, fx_traceback.preserve_node_meta():
        aten = make_fx(lambda *args: fx.Interpreter(gm).run(*args))(*fakes)
    return _tidy(aten)


def _fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, so it gets its own Dynamo cache.

    A plain function is copied with its own globals and closure, so Dynamo resolves the names it
    uses exactly as Python does (also for functions defined in doctests or notebooks, whose
    globals are not a module's). Any other callable is wrapped in a function first.
    """
    if not isinstance(fn, types.FunctionType):
        target = fn

        def fn(*args: Any) -> Any:
            return target(*args)

    code = fn.__code__.replace()
    fresh = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


class DynamoCapture:
    """One Dynamo compilation of ``fn(*args)`` whose backend builds an executable.

    ``make_executable(captured)`` turns the aten graph into ``run(inputs) -> outputs``. The first
    call of :meth:`trace` stops right after capture; :meth:`run_once` then runs the step once
    through Dynamo (which knows how to rebuild the step's Python outputs from graph outputs).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        make_executable: Callable[[Captured], Callable[[list[torch.Tensor]], list[torch.Tensor]]],
    ) -> None:
        self._make_executable = make_executable
        self._stop_after_capture = True
        self.captured: Captured | None = None
        self.executable: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
        self.graph_outputs: list[torch.Tensor] = []
        self._compiled = torch.compile(
            _fresh_function(fn), backend=self._backend, fullgraph=True, dynamic=False
        )

    def _backend(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        start = time.perf_counter()
        positions = {id(t): i for i, t in enumerate(self._tensors)}
        inputs: list[int | torch.Tensor] = [positions.get(id(t), t) for t in example_inputs]
        aten = lower_to_aten(gm, example_inputs)
        self.captured = Captured(aten, inputs, time.perf_counter() - start, method="dynamo")
        self.executable = self._make_executable(self.captured)

        def call(*graph_inputs: torch.Tensor) -> list[torch.Tensor]:
            if self._stop_after_capture:
                raise _CaptureOnly
            self.graph_outputs = self.executable(list(graph_inputs))
            return self.graph_outputs

        return call

    def trace(self, args: tuple, tensors: list[torch.Tensor]) -> Captured:
        """Capture the graph for ``fn(*args)`` without running it; ``tensors`` are args' leaves."""
        self._tensors = tensors
        start = time.perf_counter()
        try:
            with _dynamo_settings():
                self._compiled(*args)
        except _CaptureOnly:
            pass
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception from None
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            raise CaptureError(_explain(e)) from e
        finally:
            self._tensors = []
        assert self.captured is not None
        self.captured.seconds = time.perf_counter() - start
        return self.captured

    def run_once(self, args: tuple) -> Any:
        """Run the captured step once through Dynamo and return its Python output."""
        self._stop_after_capture = False
        try:
            with _dynamo_settings():
                return self._compiled(*args)
        finally:
            self._compiled = None


def _dynamo_settings() -> contextlib.AbstractContextManager:
    """Dynamo options for capture: logging calls inside the step (model libraries warn from
    their forward) are dropped from the graph instead of breaking it."""
    methods = {
        method
        for name, method in vars(logging.Logger).items()
        if name in _LOGGING_METHODS or name.endswith("_once")
    }
    return torch._dynamo.config.patch(ignore_logging_functions=methods)


_LOGGING_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _explain(error: Exception) -> str:
    reason = str(error).strip().split("\n\n")[0]
    return (
        f"fddp.data_parallel could not capture the step as one graph: {reason}\n"
        "Usual causes: Python control flow on tensor values (.item(), `if loss > 0`, "
        "bool(tensor)), printing tensors, or calling code outside PyTorch inside the step. "
        "Keep such code outside the step or express it with tensor ops (torch.where), or pass "
        "trace=False to run the same step eagerly (collectives bucketed, no backward overlap)."
    )
