"""Trace a model's repeated blocks once; other calls of an identical block replay its graph."""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import dataclasses
import dis
import enum
import functools
import operator
import struct
import threading
import types
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
from fddp._compiler._capture import _backward_mode, _quick_record
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

# a capture's templates by the key of the calls they serve (None: not replayable)
_Templates = dict[Any, "_Template | None"]
_IN_TEMPLATE = threading.local()  # the template's own trace calls the blocks as they are
ENABLED = True  # tests compare captures with and without


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


def session() -> contextlib.AbstractContextManager[Any]:
    """Within the block (fddp's make_fx capture), the models ``fddp.functional`` runs replay
    their repeated blocks (children of a ``ModuleList`` or ``Sequential`` with at least two
    identical siblings) where they can."""
    if not (_quick_record._AVAILABLE and ENABLED):
        return contextlib.nullcontext()
    return _model_calls.watching(functools.partial(_replaying, _Session()))


@dataclasses.dataclass
class _Session:
    templates: _Templates = dataclasses.field(default_factory=dict)
    # what the blocks of one structure read besides their tensors (None: not replayable)
    reads: dict[Any, _Reads | None] = dataclasses.field(default_factory=dict)


# the forwards _replaying installs on blocks: not part of a block's structure (each block's is
# its own closure)
_REPLAYING_FORWARDS: dict[int, Callable[..., Any]] = {}


def _installed(value: Any) -> bool:
    return _REPLAYING_FORWARDS.get(id(value)) is value


@contextlib.contextmanager
def _replaying(session: _Session, model: nn.Module) -> Iterator[None]:
    patched = []
    try:
        for block in _repeated_children(model):
            if "forward" in block.__dict__:
                continue
            original = block.forward
            block.forward = _replaying_forward(block, original, session)
            _REPLAYING_FORWARDS[id(block.forward)] = block.forward
            patched.append(block)
        yield
    finally:
        for block in patched:
            _REPLAYING_FORWARDS.pop(id(block.forward), None)
            del block.forward


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    """Each child that has at least two identical siblings."""
    found = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds: dict[Any, list[nn.Module]] = {}
        for child in module.children():
            key = _structure(child)
            if key is not None:
                kinds.setdefault(key, []).append(child)
        # one template costs about two traced blocks: worth it from three
        found += [c for group in kinds.values() if len(group) >= 3 for c in group]
    return found


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)


def _plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain_value(v) for v in value)
    return isinstance(value, _PLAIN) or (callable(value) and hasattr(value, "__qualname__"))


def _structure(block: nn.Module) -> Any:
    """What a block's forward may depend on besides its tensors (its classes, flags and plain
    attributes), or None for a block with hooks or attributes this cannot compare."""
    parts = []
    for name, module in block.named_modules(remove_duplicate=False):
        attributes = []
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers", "_modules") or _installed(value):
                continue
            if key in _HOOKS or key.endswith("_hooks"):
                if value:
                    return None
                continue
            if key.startswith("_") and isinstance(value, (dict, set)) and not value:
                continue
            if not _plain_value(value):
                return None
            attributes.append((key, _hashable(value)))
        parts.append((name, type(module), tuple(attributes)))
    return tuple(parts)


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


# ---- what a block's code reads besides its tensors and attributes ----

# code that reads no state a replay could get wrong: its functions are ops, its classes make
# new objects (a torch.Generator kept in a global is an object, refused as one)
_TRUSTED = frozenset(
    {
        "torch",
        "fddp",
        "math",
        "cmath",
        "operator",
        "_operator",
        "functools",
        "itertools",
        "typing",
        "builtins",
        "warnings",
        "_warnings",
    }
)
_IMMUTABLE = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    type(NotImplemented),
    range,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
# builtins that write, look up attributes or namespaces by a name the code computes, tell
# objects apart (``id``), or have effects a replay would run once
_DENIED_BUILTINS = frozenset(
    [
        "setattr",
        "delattr",
        "getattr",
        "hasattr",
        "vars",
        "globals",
        "locals",
        "exec",
        "eval",
        "compile",
        "__import__",
        "open",
        "input",
        "print",
        "breakpoint",
        "id",
        "hash",
        "repr",
    ]
)
# attribute names that write (modules, objects, dicts) or read an object's namespace; and
# ``register_*``: hooks and state a template would add once
_DENIED_NAMES = frozenset(
    [
        "__dict__",
        "__setattr__",
        "__delattr__",
        "__setstate__",
        "__setitem__",
        "__delitem__",
        "__hash__",
        "add_module",
        "train",
        "eval",
        "requires_grad_",
        "zero_grad",
        "load_state_dict",
        "set_extra_state",
        "_apply",
        "share_memory",
    ]
)
# special methods the language calls on a user class's objects without naming them, other
# than these (constructors are followed where the class is called)
_NOT_IMPLICIT = frozenset(
    [
        "__init__",
        "__new__",
        "__post_init__",
        "__init_subclass__",
        "__set_name__",
        "__class_getitem__",
        "__getstate__",
        "__setstate__",
        "__reduce__",
        "__reduce_ex__",
        "__del__",
        "__copy__",
        "__deepcopy__",
        "__setattr__",
        "__delattr__",
        "__dir__",
        "__repr__",
    ]
)
_CONSTRUCTORS = ("__new__", "__init__", "__post_init__")
_WRITES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL"})


