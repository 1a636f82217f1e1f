"""Trace a model's repeated blocks once; other calls of an identical block replay its graph."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import fx, nn
from torch._C import _functorch
from torch._functorch.pyfunctorch import TransformType, retrieve_all_functorch_interpreters
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fddp._base import _model_calls
from fddp._compiler._capture import _backward_mode, _evidence, _quick_record
from fddp._compiler._capture._opcode_trace import Unfollowed
from fddp._compiler._graph import mutated_inputs, storage

if _quick_record._AVAILABLE:
    from torch.fx.experimental.proxy_tensor import (
        ProxyTorchDispatchMode,
        _ProxyTensor,
        get_proxy_mode,
        make_fx,
        set_proxy_slot,
    )

    _CAPTURE_MODES = (ProxyTorchDispatchMode, FakeTensorMode, _quick_record.QuickRecord)

_IN_TEMPLATE = threading.local()  # the template's own trace calls the blocks as they are
ENABLED = True  # tests compare captures with and without
MAX_TEMPLATES = 2  # per kind of call: beyond, the blocks' reads keep differing; trace them


class _NotReplayable(Exception):
    """The block (or its template) is outside what a replay writes exactly as make_fx would."""


@dataclasses.dataclass(frozen=True)
class _Step:
    """One template node to write: its arguments name earlier template nodes."""

    node: fx.Node
    target: Any  # an aten OpOverload, or operator.getitem
    result: str  # "item" (getitem), "view", "written" (an in-place op's), or "fresh"
    written: tuple[tuple[int, str], ...]  # for "written": each written argument's place, name


@dataclasses.dataclass
class _Template:
    forward: list[_Step]
    backward: list[_Step]
    inputs: list[fx.Node]  # placeholders: the call's tensor arguments, then its state
    cotangents: list[fx.Node]  # placeholders: one per tensor output
    outputs: list[fx.Node]  # the forward's tensor outputs
    grads: list[fx.Node | None]  # per input, None where the input needs no gradient
    # the inputs and outputs whose storage the backward reads: autograd's version check on
    # them stops a caller that writes one in place before the backward, as make_fx's would
    read_inputs: list[int]
    read_outputs: list[int]
    out_spec: Any
    out_leaves: list[Any]  # the output's leaves, tensors as None
    graph_module: fx.GraphModule  # keeps the nodes' graph alive
    reads: list[_evidence.Read] = dataclasses.field(default_factory=list)  # block-relative


@dataclasses.dataclass
class _Kind:
    """The templates of one kind of call (block structure, arguments, tensor layouts): each
    is reused for a call whose block reads what its own block read."""

    templates: list[_Template] = dataclasses.field(default_factory=list)
    closed: bool = False  # a template wrote state, or the reads kept differing: trace them all


def session() -> contextlib.AbstractContextManager[Any]:
    """Within the block (fddp's make_fx capture), the models ``fddp.functional`` runs replay
    their repeated blocks (children of a ``ModuleList`` or ``Sequential`` with at least two
    identical siblings) where the evidence allows."""
    if not (_quick_record._AVAILABLE and ENABLED):
        return contextlib.nullcontext()
    return _model_calls.watching(functools.partial(_replaying, {}))


@contextlib.contextmanager
def _replaying(kinds: dict[Any, _Kind], model: nn.Module) -> Iterator[None]:
    patched = []
    try:
        for block in _repeated_children(model):
            if "forward" in block.__dict__:
                continue
            block.forward = _replaying_forward(block, block.forward, kinds)
            patched.append(block)
        yield
    finally:
        for block in patched:
            del block.forward


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    """Each child that has at least two identical siblings."""
    found = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds: dict[Any, list[nn.Module]] = {}
        for child in module.children():
            kinds.setdefault(_structure(child), []).append(child)
        # one template costs about two traced blocks: worth it from three
        found += [c for group in kinds.values() if len(group) >= 3 for c in group]
    return found


def _structure(block: nn.Module) -> Any:
    """A block's module tree: each module's place, class, and its own parameters' and
    buffers' names and shapes. Blocks of one structure may compute alike; what their code
    reads decides whether they do (:class:`_Kind`)."""
    return tuple(
        (name, type(module), _shapes(module._parameters), _shapes(module._buffers))
        for name, module in block.named_modules(remove_duplicate=False)
    )


def _shapes(tensors: dict[str, torch.Tensor | None]) -> tuple:
    return tuple((k, None if v is None else tuple(v.shape)) for k, v in tensors.items())


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain_value(v) for v in value)
    return isinstance(value, _PLAIN) or (callable(value) and hasattr(value, "__qualname__"))


def _hashable(value: Any) -> Any:
    """A key equal for equal values of one type only: floats by their bits (``0.0`` is not
    ``-0.0``, a NaN is itself)."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_hashable(v) for v in value))
    if isinstance(value, float):
        return (type(value), struct.pack("<d", value))
    if isinstance(value, complex):
        return (type(value), struct.pack("<dd", value.real, value.imag))
    if isinstance(value, frozenset):
        return (type(value), frozenset(_hashable(v) for v in value))
    return (type(value), value)


def _replaying_forward(
    block: nn.Module, original: Callable[..., Any], kinds: dict[Any, _Kind]
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_TEMPLATE, "on", False):
            recorder = getattr(_IN_TEMPLATE, "recorder", None)
            if recorder is None or _evidence.recorder() is not None:  # a block in the block
                return original(*args, **kwargs)
            # the template's first run (its probe) is recorded; its trace runs the same Python
            # again, which reads the same and, where the first wrote nothing, writes nothing
            _IN_TEMPLATE.recorder = None
            with _evidence.recording(recorder):
                out = original(*args, **kwargs)
            if recorder.writes or recorder.refused is not None:
                raise _NotReplayable("the template wrote, or read what cannot be compared")
            return out
        if not _may_replay():
            return original(*args, **kwargs)
        main = _evidence.recorder()
        with _evidence.paused(), Unfollowed():
            found = _replay_for(block, args, kwargs, kinds)
        if found is None:
            return original(*args, **kwargs)
        template, inputs = found
        if main is not None:
            main.absorb(template.reads, block)
        with Unfollowed():
            outs = _Replay.apply(_Call(template), *inputs)
        it = iter(outs)
        return optree.tree_unflatten(
            template.out_spec,
            [next(it) if x is None else x for x in template.out_leaves],
        )

    forward._fddp_installed = True  # type: ignore[attr-defined]
    return forward


def _replay_for(
    block: nn.Module, args: tuple, kwargs: dict[str, Any], kinds: dict[Any, _Kind]
) -> tuple[_Template, list[torch.Tensor]] | None:
    """The template this call of ``block`` replays and its tensors, or None: the block is
    traced as it is."""
    if any(getattr(block, hooks) for hooks in _HOOKS):
        return None  # they run around this call: a template traced with them would run twice
    if any(_own_lookup(type(m)) for m in block.modules()):
        return None  # its attribute reads would not be recorded
    leaves, spec = optree.tree_flatten((args, kwargs))
    tensor_args = [x for x in leaves if isinstance(x, torch.Tensor)]
    others = [x for x in leaves if not isinstance(x, torch.Tensor)]
    # a cache object, say, or a list the block appends to: the template would change its
    # own copy, rebuilt from the spec
    if not _plain_value(others) or _holds_mutable((args, kwargs)):
        return None
    state = {
        **dict(block.named_parameters(remove_duplicate=False)),
        **dict(block.named_buffers(remove_duplicate=False)),
    }
    names = tuple(state)
    inputs = [*tensor_args, *state.values()]
    try:
        key = (
            _structure(block),
            spec,
            _hashable(others),
            names,
            tuple(map(_tensor_key, inputs)),
        )
        hash(key)
    except (TypeError, _NotReplayable):
        return None
    tracked = get_proxy_mode().tracer.tensor_tracker  # type: ignore[union-attr]
    if any(tracked.get(_unwrapped(x)) is None for x in inputs):
        return None
    kind = kinds.setdefault(key, _Kind())
    paths = _evidence.module_paths(block)
    for template in kind.templates:
        if _evidence.first_difference(template.reads, block, paths) is None:
            return template, inputs
    if kind.closed or len(kind.templates) >= MAX_TEMPLATES:
        kind.closed = True
        return None
    made = _template(block, spec, leaves, names, inputs, kind, paths)
    return None if made is None else (made, inputs)


def _own_lookup(kind: type) -> bool:
    """Whether a module class looks its attributes up its own way (``__getattribute__``)."""
    return any("__getattribute__" in vars(k) for k in kind.__mro__ if k not in (nn.Module, object))


def _holds_mutable(arguments: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether a call's arguments hold a list, dict or set (``kwargs`` itself aside)."""
    args, kwargs = arguments
    pending = [*args, *kwargs.values()]
    while pending:
        value = pending.pop()
        if isinstance(value, (list, dict, set)):
            return True
        if isinstance(value, tuple):
            pending.extend(value)
    return False


def _may_replay() -> bool:
    """Exactly one gradient transform, outermost and not differentiated again, make_fx
    recording below it (see ``_backward_mode``), and none of the thread's own settings that
    change what a block traces (autocast, saved-tensor hooks as activation checkpointing sets,
    torch-function or dispatch modes of the user's): the template is traced in a thread of its
    own, without them."""
    stack = retrieve_all_functorch_interpreters()
    return (
        len(stack) == 1
        and stack[0].key() == TransformType.Grad
        and torch.is_grad_enabled()
        and _backward_mode.is_active()
        and get_proxy_mode() is not None
        and not torch._C._is_any_autocast_enabled()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and torch._C._len_torch_function_stack() == 0
        and all(isinstance(m, _CAPTURE_MODES) for m in _get_current_dispatch_mode_stack())
        and not any(_global_hooks())
    )


def _global_hooks() -> tuple[dict[Any, Any], ...]:
    """The hooks registered for every module (a template would run them once)."""
    module = nn.modules.module
    return (
        module._global_forward_hooks,
        module._global_forward_pre_hooks,
        module._global_backward_hooks,
        module._global_backward_pre_hooks,
    )


def _tensor_key(x: torch.Tensor) -> tuple:
    """What the template's trace reads of a tensor: its layout, its functorch level and
    whether it needs a gradient (``_template``'s ``wants_grad``)."""
    level, requires_grad = _functorch.maybe_get_level(x), x.requires_grad
    x = _unwrapped(x)
    if type(x) is not FakeTensor or x.constant is not None:
        raise _NotReplayable("not a plain fake tensor")
    if not all(type(s) is int for s in (*x.shape, *x.stride())):
        raise _NotReplayable("symbolic sizes")
    return (tuple(x.shape), x.stride(), x.dtype, x.device, level, requires_grad)


def _unwrapped(x: torch.Tensor) -> torch.Tensor:
    while _functorch.is_functorch_wrapped_tensor(x):
        x = _functorch.get_unwrapped(x)
    return x


# ---- the template: the block's vjp traced alone, in a thread with no transforms or modes ----


def _template(
    block: nn.Module,
    spec: Any,
    leaves: list[Any],
    names: tuple[str, ...],
    inputs: list[torch.Tensor],
    kind: _Kind,
    paths: dict[int, str],
) -> _Template | None:
    """The block's vjp traced alone, its forward's Python recorded (:mod:`_evidence`); None
    where the recording found no evidence or a write (put back, so that the block is traced
    as it is, as if the template had not run): no call of this kind is replayed then."""
    wants_grad = [x.requires_grad and x.is_floating_point() for x in inputs]
    metas = [(tuple(x.shape), x.stride(), x.dtype, x.device) for x in map(_unwrapped, inputs)]
    n_args = len(inputs) - len(names)
    recorder = _evidence.Recorder(paths=paths)
    result: list[Any] = []

    def trace() -> None:
        _IN_TEMPLATE.on, _IN_TEMPLATE.recorder = True, recorder
        try:
            result.append(_trace_template(block, spec, leaves, names, n_args, metas, wants_grad))
        except Exception as e:  # the block is traced as it is instead
            result.append(e)
        finally:
            _IN_TEMPLATE.on, _IN_TEMPLATE.recorder = False, None

    # the caller's context variables, which the block's code or torch's may read
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(trace,), name="fddp-block-template")
    thread.start()
    thread.join()
    found = result[0]
    if not isinstance(found, _Template) or recorder.writes or recorder.refused is not None:
        kind.closed = True
        return None
    found.reads = list(recorder.reads.values())
    kind.templates.append(found)
    return found


def _trace_template(
    block: nn.Module,
    spec: Any,
    leaves: list[Any],
    names: tuple[str, ...],
    n_args: int,
    metas: list[tuple],
    wants_grad: list[bool],
) -> _Template:
    fake_mode = FakeTensorMode()
    with fake_mode:
        fakes = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in metas]

    def call(*tensors: torch.Tensor) -> list[torch.Tensor]:
        it = iter(tensors[:n_args])
        args, kwargs = optree.tree_unflatten(
            spec, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
        )
        state = dict(zip(names, tensors[n_args:]))
        out = torch.func.functional_call(block, state, args, kwargs, tie_weights=False)
        out_leaves, out_spec = optree.tree_flatten(out)
        box["spec"], box["leaves"] = out_spec, out_leaves
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    box: dict[str, Any] = {}
    with fake_mode:
        probe = call(*fakes)  # the outputs' layouts, for the cotangents
        cotangents = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype) for o in probe]
    if not all(o.is_floating_point() for o in probe):
        raise _NotReplayable("an output that is not floating point")
    marks: dict[str, int] = {}

    def joint(*flat: torch.Tensor) -> list[Any]:
        ins, cts = list(flat[: len(fakes)]), list(flat[len(fakes) :])
        diff = [i for i, w in enumerate(wants_grad) if w]

        def f(*d: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(ins)
            for i, x in zip(diff, d):
                full[i] = x
            return tuple(call(*full))

        outs, vjp_fn = torch.func.vjp(f, *[ins[i] for i in diff])[:2]
        marks["forward"] = len(get_proxy_mode().tracer.graph.nodes)  # type: ignore[union-attr]
        grads = vjp_fn(tuple(cts))
        per_input: list[Any] = [None] * len(ins)
        for i, g in zip(diff, grads):
            per_input[i] = g
        return [*outs, *per_input]

    with fake_mode:
        gm = make_fx(joint)(*fakes, *cotangents)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    boundary = marks["forward"] - len(placeholders)
    _check(body, placeholders)
    steps = [_step(node) for node in body]
    forward, backward = steps[:boundary], steps[boundary:]
    flat_out = list(output.args[0])
    outs, grads = flat_out[: len(probe)], flat_out[len(probe) :]
    inputs = {storage(p.meta["val"]) for p in placeholders[: len(fakes)]}
    if any(not isinstance(o, fx.Node) or storage(o.meta["val"]) in inputs for o in outs):
        raise _NotReplayable("an output that is an input or a view of one")
    # autograd sees a replay's outputs as unrelated tensors: a write to one would not reach
    # the other, nor its gradient
    if len({storage(o.meta["val"]) for o in outs}) < len(outs):
        raise _NotReplayable("outputs that share storage")
    if any(g is not None and (not isinstance(g, fx.Node)) for g in grads):
        raise _NotReplayable("a gradient that is not a node")
    out_leaves = [None if isinstance(x, torch.Tensor) else x for x in box["leaves"]]
    if not all(_plain_value(x) for x in out_leaves):
        raise _NotReplayable("an output leaf that is not a tensor or a plain value")
    read = {
        storage(arg.meta["val"])
        for step in backward
        for arg in step.node.all_input_nodes
        if arg.op != "placeholder" or arg in placeholders[: len(fakes)]
        if isinstance(arg.meta.get("val"), torch.Tensor)
    }
    return _Template(
        forward,
        backward,
        inputs=placeholders[: len(fakes)],
        cotangents=placeholders[len(fakes) :],
        outputs=outs,
        grads=grads,
        read_inputs=[
            i for i, p in enumerate(placeholders[: len(fakes)]) if storage(p.meta["val"]) in read
        ],
        read_outputs=[j for j, o in enumerate(outs) if storage(o.meta["val"]) in read],
        out_spec=box["spec"],
        out_leaves=out_leaves,
        graph_module=gm,
    )


def _check(body: list[fx.Node], placeholders: list[fx.Node]) -> None:
    """Only aten ops with tensor results that keep their tensors' metadata, none writing a
    placeholder's storage."""
    inputs = {storage(p.meta["val"]) for p in placeholders}
    for node in body:
        if node.op != "call_function":
            raise _NotReplayable(f"a {node.op} node")
        if node.target is operator.getitem:
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise _NotReplayable(f"calls {node.target}")
        if torch.Tag.inplace_view in node.target.tags or node.target in _RESIZES:
            raise _NotReplayable(f"{node.target} changes a tensor's metadata in place")
        if node.target.namespace not in ("aten", "prims"):
            raise _NotReplayable(f"calls {node.target}")
        schema = node.target._schema
        for ret in schema.returns:
            if str(ret.type) not in ("Tensor", "Tensor[]", "List[Tensor]"):
                raise _NotReplayable(f"{node.target} returns {ret.type}")
        for written in mutated_inputs(node):  # batch norm's running statistics too
            if storage(written.meta["val"]) in inputs:
                raise _NotReplayable(f"{node.target} writes an input")


_RESIZES = {
    getattr(packet, overload)
    for packet in (torch.ops.aten.resize_, torch.ops.aten.resize_as_, torch.ops.aten.set_)
    for overload in packet.overloads()
}


# ---- the replay ----


@dataclasses.dataclass
class _Call:
    template: _Template
    env: dict[fx.Node, tuple[Any, Any]] = dataclasses.field(default_factory=dict)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        template = call.template
        tracer = get_proxy_mode().tracer  # type: ignore[union-attr]
        tracked = tracer.tensor_tracker
        for placeholder, x in zip(template.inputs, inputs):
            call.env[placeholder] = (tracked[x].proxy.node, x)
        _write(template.forward, call.env, tracer.graph)
        return tuple(_result(call.env[o], tracer) for o in template.outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        call: _Call = inputs[0]
        ctx.call = call
        ctx.save_for_backward(
            *(inputs[1 + i] for i in call.template.read_inputs),
            *(output[j] for j in call.template.read_outputs),
        )

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        template = call.template
        # unpacking raises if the caller wrote one of them in place after the forward
        ctx.saved_tensors  # noqa: B018
        tracer = get_proxy_mode().tracer  # type: ignore[union-attr]
        tracked = tracer.tensor_tracker
        interpreter = retrieve_all_functorch_interpreters()[-1]
        level = interpreter.level()
        env = dict(call.env)
        incoming = {}
        for placeholder, c in zip(template.cotangents, cotangents):
            plain = _unwrapped(c)
            env[placeholder] = (tracked[plain].proxy.node, plain)
            incoming[placeholder] = c
        # the values written are plain fake tensors, wrapped after
        with interpreter.lower(), Unfollowed():
            _write(template.backward, env, tracer.graph)
            results = {g: _result(env[g], tracer) for g in template.grads if g is not None}
        grads: list[torch.Tensor | None] = [None]
        for g in template.grads:
            if g is None:
                grads.append(None)
            elif g in incoming:
                grads.append(incoming[g])
            else:
                grads.append(_functorch._wrap_for_grad(results[g], level))
        return tuple(grads)


def _result(entry: tuple[fx.Node, FakeTensor], tracer: Any) -> torch.Tensor:
    """A fresh tensor carrying ``entry``'s value and node (what the block hands back)."""
    node, value = entry
    with torch._C._DisableTorchDispatch():
        meta = value.as_strided(value.shape, value.stride(), value.storage_offset())
        out = FakeTensor(value.fake_mode, meta, value.device)
    set_proxy_slot(out, tracer, _ProxyTensor(fx.Proxy(node, tracer), None))
    return out


def _step(node: fx.Node) -> _Step:
    op = node.target
    if op is operator.getitem:
        return _Step(node, op, "item", ())
    assert isinstance(op, torch._ops.OpOverload)  # _check let only these through
    returns, arguments = op._schema.returns, op._schema.arguments
    if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return _Step(node, op, "view", ())
    if any(r.alias_info is not None and r.alias_info.is_write for r in returns):
        written = tuple(
            (i, a.name)
            for i, a in enumerate(arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        return _Step(node, op, "written", written)
    return _Step(node, op, "fresh", ())


def _write(steps: list[_Step], env: dict[fx.Node, tuple[fx.Node, Any]], graph: fx.Graph) -> None:
    """Write a template's ``steps`` into ``graph``, their arguments' nodes and values taken
    from ``env`` (template node -> (written node, value)), where each result goes too.

    Each value follows from the op's schema: a fresh tensor laid out as the template's, a view
    from the op's meta kernel on the call's own input, the written argument of an in-place op.
    """
    fake_mode = next(iter(env.values()))[1].fake_mode
    shared = _quick_record.shared_meta()

    def node_of(n: fx.Node) -> fx.Node:
        return env[n][0]

    def value_of(n: fx.Node) -> Any:
        return env[n][1]

    for step in steps:
        template = step.node
        args = fx.node.map_arg(template.args, node_of)
        kwargs = fx.node.map_arg(template.kwargs, node_of)
        if step.result == "item":
            parent, index = args
            value = value_of(template.args[0])[index]  # type: ignore[arg-type]
            new = graph.create_node("call_function", operator.getitem, (parent, index))
        else:
            new = graph.create_node(
                "call_function", step.target, args, kwargs, name=step.target.overloadpacket.__name__
            )
            new.meta["original_aten"] = step.target
            value = _value(step, fake_mode, value_of)
        new.meta.update(shared)
        new.meta["val"] = value
        env[template] = (new, value)


def _value(step: _Step, fake_mode: FakeTensorMode, value_of: Callable[[fx.Node], Any]) -> Any:
    template = step.node
    if step.result == "fresh":
        val = template.meta["val"]
        return (
            # a backward's results for inputs that need no gradient are None
            [None if v is None else _fresh(v, fake_mode) for v in val]
            if isinstance(val, (list, tuple))
            else (_fresh(val, fake_mode))
        )
    args = fx.node.map_arg(template.args, value_of)
    kwargs = fx.node.map_arg(template.kwargs, value_of)
    if step.result == "written":  # an in-place op, or an out= one, returns what it wrote
        written = [args[i] if i < len(args) else kwargs[name] for i, name in step.written]
        return written[0] if len(written) == 1 else written
    base = next(x for x in optree.tree_leaves((args, kwargs)) if isinstance(x, FakeTensor))
    metas = _quick_record.kernel_results(step.target, args, kwargs, fake_mode)
    with torch._C._DisableTorchDispatch():
        views = [FakeTensor(fake_mode, m, base.device) for m in metas]
    return views if isinstance(template.meta["val"], (list, tuple)) else views[0]


def _fresh(template_val: torch.Tensor, fake_mode: FakeTensorMode) -> FakeTensor:
    with torch._C._DisableTorchDispatch():
        meta = torch.empty_strided(
            template_val.shape, template_val.stride(), dtype=template_val.dtype, device="meta"
        )
        return FakeTensor(fake_mode, meta, template_val.device)
