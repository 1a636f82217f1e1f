"""Capture a step as one aten graph on fake tensors, so nothing real runs while capturing."""

from __future__ import annotations

import ast
import builtins
import collections
import contextlib
import dataclasses
import inspect
import logging
import re
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch import fx
from torch._C._dynamo.guards import GlobalStateGuard
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fddp._base import _axes, _model_calls
from fddp._base._errors import CaptureError, PrintWhileTracingWarning, UsageError
from fddp._collectives._ops import process_axis
from fddp._compiler._capture import (
    _backward_mode,
    _evidence,
    _generators,
    _guards,
    _remat_regions,
    _repeated,
    _user_frames,
)
from fddp._compiler._capture._quick_record import QuickRecord
from fddp._compiler._graph import remove_double_waits, storage
from fddp._ranks import _runtime


class _CaptureOnly(Exception):
    """Raised by the compiled stub to stop Dynamo from running the step right after capture."""


@dataclasses.dataclass(frozen=True)
class Captured:
    """An aten graph, where each of its inputs comes from and where the step's outputs go.

    ``inputs[k]`` is an index into the step's flat tensor arguments, or a tensor the step closes
    over (a module buffer, a constant), held by reference. ``outputs`` lists, per leaf of the
    step's output, ``("graph", k)`` for graph output ``k``, ``("arg", i)`` for tensor argument
    ``i`` returned as it is, or ``("const", value)``; with ``out_spec`` it rebuilds the output.
    A Dynamo capture learns them on its first run (until then they are None; see
    :meth:`DynamoCapture.run_once`). The graph itself is rewritten in place by the scheduler.
    ``models`` are the models the step ran through ``fddp.functional``: their train/eval modes
    are baked into the graph.
    """

    graph: fx.GraphModule | None  # None for a program loaded from the persistent cache
    inputs: list[int | torch.Tensor]
    seconds: float
    outputs: list[tuple[str, Any]] | None = None
    out_spec: optree.PyTreeSpec | None = None
    method: str = "make_fx"
    models: tuple[torch.nn.Module, ...] = ()
    guards: _guards.Guards | None = None  # what the trace read, checked before a reuse
    reads: list[_evidence.Read] | None = None  # the make_fx trace's recorded reads


@contextlib.contextmanager
def quiet_capture_logs() -> Iterator[None]:
    """Drop the error logs torch writes while a capture attempt fails.

    A shape error in the step makes the fake-tensor dispatcher log the failing operator's
    whole traceback (once per attempt) before the exception that says the same reaches fddp,
    which reports it in one :class:`CaptureError`.
    """
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = logging.Filter("-")  # a name no record has: drops them all
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def warn_on_printed_fakes() -> Iterator[None]:
    """Warn once when the step prints a tensor while make_fx runs it on fake tensors.

    The captured graph holds tensor operations only, so a print in the step runs this once
    and never again; the warning says so and what to do instead.
    """
    real_print = builtins.print
    warned = False

    def print_and_warn(*args: Any, **kwargs: Any) -> None:
        nonlocal warned
        real_print(*args, **kwargs)
        if not warned and _shows_fake_tensors(args):
            warned = True
            warnings.warn(
                "print() in a data_parallel step runs once, while the step is captured, and "
                "shows fake tensors (shapes and dtypes, no values): the compiled step never "
                "runs Python again. Return the values (a metrics dict) and print them after "
                "the call, or run data_parallel(step, trace=False) to debug.",
                PrintWhileTracingWarning,
                stacklevel=2,
            )

    builtins.print = print_and_warn
    try:
        yield
    finally:
        builtins.print = real_print


def _tracer(fn: Callable[..., Any]) -> Callable[..., fx.GraphModule]:
    """make_fx of ``fn`` without the torch-function mode that notes which ``torch.*`` call each
    node came from (``node.meta["torch_fn"]``, which nothing here reads): it runs Python for
    every tensor method and ``torch.*`` call of the step, about 15 % of a capture."""
    if _CAN_SKIP_TORCH_FN_METADATA:
        return make_fx(fn, _disable_torch_fn_metadata_mode=True)
    return make_fx(fn)


_CAN_SKIP_TORCH_FN_METADATA = (
    "_disable_torch_fn_metadata_mode" in inspect.signature(make_fx).parameters
)