@dataclasses.dataclass(frozen=True, eq=False)
class _Place:
    """A value a block's code reads: a name in a namespace (a module's globals, builtins), in
    a class (looked up along its MRO) or a closure cell."""

    kind: str  # "dict", "class" or "cell"
    where: Any
    name: str
    seen: Any  # the value the code was analysed with
    plain: bool  # immutable: keyed by value; else it must stay the object analysed

    def read(self) -> Any:
        if self.kind == "cell":
            return self.where.cell_contents
        if self.kind == "class":
            return _class_attribute(self.where, self.name)[1]
        return self.where[self.name]


@dataclasses.dataclass(frozen=True)
class _Reads:
    places: tuple[_Place, ...]

    def values(self) -> tuple[Any, ...]:
        """The plain values read now, for the key; raises when an object read differs from
        the one analysed."""
        found = []
        for place in self.places:
            try:
                value = place.read()
            except (KeyError, ValueError) as e:  # a global deleted, a cell emptied
                raise _NotReplayable(f"{place.name} is gone") from e
            if place.plain:
                if not _immutable(value):
                    raise _NotReplayable(f"{place.name} is no longer a plain value")
                found.append(_hashable(value))
            elif value is not place.seen:
                raise _NotReplayable(f"{place.name} is not what was analysed")
        return tuple(found)


def _reads_of(block: nn.Module) -> _Reads | None:
    """What ``block``'s forward may read besides its tensors and attributes, or None where it
    may write state (attributes, globals, closure cells), read mutable state (a list, a dict, a
    ``ContextVar``, an object's attributes) or do what this cannot follow."""
    walk = _Walk()
    try:
        for module in block.modules():
            walk.class_(type(module), constructed=False)
            for value in vars(module).values():
                if callable(value) and not isinstance(value, nn.Module):
                    walk.value(value, None)
        walk.names.update(("forward", "__call__", "backward", "setup_context"))
        walk.run()
    except _NotReplayable:
        return None
    return _Reads(tuple(walk.places.values()))


def _argument_reads(others: list[Any], session: _Session) -> tuple[Any, ...]:
    """The reads of the functions among a call's plain arguments (raises where one is not
    replayable)."""
    found = []
    for value in others:
        if callable(value):
            if value not in session.reads:
                walk = _Walk()
                try:
                    walk.value(value, None)
                    walk.run()
                    session.reads[value] = _Reads(tuple(walk.places.values()))
                except _NotReplayable:
                    session.reads[value] = None
            reads = session.reads[value]
            if reads is None:
                raise _NotReplayable(f"{value} is not replayable")
            found.append(reads.values())
    return tuple(found)


class _Walk:
    """A conservative reading of Python code: every function it may call (found by name, as
    the code's globals, closure cells and attribute names resolve in the classes and modules
    it reaches), what those read, and whether any writes."""

    def __init__(self) -> None:
        self.places: dict[tuple[str, int, str], _Place] = {}
        self.names: set[str] = set()  # attribute names the code loads
        self.namespaces: dict[int, Any] = {}  # user classes and modules, by id
        self.constructed: set[int] = set()  # user classes the code may call
        # functions to read, each with the argument name its attribute writes may go to (a
        # constructor's new object), else None
        self.pending: list[tuple[types.FunctionType, str | None]] = []
        self.functions: set[int] = set()
        self.resolved: set[tuple[int, str]] = set()

    def run(self) -> None:
        while True:
            while self.pending:
                self.function(*self.pending.pop())
            denied = {n for n in self.names if n in _DENIED_NAMES or n.startswith("register_")}
            if denied:
                raise _NotReplayable(f"uses {sorted(denied)}")
            todo = [
                (space, name)
                for space in list(self.namespaces.values())
                for name in sorted(self.names)
                if (id(space), name) not in self.resolved
            ]
            if not todo and not self.pending:
                return
            for space, name in todo:
                self.resolved.add((id(space), name))
                self.attribute(space, name)

    def attribute(self, space: Any, name: str) -> None:
        if isinstance(space, type):
            owner, value = _class_attribute(space, name)
            if owner is None:
                return
            place = _place("class", space, name, value)
            if not _trusted(owner.__module__):
                self.value(value, place)
            elif place.plain:  # torch's default, which a user class may set per layer
                self.places[("class", id(space), name)] = place
        elif name in vars(space):
            namespace = vars(space)
            self.value(namespace[name], _place("dict", namespace, name, namespace[name]))

    def class_(self, klass: type, *, constructed: bool) -> None:
        """Read ``klass``'s attributes by name from now on, and its special methods; its
        constructors too where the code may call it."""
        for owner in klass.__mro__:
            if _trusted(owner.__module__):
                continue
            if id(owner) not in self.namespaces:
                self.namespaces[id(owner)] = owner
                for name, value in vars(owner).items():
                    if _special(name) and name not in _NOT_IMPLICIT and _holds_code(value):
                        self.value(value, None)
            if constructed and id(owner) not in self.constructed:
                self.constructed.add(id(owner))
                for name in _CONSTRUCTORS:
                    method = vars(owner).get(name)
                    if isinstance(method, staticmethod):  # __new__
                        method = method.__func__
                    if isinstance(method, types.FunctionType):
                        # __new__'s first argument is the class: it writes no attribute
                        new_object = None if name == "__new__" else method.__code__.co_varnames[0]
                        self.pending.append((method, new_object))

    def value(self, value: Any, place: _Place | None) -> None:
        """Note ``value`` (read at ``place``), or raise if a replay cannot rely on it."""
        if place is not None:
            self.places[(place.kind, id(place.where), place.name)] = place
        if _immutable(value) or isinstance(value, enum.Enum):
            return
        if isinstance(value, (tuple, frozenset)):  # isinstance's classes, say
            for item in value:
                self.value(item, None)
        elif isinstance(value, types.ModuleType):
            if not _trusted(value.__name__) and id(value) not in self.namespaces:
                self.namespaces[id(value)] = value
                if "__getattr__" in vars(value):  # names it makes on demand (submodules)
                    self.value(vars(value)["__getattr__"], None)
        elif isinstance(value, type):
            self.class_(value, constructed=True)
        elif isinstance(value, types.FunctionType):
            if hasattr(value, "__wrapped__"):  # a decorator's wrapper
                self.value(value.__wrapped__, None)
            if not _trusted(value.__module__):
                self.pending.append((value, None))
        elif isinstance(value, (staticmethod, classmethod)):
            self.value(value.__func__, None)
        elif isinstance(value, property):
            self.value(value.fget, None)
        elif isinstance(value, types.MethodType):
            if not isinstance(value.__self__, type):
                raise _NotReplayable(f"{value} is a method bound to an object")
            self.value(value.__self__, None)
            self.value(value.__func__, None)
        elif isinstance(value, types.BuiltinFunctionType):
            owner = value.__self__
            if owner is builtins and value.__name__ in _DENIED_BUILTINS:
                raise _NotReplayable(f"calls {value.__name__}")
            if not (
                owner is None
                or isinstance(owner, types.ModuleType)
                or _immutable(owner)
                or (isinstance(owner, type) and _trusted(owner.__module__))  # tuple.__new__
            ):
                raise _NotReplayable(f"{value} is a method bound to an object")
        elif not isinstance(value, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            raise _NotReplayable(f"reads a {type(value).__name__}")

    def function(self, function: types.FunctionType, self_name: str | None) -> None:
        if id(function) in self.functions:
            return
        self.functions.add(id(function))
        code = function.__code__
        for default in (*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()):
            self.value(default, None)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # not yet bound
                continue
            self.value(content, _place("cell", cell, name, content))
        self.code(code, function.__globals__, frozenset(code.co_freevars), self_name)

    def code(
        self,
        code: types.CodeType,
        namespace: dict[str, Any],
        cells: frozenset[str],
        self_name: str | None = None,
    ) -> None:
        """``cells``: the free variables that are cells of no function within this walk;
        ``self_name``: the argument whose attributes the code may write (``self.x = ...``)."""
        previous = None
        for instruction in dis.get_instructions(code):
            op, name = instruction.opname, instruction.argval
            if op in _WRITES and not (
                op == "STORE_ATTR"
                and self_name is not None
                and previous is not None
                and (previous.opname, previous.argval) == ("LOAD_FAST", self_name)
            ):
                raise _NotReplayable(f"{op} {name}")
            if op in ("STORE_DEREF", "DELETE_DEREF") and name in cells:
                raise _NotReplayable(f"writes the closure's {name}")
            if op in ("LOAD_GLOBAL", "LOAD_NAME"):
                self.global_(namespace, name)
            elif op == "IMPORT_NAME" and not _trusted(name):
                raise _NotReplayable(f"imports {name}")
            elif "ATTR" in op or op == "LOAD_METHOD":
                self.names.add(name)
            previous = instruction
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, namespace, cells & frozenset(const.co_freevars))

    def global_(self, namespace: dict[str, Any], name: str) -> None:
        if name not in namespace:
            namespace = namespace.get("__builtins__", vars(builtins))
            if isinstance(namespace, types.ModuleType):
                namespace = vars(namespace)
            if name not in namespace:
                raise _NotReplayable(f"reads {name}, which is not defined")
        self.value(namespace[name], _place("dict", namespace, name, namespace[name]))