def fake_inputs(fake_mode: FakeTensorMode, tensors: list[torch.Tensor]) -> list[FakeTensor]:
    """``fake_mode.from_tensor`` of each tensor, made directly for a plain dense tensor that
    alone owns its whole storage (a parameter, an optimizer state): ``from_tensor`` describes
    every tensor in Python, about 0.3 ms each, 0.35 s for a 32-layer model's 1,165 leaves. The
    converter's memos learn both the tensor and its storage, so a tensor the step closes over
    that is, or views, one of them gets the same fake storage as from ``from_tensor``."""
    owners = collections.Counter(_storage(x) for x in tensors)
    return [
        _fake_of_plain(fake_mode, x)
        if _DIRECT_FAKES and owners[_storage(x)] == 1 and _plain(x)
        else fake_mode.from_tensor(x)
        for x in tensors
    ]


def _storage(x: torch.Tensor) -> int:
    try:
        return storage(x)
    except (RuntimeError, NotImplementedError):  # no storage (sparse, a wrapper subclass)
        return id(x)


def _plain(x: torch.Tensor) -> bool:
    return (
        type(x) is torch.Tensor
        and x.layout == torch.strided
        and x.device.type in ("cpu", "cuda")
        and not (x.requires_grad or x.is_quantized or x.is_neg() or x.is_conj() or x._is_view())
        and x.is_contiguous()
        and x.storage_offset() == 0
        and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    )


def _fake_of_plain(fake_mode: FakeTensorMode, x: torch.Tensor) -> FakeTensor:
    converter = fake_mode.fake_tensor_converter
    found = converter._get_memo(x)
    if found is not None:
        return found
    with torch._C._DisableTorchDispatch():
        meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
        fake = FakeTensor(fake_mode, meta, x.device)
    converter.set_tensor_memo(x, fake)
    metas = converter.meta_converter
    metas.storage_memo[metas.describer.get_storage_id(x.untyped_storage())] = fake.untyped_storage()
    return fake