def _holds_code(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, staticmethod, classmethod, property))


def _special(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _place(kind: str, where: Any, name: str, value: Any) -> _Place:
    return _Place(kind, where, name, value, _immutable(value))


def _class_attribute(klass: type, name: str) -> tuple[type | None, Any]:
    """The class along ``klass``'s MRO that defines ``name``, and its value there."""
    for owner in klass.__mro__:
        if name in vars(owner):
            return owner, vars(owner)[name]
    return None, None


def _trusted(module: str | None) -> bool:
    return module is not None and module.partition(".")[0] in _TRUSTED


def _immutable(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


def _replaying_forward(
    block: nn.Module, original: Callable[..., Any], session: _Session
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_TEMPLATE, "on", False) or not _may_replay():
            return original(*args, **kwargs)
        structure = _structure(block)  # now: a parent may set an attribute before each call
        if structure is None:
            return original(*args, **kwargs)
        if structure not in session.reads:
            session.reads[structure] = _reads_of(block)
        reads = session.reads[structure]
        leaves, spec = optree.tree_flatten((args, kwargs))
        tensor_args = [x for x in leaves if isinstance(x, torch.Tensor)]
        others = [x for x in leaves if not isinstance(x, torch.Tensor)]
        # a cache object, say, or a list the block appends to: the template would change its
        # own copy, rebuilt from the spec
        if reads is None or not _plain_value(others) or _holds_mutable((args, kwargs)):
            return original(*args, **kwargs)
        state = {
            **dict(block.named_parameters(remove_duplicate=False)),
            **dict(block.named_buffers(remove_duplicate=False)),
        }
        names = tuple(state)
        inputs = [*tensor_args, *state.values()]
        try:
            key = (
                structure,
                spec,
                _hashable(others),
                names,
                tuple(map(_tensor_key, inputs)),
                reads.values(),
                _argument_reads(others, session),
            )
            hash(key)
        except (TypeError, _NotReplayable):
            return original(*args, **kwargs)
        templates = session.templates
        tracked = get_proxy_mode().tracer.tensor_tracker  # type: ignore[union-attr]
        if any(tracked.get(_unwrapped(x)) is None for x in inputs):
            return original(*args, **kwargs)
        if key not in templates:
            templates[key] = _template(block, spec, leaves, names, inputs)
        template = templates[key]
        if template is None:
            return original(*args, **kwargs)
        outs = _Replay.apply(_Call(template), *inputs)
        it = iter(outs)
        return optree.tree_unflatten(
            template.out_spec,
            [next(it) if x is None else x for x in template.out_leaves],
        )

    return forward


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
) -> _Template | None:
    wants_grad = [x.requires_grad and x.is_floating_point() for x in inputs]
    metas = [(tuple(x.shape), x.stride(), x.dtype, x.device) for x in map(_unwrapped, inputs)]
    n_args = len(inputs) - len(names)
    result: list[Any] = []

    def trace() -> None:
        _IN_TEMPLATE.on = True
        try:
            result.append(_trace_template(block, spec, leaves, names, n_args, metas, wants_grad))
        except Exception as e:  # the block is traced as it is instead
            result.append(e)
        finally:
            _IN_TEMPLATE.on = False

    # the caller's context variables, which the block's code or torch's may read
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(trace,), name="fddp-block-template")
    thread.start()
    thread.join()
    found = result[0]
    return found if isinstance(found, _Template) else None


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
        with interpreter.lower():  # the values written are plain fake tensors, wrapped after
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