def _direct_fakes_available() -> bool:
    """The converter internals :func:`_fake_of_plain` fills (torch 2.13-2.15 have them)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorConverter
        from torch._subclasses.meta_utils import MetaConverter, MetaTensorDescriber
    except ImportError:  # pragma: no cover - a torch that moved them
        return False
    return (
        hasattr(FakeTensorConverter, "_get_memo")
        and hasattr(FakeTensorConverter, "set_tensor_memo")
        and hasattr(MetaConverter, "set_storage_memo")
        and hasattr(MetaTensorDescriber, "get_storage_id")
    )


_DIRECT_FAKES = _direct_fakes_available()


def _tidy(gm: fx.GraphModule) -> fx.GraphModule:
    """Double waits and dead nodes removed. make_fx builds a lazy graph module: fx writes and
    compiles its code only if it is called, and the code is generated once, after the passes."""
    remove_double_waits(gm.graph)
    gm.graph.eliminate_dead_code()
    return gm


@quiet_capture_logs()
@warn_on_printed_fakes()
def trace_with_make_fx(
    fn: Callable[..., Any], args: tuple, *, fused_backward: bool = True
) -> Captured:
    """Capture ``fn(*args)`` by running it once on fake tensors under make_fx.

    Tensors ``fn`` closes over become graph constants held by reference; non-tensor leaves of
    ``args`` and of the output are constants of this capture. ``fused_backward`` captures the
    outermost gradient as ``loss.backward()`` runs it (see ``_backward_mode``); Inductor (torch
    2.13) cannot compile some of those fused kernels (``mkldnn_rnn_layer``), so it gets the
    differentiable backward instead.
    """
    start = time.perf_counter()
    leaves, spec = optree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    outputs: dict[str, Any] = {}

    def flat_step(*tensors: torch.Tensor) -> list[torch.Tensor]:
        it = iter(tensors)
        full = [next(it) if t else x for t, x in zip(is_tensor, leaves)]
        with _evidence.following():  # the step's own Python: its globals, closure variables
            out = _quickly(fn)(*optree.tree_unflatten(spec, full))
        out_leaves, outputs["spec"] = optree.tree_flatten(out)
        outputs["leaves"] = out_leaves
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = fake_inputs(fake_mode, [x for x, t in zip(leaves, is_tensor) if t])
    backward = _backward_mode.eager_backward() if fused_backward else contextlib.nullcontext()
    # the modules' attributes the trace reads, and the globals, closure variables and their
    # contents the step's own Python reads (not undone: they are the trace's side effects)
    recorder = _evidence.Recorder(whole_step=True)
    recorder.meet_functions(fn, *leaves)
    with (
        fake_mode,
        fx_traceback.preserve_node_meta(),
        backward,
        _use_lazy_graph_module(True),
        _generators.watched() as draws,
        _evidence.recording(recorder),
        _repeated.session(),  # the repeated blocks of fddp.functional models are traced once
    ):
        gm = _tracer(flat_step)(*fakes)
    if recorder.unwatched is not None:
        _runtime.log_rank0(
            "data_parallel: %s: the globals and closure variables the step reads are not "
            "checked before its program is reused (module attributes are)",
            recorder.unwatched,
        )
    drawn = _generators.message(draws)
    if drawn is not None:
        raise _own_capture_error(drawn)
    mapping, k = [], 0
    for leaf in outputs["leaves"]:
        if isinstance(leaf, torch.Tensor):
            mapping.append(("graph", k))
            k += 1
        else:
            mapping.append(("const", leaf))
    return Captured(
        _tidy(gm),
        list(range(len(fakes))),
        time.perf_counter() - start,
        mapping,
        outputs["spec"],
        reads=list(recorder.reads.values()),
    )


def lower_to_aten(
    gm: fx.GraphModule, example_inputs: list[torch.Tensor], *, fused_backward: bool = True
) -> fx.GraphModule:
    """Re-trace a Dynamo graph into aten ops on fake tensors, keeping node annotations."""
    fake_mode = detect_fake_mode(example_inputs)
    assert fake_mode is not None  # Dynamo hands its backend fake example inputs
    fakes = [fake_mode.from_tensor(t) for t in example_inputs]
    interpreter = _backward_mode.Interpreter if fused_backward else fx.Interpreter
    with fake_mode, fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True):
        aten = _tracer(_quickly(interpreter(gm).run))(*fakes)
    return _tidy(aten)


def _quickly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with :class:`QuickRecord` on and ``torch.utils.checkpoint`` intercepted
    (inside a make_fx trace)."""

    def run(*args: Any) -> Any:
        with QuickRecord(), _remat_regions.intercepted():
            return fn(*args)

    return run


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
    """One Dynamo compilation of ``fn(*args)``.

    :meth:`trace` stops right after capture and returns the aten graph; the caller builds a
    runner for it; :meth:`run_once` then runs the step once through Dynamo with that runner
    (Dynamo knows how to rebuild the step's Python outputs from graph outputs).
    """

    def __init__(self, fn: Callable[..., Any], *, fused_backward: bool = True) -> None:
        self._fused_backward = fused_backward
        self._runner: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
        self._graph_outputs: list[torch.Tensor] = []
        self._output_nodes: list[fx.Node] = []
        self._scalar_reads: list[fx.Node] = []
        self._refused: CaptureError | None = None  # raised again by every later run
        self._captured: Captured | None = None
        self._tensors: list[torch.Tensor] = []
        self._compiled = torch.compile(
            _fresh_function(fn), backend=self._backend, fullgraph=True, dynamic=False
        )

    def _backend(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        positions = {id(t): i for i, t in enumerate(self._tensors)}
        inputs: list[int | torch.Tensor] = [positions.get(id(t), t) for t in example_inputs]
        aten = lower_to_aten(gm, example_inputs, fused_backward=self._fused_backward)
        self._scalar_reads = [n for n in gm.graph.nodes if _reads_scalar(n)]
        if self._scalar_reads and _sizes_from_data(aten.graph):
            raise _sizes_from_data_error(self._scalar_reads[0])
        self._captured = Captured(aten, inputs, 0.0, method="dynamo")
        self._output_nodes = list(optree.tree_leaves(gm.graph.output_node().args[0]))

        def call(*graph_inputs: torch.Tensor) -> list[torch.Tensor]:
            if self._runner is None:
                raise _CaptureOnly
            self._graph_outputs = self._runner(list(graph_inputs))
            return self._graph_outputs

        return call

    def trace(
        self,
        args: tuple,
        tensors: list[torch.Tensor],
        make_fx_error: BaseException | None = None,
    ) -> Captured:
        """Capture the graph for ``fn(*args)`` without running it; ``tensors`` are args' leaves.

        Raises:
            CaptureError: from :func:`capture_error`, with what ``make_fx`` said before (if it
                was tried) and what Dynamo says now.
        """
        self._tensors = tensors
        start = time.perf_counter()
        try:
            with _dynamo_settings():
                self._compiled(*args)
        except _CaptureOnly:
            pass
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception from None
        except Exception as e:
            raise capture_error(make_fx_error, e) from None
        finally:
            self._tensors = []
        assert self._captured is not None
        return dataclasses.replace(self._captured, seconds=time.perf_counter() - start)

    def run_once(
        self, args: tuple, runner: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    ) -> tuple[Any, list[torch.Tensor]]:
        """Run the step once through Dynamo, its graph by ``runner``.

        Returns:
            The step's Python output and the graph outputs it was built from.
        """
        if self._refused is not None:
            raise self._refused
        self._runner = runner
        try:
            with _dynamo_settings():
                out = self._compiled(*args)
        except DataDependentOutputException as e:  # Inductor compiles no tensor-to-Python read
            if not self._scalar_reads:
                raise
            self._refused = _value_read_error(self._scalar_reads[0], returned=False)
            raise self._refused from e
        finally:
            del self._compiled  # one run: Dynamo's compiled code and cache entry go with it
        read = _values_read_into_python(out, self._graph_outputs, self._output_nodes)
        if read is not None:
            self._refused = _value_read_error(read, returned=True)
            raise self._refused
        return out, self._graph_outputs


def _values_read_into_python(
    out: Any, graph_outputs: list[Any], nodes: list[fx.Node]
) -> fx.Node | None:
    """The graph output Dynamo turned into a Python value of the step's output (``.item()``,
    ``float(t)``, ``int(t)``, ``.tolist()``, ``.numpy()``), if there is one.

    Dynamo runs such a conversion after the graph, in Python that the compiled step never runs
    again; fddp would return the first call's value forever. A graph output that is not a tensor
    leaf of ``out`` either became such a value or a side effect Dynamo replays (a tensor stored
    on a module); it is the former when it holds a scalar read from a tensor, or when ``out``
    holds a numpy value.
    """
    leaves = optree.tree_leaves(out)
    returned = {id(x) for x in leaves if isinstance(x, torch.Tensor)}
    arrays = any(type(x).__module__ == "numpy" for x in leaves)
    for value, node in zip(graph_outputs, nodes):
        if id(value) in returned:
            continue
        source = _scalar_source(node)
        if source is not None or arrays:
            return source or node
    return None


def _scalar_source(node: fx.Node) -> fx.Node | None:
    """The node that read a Python scalar from a tensor (``.item()``), when ``node`` is that
    scalar or a tensor made back from it (Dynamo's ``torch.scalar_tensor(x.item())``)."""
    found: fx.Node | None = None
    at: fx.Node | None = node
    while at is not None:
        if _is_scalar(at):
            found = at
        at = next((a for a in at.all_input_nodes if _is_scalar(a)), None)
    return found


def _reads_scalar(node: fx.Node) -> bool:
    """Whether ``node`` makes a Python scalar of a tensor (``.item()``, ``int(t)``)."""
    return _is_scalar(node) and any(
        isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes
    )


def _is_scalar(node: fx.Node) -> bool:
    """Whether ``node`` is a Python number that Dynamo traced symbolically (read from data)."""
    return isinstance(node.meta.get("example_value"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _value_read_error(node: fx.Node, *, returned: bool) -> CaptureError:
    """The error for a step that reads a tensor's value into Python at ``node``: it returns
    the value (``returned``), or Inductor (``compile=True``) cannot compile the read."""
    frames = _stack_frames(node.meta.get("stack_trace") or "")
    where = _user_frames.where(_user_frames.user_frame(frames))
    if returned:
        what = "returns a Python value read from a tensor"
        why = (
            "The captured step runs no Python after capture, so this value would stay the one "
            "of the first call."
        )
    else:
        what = "reads a tensor's value into Python"
        why = "compile=True (Inductor) cannot compile that read; compile=False can."
    return _own_capture_error(
        f"fddp.data_parallel: the step {what} (.item(), float(t), int(t), .tolist() or "
        f".numpy()){where}\n{why} Return the tensor itself (`loss`, or `{{'loss': loss}}`) "
        "and call .item() on the step's result, outside the step; or pass trace=False to run "
        "the step eagerly."
    )


def _sizes_from_data(graph: fx.Graph) -> bool:
    """Whether a value in ``graph`` has a size read from a tensor's data."""
    return any(
        free_unbacked_symbols(leaf.shape)
        for node in graph.nodes
        for leaf in optree.tree_leaves(node.meta.get("val"))
        if isinstance(leaf, torch.Tensor)
    )


def _sizes_from_data_error(node: fx.Node) -> CaptureError:
    """The error for a step that sizes a tensor (a slice bound, a shape, a count) by a value it
    read from a tensor at ``node``."""
    frames = _stack_frames(node.meta.get("stack_trace") or "")
    where = _user_frames.where(_user_frames.user_frame(frames))
    return _own_capture_error(
        "fddp.data_parallel: the step sizes a tensor by a value it reads from a tensor (a "
        f"slice bound, a shape or a count from .item(), int(t), .tolist()){where}\n"
        "A compiled program has fixed shapes, and this one would change with the data. Keep "
        "the shape fixed and mask instead (torch.where, or multiply by (x > 0)), pad to a few "
        "fixed sizes outside the step, or pass trace=False to run the step eagerly."
    )


def _own_capture_error(message: str) -> CaptureError:
    """A :class:`CaptureError` fddp raises itself (no other capture is tried)."""
    error = CaptureError(message)
    error.make_fx_error, error.dynamo_error = None, error
    return error


def _stack_frames(text: str) -> list[traceback.FrameSummary]:
    """The frames of a traceback as FX records it in ``node.meta["stack_trace"]``."""
    found = re.finditer(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', text)
    return [
        traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3), line=m.group(4))
        for m in found
    ]


@contextlib.contextmanager
def _dynamo_settings() -> Iterator[None]:
    """Dynamo options for capture: logging calls inside the step (model libraries warn from
    their forward) are dropped from the graph instead of breaking it, and dicts of constants
    flatten with optree (see :func:`dict_pytrees_traceable`)."""
    methods = {
        method
        for name, method in vars(logging.Logger).items()
        if name in _LOGGING_METHODS or name.endswith("_once")
    }
    torch.compiler.assume_constant_result(_model_calls.note)  # Dynamo runs it while tracing
    with (
        torch._dynamo.config.patch(ignore_logging_functions=methods),
        dict_pytrees_traceable(),
        quiet_capture_logs(),
    ):
        yield


@contextlib.contextmanager
def dict_pytrees_traceable() -> Iterator[None]:
    """Let Dynamo flatten and unflatten dicts whose leaves are all constants with optree.

    Dynamo replaces optree's dict flatten and unflatten functions by Python versions whose
    metadata is a tuple of key lists, but calls the originals when every argument is a
    constant, as for an empty dict (a model without buffers, an empty aux). optree >= 0.20
    returns a ``DictMetaData`` there, which Dynamo cannot hold ("Unexpected type in sourceless
    builder"), and its unflatten cannot read the Python version's tuple. Inside the block both
    always run as the Python versions, so every dict takes the same path.
    """
    try:
        from torch._dynamo.polyfills import pytree as polyfills
    except ImportError:  # a torch without optree polyfills
        yield
        return
    flag = "__torch_dynamo_can_constant_fold_through__"
    handlers = [getattr(polyfills, n, None) for n in ("dict_flatten", "dict_unflatten")]
    handlers = [h for h in handlers if hasattr(h, flag)]
    saved = [getattr(h, flag) for h in handlers]
    for h in handlers:
        setattr(h, flag, False)
    try:
        yield
    finally:
        for h, value in zip(handlers, saved):
            setattr(h, flag, value)


_LOGGING_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _shows_fake_tensors(args: tuple) -> bool:
    """Whether printing ``args`` shows a fake tensor (also one wrapped by ``torch.func``, or
    formatted into a string)."""
    for leaf in optree.tree_leaves(args):
        if isinstance(leaf, FakeTensor):
            return True
        if isinstance(leaf, (torch.Tensor, str)) and "FakeTensor(" in (
            leaf if isinstance(leaf, str) else repr(leaf)
        ):
            return True
    return False


def _tracing_limit_errors() -> tuple[type[BaseException], ...]:
    """Errors that say make_fx cannot trace the step, not that the step itself is wrong."""
    names = [
        ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
        ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
        ("torch._subclasses.fake_tensor", "UnsupportedFakeTensorException"),
        ("torch._subclasses.fake_tensor", "UnsupportedOperatorException"),
        ("torch.fx.experimental.symbolic_shapes", "GuardOnDataDependentSymNode"),
        ("torch.fx.proxy", "TraceError"),
    ]
    found = []
    for module, name in names:
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(__import__(module, fromlist=[name]), name))
    return tuple(found)


def _chain(error: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _own_error(
    make_fx_error: BaseException | None, dynamo_error: BaseException
) -> tuple[str, traceback.FrameSummary | None] | None:
    """``("Type: message", frame)`` of the step's own error, when Dynamo stopped on one: an
    operator that rejected its inputs (a shape mismatch), an exception the step raised, a call
    with arguments the callee does not take. None when Dynamo hit a limit of tracing."""
    chain = _chain(dynamo_error)
    exc = torch._dynamo.exc
    operator_error = None
    if isinstance(dynamo_error, exc.TorchRuntimeError):
        plain = [e for e in chain if not isinstance(e, exc.TorchDynamoException)]
        operator_error = plain[-1] if plain else None
    observed = [e for e in chain if isinstance(e, getattr(exc, "ObservedException", ()))]
    bad_call = str(dynamo_error).startswith("failed to bind arguments")
    if operator_error is None and not observed and not bad_call:
        return None
    if make_fx_error is not None and not isinstance(make_fx_error, _tracing_limit_errors()):
        frames = traceback.extract_tb(make_fx_error.__traceback__)
        return _headline(make_fx_error), _user_frames.user_frame(frames)
    frame = _user_frames.user_frame(list(getattr(dynamo_error, "real_stack", None) or []))
    if operator_error is not None:
        return _headline(operator_error), frame
    if observed:
        return _observed_headline(str(observed[0])), frame
    plain = [e for e in chain if not isinstance(e, exc.TorchDynamoException)]
    callee = re.search(r"func='(\w+)'", str(dynamo_error))
    calling = f" (calling {callee.group(1)})" if callee else ""
    return (_headline(plain[0]) + calling if plain else str(dynamo_error)), frame


def _headline(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip()}"


def _observed_headline(text: str) -> str:
    """``"raised exception TypeError('msg')"`` (Dynamo's account of it) as ``"TypeError: msg"``."""
    match = re.fullmatch(r"raised exception (\w+)\((.*)\)", text.strip(), re.DOTALL)
    if match is None:
        return text
    name, args = match.groups()
    try:
        value = ast.literal_eval(args)
    except (ValueError, SyntaxError):
        value = args
    return f"{name}: {value}"


def capture_error(make_fx_error: BaseException | None, dynamo_error: BaseException) -> CaptureError:
    """One :class:`CaptureError` for a step that neither make_fx nor Dynamo could capture.

    When the step itself is wrong (a shape mismatch, a wrong argument: it would fail the same
    way eagerly) the message starts with the step's own error and where it was raised; when
    the step is fine but cannot be one graph, it starts with Dynamo's reason and says what to
    change. The two original exceptions stay on the error as ``make_fx_error`` and
    ``dynamo_error``.
    """
    own = _own_error(make_fx_error, dynamo_error)
    if own is not None:
        headline, frame = own
        message = (
            f"{headline}{_user_frames.where(frame)}\n"
            "fddp.data_parallel ran the step on fake tensors (the arguments' shapes and "
            "dtypes, no values) to capture it, and the step raised this error: it fails the "
            "same way when run eagerly. data_parallel(step, trace=False) runs it eagerly, for "
            "a debugger."
        )
    else:
        message = _explain(dynamo_error, make_fx_error)
    result = CaptureError(message)
    result.make_fx_error, result.dynamo_error = make_fx_error, dynamo_error
    return result


def _explain(error: BaseException, make_fx_error: BaseException | None) -> str:
    """Why Dynamo could not make the step one graph, and what to change."""
    text = str(error).strip()
    said = text.split("\n")[0]
    lowered = text.lower()
    if "print" in lowered:
        reason = "it prints a tensor"
        hint = (
            "A traced step runs no Python after capture: return the values (a metrics dict) "
            "and print them outside the step."
        )
    elif any(w in lowered for w in ("item", "data-dependent", "data dependent", "jump")):
        reason = "it uses a tensor's value in Python (.item(), `if loss > 0`, bool(tensor))"
        hint = "Express it with tensor ops (torch.where), or move it outside the step."
    else:
        reason, said = said, ""
        hint = (
            "Usual causes: Python control flow on tensor values (.item(), `if loss > 0`), "
            "printing tensors, or code outside PyTorch inside the step: keep it outside the "
            "step or express it with tensor ops (torch.where)."
        )
    notes = [f"Dynamo: {said}"] if said else []
    if make_fx_error is not None:
        line = str(make_fx_error).strip().split("\n")[0]
        notes.append(f"make_fx, tried first: {type(make_fx_error).__name__}: {line}")
    frames = list(getattr(error, "real_stack", None) or [])
    where = _user_frames.where(
        _user_frames.user_frame(frames) or getattr(error, "innermost_user_frame_summary", None)
    )
    return (
        f"fddp.data_parallel could not capture the step as one graph: {reason}{where}\n"
        f"{hint} Or pass trace=False to run the same step eagerly (collectives bucketed, no "
        "backward overlap)." + "".join(f"\n({note})" for note in notes)
    )


def capture(
    fn: Callable[..., Any],
    args: tuple,
    tensors: list[torch.Tensor],
    *,
    fused_backward: bool,
    method: str = "make_fx",
) -> tuple[Captured, DynamoCapture | None]:
    """make_fx first; Dynamo for steps make_fx cannot trace (Hugging Face models branch on
    tensor values unless Dynamo compiles them), or at once when ``method`` is ``"dynamo"``
    (the step needed it before: its make_fx attempt would fail again, after seconds of
    tracing). The Dynamo capture comes back too: its first run goes through Dynamo
    (:meth:`DynamoCapture.run_once`).

    Raises:
        UsageError: a mistake fddp names itself, as it is.
        CaptureError: what both make_fx and Dynamo said.
    """
    torch_state = GlobalStateGuard()  # as the step is called: autocast, grad mode ...
    with _model_calls.noting() as models:
        captured, dynamo = _capture_graph(
            fn, args, tensors, fused_backward=fused_backward, method=method
        )
    ran = tuple(models)
    # a Dynamo capture records no reads: every attribute of the models it ran stands in
    reads = captured.reads if captured.reads is not None else _evidence.state_reads(ran)
    guards = _guards.Guards(reads, torch_state, _guards.module_names(ran), _constants(captured))
    return dataclasses.replace(captured, models=ran, guards=guards, reads=None), dynamo


def _constants(captured: Captured) -> frozenset[int]:
    """The ids of the tensors a capture holds by reference: its constant inputs and the graph's
    attributes."""
    found = [t for t in captured.inputs if isinstance(t, torch.Tensor)]
    if captured.graph is not None:
        found += [
            getattr(captured.graph, n.target)
            for n in captured.graph.graph.nodes
            if n.op == "get_attr" and isinstance(n.target, str)
        ]
    return frozenset(id(t) for t in found if isinstance(t, torch.Tensor))


def capture_step(
    step_fn: Callable[..., Any],
    args: tuple,
    *,
    axis_name: str = "data",
    group: dist.ProcessGroup | None = None,
) -> Captured:
    """``step_fn`` captured as ``fddp.data_parallel(step_fn)`` captures it for the FX backend
    over ``group`` (default: the world), before any pass: a developer entry point
    (docs/architecture.md) for benchmarks that schedule the graph themselves."""
    tensors = [x for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    with _axes.bind(process_axis(axis_name, group, traced=True)):
        return capture(step_fn, args, tensors, fused_backward=True)[0]


def _capture_graph(
    fn: Callable[..., Any],
    args: tuple,
    tensors: list[torch.Tensor],
    *,
    fused_backward: bool,
    method: str,
) -> tuple[Captured, DynamoCapture | None]:
    make_fx_error: BaseException | None = None
    try:
        if method != "dynamo":
            return trace_with_make_fx(fn, args, fused_backward=fused_backward), None
    except (UsageError, CaptureError):
        raise
    except Exception as e:
        make_fx_error = e
        _runtime.log_rank0(
            "data_parallel: make_fx could not trace %s (%s: %s); capturing with Dynamo",
            getattr(fn, "__name__", "the step"),
            type(e).__name__,
            str(e).split("\n")[0],
        )
    dynamo = DynamoCapture(fn, fused_backward=fused_backward)
    return dynamo.trace(args, tensors, make_fx_error), dynamo
