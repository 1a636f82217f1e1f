"""What traced Python reads and writes besides its tensors, recorded while it runs."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import dis
import enum
import functools
import inspect
import os
import random
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch._C._dynamo.guards import GlobalStateGuard

from fddp._compiler._capture import _user_frames

MAX_NODES = 20_000  # values one snapshot may hold; a larger state is not compared
_MISSING = object()  # a name a namespace lacks, a cell not yet filled
_GONE = ("gone",)  # its snapshot
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_SITE = ("site-packages", "dist-packages")
# builtins whose result depends on what no read records (a namespace, an object's identity,
# a file) or which act once instead of per call (print, input)
_OPAQUE_BUILTINS = frozenset(
    {
        "globals",
        "locals",
        "vars",
        "eval",
        "exec",
        "compile",
        "__import__",
        "breakpoint",
        "input",
        "open",
        "print",
        "id",
        "hash",
        "repr",
        "setattr",
        "delattr",
    }
)
# reads of a module's own machinery (its member dicts, read through ``__getattr__`` as members)
_MODULE_INTERNALS = frozenset({"__dict__", "__class__", "_parameters", "_buffers", "_modules"})
_SCALARS = (
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
_BY_IDENTITY = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    property,
    staticmethod,
    classmethod,
    enum.Enum,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


class NoEvidence(Exception):
    """The code read or did what cannot be checked again (a C object's state, an import)."""


@functools.cache
def is_library_file(filename: str | None) -> bool:
    """Whether code in ``filename`` is torch's, optree's, fddp's or the standard library's
    (whose own state a trace does not change); third-party packages and the user's code are
    not."""
    if not filename:
        return False
    path = os.path.abspath(filename)
    if path.startswith(_STDLIB):
        return not any(part in path[len(_STDLIB) :] for part in _SITE)
    return path.startswith(_user_frames._LIBRARY_DIRS)


def _library_frame(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs library code; generated code (a dataclass's ``__init__``, whose
    file is ``<string>``) counts as its caller's."""
    while frame is not None and frame.f_code.co_filename.startswith("<"):
        frame = frame.f_back
    return frame is None or is_library_file(frame.f_code.co_filename)


def _is_library(obj: Any) -> bool:
    """Whether a class or module is defined by library code (see :func:`is_library_file`)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if name in ("builtins", "__main__") or name is None:
        return name == "builtins"
    module = sys.modules.get(name)
    return is_library_file(getattr(module, "__file__", None)) or name in sys.builtin_module_names


# ---- snapshots: values in a form whose == is "the trace would read the same" ----


class _Same:
    """An object compared by identity inside a snapshot."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@dataclasses.dataclass
class _Snapping:
    """One snapshot's context: module paths for a block-relative snapshot, what was met."""

    paths: Mapping[int, str] | None  # id of each module of the block -> its path in the block
    strict: bool  # unknown objects raise NoEvidence, else compare by identity
    met: Callable[[Any], None] | None = None  # told of each mutable object and function met
    # the ids of a program's constant tensors: a tensor is one of them (by identity) or not
    # (a parameter swapped in, an activation kept); None: every tensor by identity
    constants: frozenset[int] | None = None
    seen: dict[int, int] = dataclasses.field(default_factory=dict)
    nodes: int = 0


def snapshot(
    value: Any,
    paths: Mapping[int, str] | None = None,
    *,
    strict: bool = True,
    met: Callable[[Any], None] | None = None,
    constants: frozenset[int] | None = None,
) -> Any:
    """``value`` as nested tuples: scalars by type and bits, containers and plain objects by
    their contents, modules by identity (or, in ``paths``, by their place in the block and
    type), code, classes and library modules by identity.

    Raises:
        NoEvidence: (``strict``) an object whose state cannot be read (a generator of C, a
            context variable), or more than :data:`MAX_NODES` values.
    """
    return _snap(value, _Snapping(paths, strict, met, constants))


def _snap(value: Any, s: _Snapping) -> Any:
    if value is _MISSING:
        return _GONE
    s.nodes += 1
    if s.nodes > MAX_NODES:
        raise NoEvidence(f"reads more than {MAX_NODES} values")
    kind = type(value)
    if isinstance(value, float) and kind is float:
        return (float, value.hex() if value == value else repr(value))  # the sign of zero too
    if isinstance(value, complex) and kind is complex:
        return (kind, value.real.hex(), value.imag.hex())
    if isinstance(value, _SCALARS):
        return (kind, value)
    if isinstance(value, torch.Tensor):
        if s.constants is not None and id(value) not in s.constants:
            return (torch.Tensor,)
        return (torch.Tensor, _Same(value))
    if isinstance(value, weakref.ref):  # a cache's reference (an LSTM's to its weights)
        return (weakref.ref, _snap(_MISSING if value() is None else value(), s))
    if isinstance(value, nn.Module):
        path = None if s.paths is None else s.paths.get(id(value))
        return (nn.Module, kind, path) if path is not None else (nn.Module, _Same(value))
    if isinstance(value, (types.FunctionType, *_BY_IDENTITY)):
        if s.met is not None and isinstance(value, types.FunctionType):
            s.met(value)
        return (kind, _Same(value))
    if id(value) in s.seen:
        return ("again", s.seen[id(value)])
    s.seen[id(value)] = len(s.seen)
    if isinstance(value, (tuple, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        return (kind, tuple(_snap(v, s) for v in items), _extra(value, s))
    if s.met is not None:
        s.met(value)
    if isinstance(value, (list, set, collections.deque)):
        return (kind, tuple(_snap(v, s) for v in value), _extra(value, s))
    if isinstance(value, dict):
        factory = getattr(value, "default_factory", None)
        items = tuple((_snap(k, s), _snap(v, s)) for k, v in value.items())
        return (kind, _snap(factory, s), items, _extra(value, s))
    if isinstance(value, types.MethodType):
        return (kind, _snap(value.__func__, s), _snap(value.__self__, s))
    if isinstance(value, functools.partial):
        return (kind, _snap(value.func, s), _snap(value.args, s), _snap(value.keywords, s))
    if isinstance(value, random.Random):
        return (kind, _Same(value), value.getstate())
    if isinstance(value, type):
        if _is_library(value):
            return (type, _Same(value))
        names = [n for n in vars(value) if n not in ("__dict__", "__weakref__", "__doc__")]
        return (type, _Same(value), tuple((n, _snap(vars(value)[n], s)) for n in names))
    if isinstance(value, types.ModuleType):
        if _is_library(value):
            return (types.ModuleType, _Same(value))
        names = [n for n in vars(value) if not (n.startswith("__") and n.endswith("__"))]
        return (types.ModuleType, _Same(value), tuple((n, _shallow(vars(value)[n])) for n in names))
    state = _state(value)
    if state is not None and not _hidden_state(kind):
        return (kind, _Same(value), tuple((n, _snap(v, s)) for n, v in state))
    if s.strict:
        raise NoEvidence(f"reads a {kind.__qualname__}, whose state fddp cannot compare")
    return (kind, _Same(value))


def _extra(value: Any, s: _Snapping) -> Any:
    """The attributes of a container subclass's object, if it has any."""
    state = getattr(value, "__dict__", None)
    return tuple((n, _snap(v, s)) for n, v in state.items()) if state else ()


def _shallow(value: Any) -> Any:
    """A user module's entry: scalars by value, anything else by identity."""
    if type(value) is float:
        return (float, value.hex() if value == value else repr(value))
    return (type(value), value) if isinstance(value, _SCALARS) else _Same(value)


def _state(value: Any) -> list[tuple[str, Any]] | None:
    """An object's attributes (its ``__dict__`` and slots), None when it has neither."""
    found = []
    d = getattr(value, "__dict__", None)
    if isinstance(d, dict):
        found += list(d.items())
    for klass in type(value).__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((name, getattr(value, name)))
    return found if (isinstance(d, dict) or found) else None


_HEAP_TYPE = 1 << 9


def _hidden_state(kind: type) -> bool:
    """Whether objects of ``kind`` may keep state outside their attributes: a class of C
    (other than ``object``) among its bases."""
    return any(not k.__flags__ & _HEAP_TYPE for k in kind.__mro__[:-1])


# ---- reads ----


@dataclasses.dataclass(frozen=True)
class Read:
    """One value the code read: ``owner``'s ``name`` read as ``kind``, which gave ``expected``.

    ``kind``: "instance" (the owner's own attribute), "member" (a module's parameter, buffer or
    child), "class" (an attribute found on the owner's class), "global" (a name in a namespace
    dict: globals, builtins, ``sys.modules``), "cell" (a closure variable) or "state" (the
    whole contents of a container, a plain object, a user class or module, a generator).
    ``owner`` is the object, or for a block-relative read a module's path in the block.
    """

    owner: Any
    kind: str
    name: str
    expected: Any
    owner_type: type | None = None  # the owner's class, for "class" reads
    value: Any = _MISSING  # what was read (for messages, and as a quick check)
    by_identity: bool = False  # the same object again is the same value (no contents)

    def current(
        self,
        owner: Any,
        paths: Mapping[int, str] | None,
        strict: bool,
        constants: frozenset[int] | None = None,
    ) -> Any:
        """What reading this again from ``owner`` gives now, as a snapshot."""
        try:
            value = _raw_read(owner, self.kind, self.name, self.owner_type)
        except _Gone:
            return _GONE
        if self.kind == "member" and isinstance(value, torch.Tensor):
            return self.expected  # the call's own parameter or buffer: an input, not a value
        return snapshot(value, paths, strict=strict, constants=constants)


class _Gone(Exception):
    pass


def _raw_read(owner: Any, kind: str, name: str, owner_type: type | None) -> Any:
    """Read without running the owner's Python (no properties, no ``__getattr__``)."""
    try:
        if kind == "instance":
            return object.__getattribute__(owner, "__dict__")[name]
        if kind == "member":
            d = object.__getattribute__(owner, "__dict__")
            for members in ("_parameters", "_buffers", "_modules"):
                if name in d[members]:
                    return d[members][name]
            raise _Gone
        if kind == "class":
            if type(owner) is not owner_type:
                raise _Gone
            d = getattr(owner, "__dict__", None)
            attribute = class_attribute(owner_type, name)
            if attribute is _MISSING or (
                isinstance(d, dict) and name in d and not _is_data_descriptor(attribute)
            ):
                raise _Gone
            return attribute
        if kind == "global":
            return owner[name]
        if kind == "cell":
            return owner.cell_contents
        assert kind == "state"
        return owner
    except (KeyError, ValueError, AttributeError, TypeError) as e:
        raise _Gone from e


def class_attribute(klass: type, name: str) -> Any:
    """``name`` as found along ``klass``'s MRO (``_MISSING`` if nowhere)."""
    for owner in klass.__mro__:
        if name in vars(owner):
            return vars(owner)[name]
    return _MISSING


def _is_data_descriptor(attribute: Any) -> bool:
    kind = type(attribute)
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


# ---- the recorder ----


class _Local(threading.local):
    recorder: Recorder | None = None


_LOCAL = _Local()
_PATCHES = threading.Lock()
_installed = 0
_ORIGINAL_GETATTR = nn.Module.__getattr__


class Recorder:
    """Records the reads of the Python that runs in this thread within :meth:`recording`.

    Attribute reads of modules are seen everywhere (``nn.Module``'s attribute lookup is wrapped
    for the duration). With ``trace_code`` the thread's Python outside torch, fddp and the
    standard library is also followed opcode by opcode: the globals and closure variables it
    loads, the imports it makes, the builtins it calls that read what no record sees, and its
    writes to globals and closure variables. Every container, plain object, user class or
    module, and generator met is compared again afterwards: a difference is a write.

    ``paths`` (id of each module of a block -> its path) makes the reads of those modules
    relative to the block, so they can be read again from another block of the same structure.
    """

    def __init__(self, *, trace_code: bool, paths: Mapping[int, str] | None = None) -> None:
        self.trace_code = trace_code
        self.paths = paths
        self.reads: dict[tuple[int, str, str], Read] = {}
        self.keep: list[Any] = []  # the owners read, alive while their ids key ``reads``
        self.writes: list[str] = []
        self.refused: str | None = None
        self._met: dict[int, tuple[Any, Any, Any]] = {}  # id -> (object, snapshot, copy)
        self._modules: dict[int, tuple[nn.Module, list[dict]]] = {}  # id -> module, its dicts
        self._functions: dict[types.CodeType, list[types.FunctionType]] = {}
        self._made: set[types.CodeType] = set()  # code nested in code that ran here
        self._undo: list[Callable[[], None]] = []
        self._busy = False
        self._instructions: dict[types.CodeType, dict[int, dis.Instruction]] = {}

    # -- what the wrapped attribute lookup and the opcode trace report --

    def module_read(self, module: nn.Module, name: str, value: Any, member: bool) -> None:
        if (
            name in _MODULE_INTERNALS
            or self.refused is not None
            or isinstance(module, fx.GraphModule)
        ):
            return  # a graph module is the capture's own
        self._busy = True
        try:
            self._module_read(module, name, value, member)
        finally:
            self._busy = False

    def _module_read(self, module: nn.Module, name: str, value: Any, member: bool) -> None:
        if self.trace_code and id(module) not in self._modules:
            self._modules[id(module)] = (module, _module_dicts(module))
        owner: Any = module
        if self.paths is not None and id(module) in self.paths:
            owner = _Path(self.paths[id(module)])
        if member:
            kind = "member"
        else:
            d = object.__getattribute__(module, "__dict__")
            attribute = class_attribute(type(module), name)
            kind = "instance" if name in d and not _is_data_descriptor(attribute) else "class"
            if kind == "class":
                value = attribute
        if kind == "instance" and getattr(value, "_fddp_installed", False):
            return  # a replaying forward fddp put on the block: not the block's own
        self._read(owner, kind, name, value, type(module) if kind == "class" else None)

    def _read(self, owner: Any, kind: str, name: str, value: Any, owner_type: type | None) -> None:
        """Note a read (the caller holds ``_busy``: a snapshot runs no recorded code)."""
        key = (id(owner) if not isinstance(owner, _Path) else hash(owner), kind, name)
        if key in self.reads:
            return
        try:
            expected = (
                (torch.Tensor, None)
                if kind == "member" and isinstance(value, torch.Tensor)
                else snapshot(value, self.paths, strict=self.trace_code, met=self._meet)
            )
        except NoEvidence as e:
            self.refused = f"{_describe_owner(owner)}.{name} {e}"
            return
        self.reads[key] = Read(
            owner, kind, name, expected, owner_type, value, _immutable_or_code(value)
        )
        self.keep.append(owner)

    def _meet(self, value: Any) -> None:
        """A function (kept for its closure cells) or a mutable object (compared afterwards)."""
        if isinstance(value, types.FunctionType):
            known = self._functions.setdefault(value.__code__, [])
            if not any(f is value for f in known):
                known.append(value)
            return
        if id(value) in self._met or not self.trace_code:
            return
        before = snapshot(value, self.paths, strict=False)
        self._met[id(value)] = (value, before, _copy(value))

    def absorb(self, reads: list[Read], block: nn.Module) -> None:
        """Record ``reads`` (a template's, relative to its block) as read from ``block``."""
        self._busy = True
        try:
            for read in reads:
                owner = resolve(read.owner, block)
                try:
                    value = _raw_read(owner, read.kind, read.name, read.owner_type)
                except _Gone:
                    value = _MISSING
                self._read(owner, read.kind, read.name, value, read.owner_type)
        finally:
            self._busy = False

    # -- the opcode trace --

    def _trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "call" or self._busy or self.refused is not None:
            return None
        code = frame.f_code
        if _library_frame(frame):
            return None
        self._made.update(c for c in code.co_consts if isinstance(c, types.CodeType))
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._opcode

    def _opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "opcode" or self.refused is not None:
            return self._opcode
        code = frame.f_code
        table = self._instructions.get(code)
        if table is None:
            table = self._instructions[code] = {i.offset: i for i in dis.get_instructions(code)}
        instruction = table.get(frame.f_lasti)
        if instruction is None:
            return self._opcode
        op, name = instruction.opname, instruction.argval
        self._busy = True
        try:
            self._handle(frame, op, name, instruction, table)
        finally:
            self._busy = False
        return self._opcode

    def _handle(
        self, frame: types.FrameType, op: str, name: Any, instruction: dis.Instruction, table: dict
    ) -> None:
        code = frame.f_code
        if op == "LOAD_GLOBAL":
            self._global(frame, name)
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and name in code.co_freevars:
            self._cell(frame, name, write=False)
        elif op in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
            self._cell(frame, name, write=True)
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            self._global_write(frame, name)
        elif op == "IMPORT_NAME":
            self._import(frame, instruction, table)
        elif op == "LOAD_NAME":
            self.refused = f"runs code that looks up {name} by name (a class body, exec)"

    def _global(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        if name not in namespace:
            self._read(namespace, "global", name, _MISSING, None)
            namespace = frame.f_builtins
        value = namespace.get(name, _MISSING)
        if namespace is frame.f_builtins and name in _OPAQUE_BUILTINS:
            self.refused = f"calls {name}()"
            return
        self._read(namespace, "global", name, value, None)

    def _cell(self, frame: types.FrameType, name: str, *, write: bool) -> None:
        code = frame.f_code
        if code in self._made:
            return  # a closure made while recording: its cells are the recording's own
        cell = self._cell_of(frame, name)
        if cell is None:
            self.refused = f"reads the closure variable {name} of a function it cannot find"
            return
        if write:
            self.writes.append(f"writes the closure variable {name} of {code.co_name}")
            old = _cell_value(cell)
            self._undo.append(lambda: _set_cell(cell, old))
            return
        self._read(cell, "cell", name, _cell_value(cell), None)

    def _cell_of(self, frame: types.FrameType, name: str) -> types.CellType | None:
        """The cell behind ``frame``'s free variable ``name``: from the one function met with
        this code whose closure holds what the frame holds."""
        code = frame.f_code
        values = frame.f_locals
        found = [
            f
            for f in self._functions.get(code, ())
            if f.__closure__ is not None
            and all(
                n not in values or _cell_value(c) is values[n]
                for n, c in zip(code.co_freevars, f.__closure__)
            )
        ]
        if len(found) != 1:
            return None
        return dict(zip(code.co_freevars, found[0].__closure__ or ()))[name]

    def _global_write(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        self.writes.append(f"writes the global {name} of {namespace.get('__name__')}")
        old = namespace.get(name, _MISSING)
        self._undo.append(lambda: _set_item(namespace, name, old))

    def _import(self, frame: types.FrameType, instruction: dis.Instruction, table: dict) -> None:
        offsets = sorted(o for o in table if o < instruction.offset)
        level = table[offsets[-2]].argval if len(offsets) >= 2 else None
        name = instruction.argval
        if level != 0 or name not in sys.modules:
            self.refused = f"imports {name}"
            return
        self._read(sys.modules, "global", name, sys.modules[name], None)

    # -- afterwards --

    def changed(self) -> list[str]:
        """The objects and modules met whose contents differ now from when first met."""
        found = []
        for value, before, _ in self._met.values():
            if snapshot(value, self.paths, strict=False) != before:
                found.append(f"changes a {type(value).__qualname__}")
        for module, dicts in self._modules.values():
            if not _same_dicts(_module_dicts(module), dicts):
                found.append(f"changes the attributes of a {type(module).__qualname__}")
        return found

    def undo(self) -> bool:
        """Put back every write recorded and every object met as it was first met; whether
        everything could be."""
        complete = True
        for value, _, saved in self._met.values():
            complete &= _restore(value, saved)
        for module, dicts in self._modules.values():
            for now, saved in zip(_live_dicts(module), dicts):
                now.clear()
                now.update(saved)
        for step in reversed(self._undo):
            step()
        self._undo.clear()
        return complete


@dataclasses.dataclass(frozen=True)
class _Path:
    """A module's place in the block a relative read is made from."""

    path: str


_CLASS_FIXED = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"})


def _live_dicts(module: nn.Module) -> list[dict]:
    d = object.__getattribute__(module, "__dict__")
    return [d, d["_parameters"], d["_buffers"], d["_modules"]]


def _module_dicts(module: nn.Module) -> list[dict]:
    """Copies of a module's attributes and its parameters, buffers and children."""
    return [dict(d) for d in _live_dicts(module)]


def _same_dicts(a: list[dict], b: list[dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(x[k] is y[k] for k in x) for x, y in zip(a, b, strict=True)
    )


def _describe_owner(owner: Any) -> str:
    if isinstance(owner, _Path):
        return f"self.{owner.path}" if owner.path else "self"
    if isinstance(owner, dict):
        return str(owner.get("__name__", "a namespace"))
    return type(owner).__qualname__


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


def _set_cell(cell: types.CellType, value: Any) -> None:
    if value is _MISSING:
        del cell.cell_contents
    else:
        cell.cell_contents = value


def _set_item(namespace: dict, name: str, value: Any) -> None:
    if value is _MISSING:
        namespace.pop(name, None)
    else:
        namespace[name] = value


def _copy(value: Any) -> Any:
    """What :func:`_restore` needs to put ``value``'s contents back."""
    if isinstance(value, random.Random):
        return value.getstate()
    if isinstance(value, (list, set)):
        return list(value)
    if isinstance(value, dict):
        return list(value.items())
    state = getattr(value, "__dict__", None)
    if isinstance(value, type):
        return dict(vars(value))
    return dict(state) if isinstance(state, dict) else None


def _restore(value: Any, saved: Any) -> bool:
    if isinstance(value, type):
        for name in set(vars(value)) - set(saved):
            delattr(value, name)
        for name, item in saved.items():
            if vars(value).get(name, _MISSING) is not item and name not in _CLASS_FIXED:
                setattr(value, name, item)
    elif isinstance(value, random.Random):
        value.setstate(saved)
    elif isinstance(value, list):
        value[:] = saved
    elif isinstance(value, (set, dict)):
        value.clear()
        value.update(saved)
    elif isinstance(saved, dict):
        vars(value).clear()
        vars(value).update(saved)
    else:
        return False
    return True


# ---- the wrapped attribute lookup of modules ----


def _recorded_getattribute(self: nn.Module, name: str) -> Any:
    recorder = _LOCAL.recorder
    if recorder is None or recorder._busy:
        return object.__getattribute__(self, name)
    try:
        value = object.__getattribute__(self, name)
    except AttributeError:
        # a parameter, buffer or child: ``__getattr__`` (torch.fx wraps it while tracing)
        getattr_ = type(self).__getattr__
        value = getattr_(self, name)
        if inspect.unwrap(getattr_) is not _ORIGINAL_GETATTR:
            recorder.refused = f"{type(self).__qualname__} makes its attributes (__getattr__)"
        recorder.module_read(self, name, value, member=True)
        return value
    recorder.module_read(self, name, value, member=False)
    return value


@contextlib.contextmanager
def _module_reads_wrapped() -> Iterator[None]:
    global _installed
    with _PATCHES:
        if _installed == 0:
            nn.Module.__getattribute__ = _recorded_getattribute  # type: ignore[method-assign,assignment]
        _installed += 1
    try:
        yield
    finally:
        with _PATCHES:
            _installed -= 1
            if _installed == 0:
                del nn.Module.__getattribute__


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Within the block, this thread's reads are ``recorder``'s. Afterwards its ``writes`` also
    hold the objects met that changed, a draw from Python's random generator and a change of
    torch's global state (autocast, grad mode); with ``trace_code``, what was written is put
    back as it was (the caller traces the code again, or not at all)."""
    if recorder.trace_code and sys.gettrace() is not None:  # a debugger's or coverage's
        recorder.refused = "runs under another trace function"
    outer = _LOCAL.recorder
    _LOCAL.recorder = recorder
    recorder._modules.clear()  # parameters swapped in for this run differ from the last's
    torch_state = GlobalStateGuard()
    python_random = random.getstate()
    tracing = recorder.trace_code and recorder.refused is None
    try:
        with _module_reads_wrapped():
            if tracing:
                sys.settrace(recorder._trace)
            try:
                yield recorder
            finally:
                if tracing:
                    sys.settrace(None)
    finally:
        _LOCAL.recorder = outer
        if recorder.trace_code:  # also when the code raised: what it wrote is put back
            _check_writes(recorder, torch_state, python_random)


def _check_writes(recorder: Recorder, torch_state: GlobalStateGuard, python_random: Any) -> None:
    if not torch_state.check():
        recorder.writes.append(f"changes torch's {torch_state.reason().strip()}")
    if random.getstate() != python_random:
        recorder.writes.append("draws from Python's random generator")
        recorder._undo.append(lambda: random.setstate(python_random))
    recorder.writes += recorder.changed()
    if recorder.writes:
        recorder.undo()


def paused() -> contextlib.AbstractContextManager[Any]:
    """No reads of this thread recorded within the block (fddp's own lookups)."""
    return _Paused()


class _Paused:
    def __enter__(self) -> None:
        self._recorder = _LOCAL.recorder
        _LOCAL.recorder = None

    def __exit__(self, *exc: object) -> None:
        _LOCAL.recorder = self._recorder


def recorder() -> Recorder | None:
    """This thread's recorder, if one is recording."""
    return _LOCAL.recorder


# ---- reading again ----


def resolve(owner: Any, block: nn.Module | None) -> Any:
    """The owner of a read: the object itself, or the module at a relative path of ``block``."""
    if not isinstance(owner, _Path):
        return owner
    assert block is not None
    module: Any = block
    for part in owner.path.split(".") if owner.path else ():
        module = object.__getattribute__(module, "__dict__")["_modules"][part]
    return module


def module_paths(block: nn.Module) -> dict[int, str]:
    """The id of each module of ``block`` (itself included) -> its first path in it."""
    found: dict[int, str] = {}
    for name, module in block.named_modules(remove_duplicate=False):
        found.setdefault(id(module), name)
    return found


def _immutable_or_code(value: Any) -> bool:
    """Whether the same object is always the same snapshot (nothing inside it can change)."""
    if isinstance(value, tuple):
        return type(value) in (tuple, torch.Size) and all(map(_immutable_or_code, value))
    if isinstance(value, (type, types.ModuleType)):
        return _is_library(value)  # a user's class or module: its attributes too
    return isinstance(value, (*_SCALARS, types.FunctionType, *_BY_IDENTITY, torch.Tensor)) or (
        value is _MISSING
    )


class Guards:
    """What a capture read besides its tensors and torch's global state (autocast, grad mode,
    default dtype ...), checked before its program is reused: :meth:`check` says what changed.

    Each read is taken as it reads now, when the capture is done: a value the traced code
    itself changed (a list it appends to) counts as the code left it (the trace ran that
    Python once, as every trace does). A tensor counts by identity where it is one of the
    program's ``constants`` (held by reference), else only as a tensor (a parameter the
    capture swapped in, which a cache of the module's may still hold). ``names``: a module's
    id -> its name in the models the step runs, for messages.
    """

    def __init__(
        self,
        reads: list[Read],
        torch_state: GlobalStateGuard,
        names: Mapping[int, str],
        constants: frozenset[int],
    ) -> None:
        self._constants = constants
        self.reads = [self._settled(read) for read in reads]
        self._torch_state = torch_state
        self._names = names
        self._quick: Callable[[int], int] | None = None

    def _settled(self, read: Read) -> Read:
        try:
            value = _raw_read(read.owner, read.kind, read.name, read.owner_type)
        except _Gone:
            value = _MISSING
        expected = read.current(read.owner, None, strict=False, constants=self._constants)
        return dataclasses.replace(
            read, expected=expected, value=value, by_identity=_immutable_or_code(value)
        )

    def check(self) -> str | None:
        """None when every read gives what it gave at capture; else what changed, by name."""
        if not self._torch_state.check():
            return f"torch's {self._torch_state.reason().strip()} changed"
        if self._quick is None:
            self._quick = _quick_check(self.reads)
        start = 0
        while (i := self._quick(start)) >= 0:
            read = self.reads[i]
            now = read.current(read.owner, None, strict=False, constants=self._constants)
            if now != read.expected:
                return self._describe(read)
            start = i + 1  # the same value in another object (an equal float set again)
        return None

    def _describe(self, read: Read) -> str:
        owner = read.owner
        if read.kind == "global":
            where = owner.get("__name__", "builtins") if owner is not sys.modules else "sys.modules"
            what = f"{where}.{read.name}"
        elif read.kind == "cell":
            what = f"the closure variable {read.name}"
        else:
            what = f"{self._names.get(id(owner), type(owner).__qualname__)}.{read.name}"
        try:
            now = repr(_raw_read(owner, read.kind, read.name, read.owner_type))
        except _Gone:
            now = "(gone)"
        before = "(gone)" if read.value is _MISSING else repr(read.value)
        return f"{what} changed: {_short(before)} -> {_short(now)}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quick_check(reads: list[Read]) -> Callable[[int], int]:
    """A function of ``start`` that returns the index of the first read from ``start`` on that
    may read differently now (-1 for none): each read as one expression, generated once, that
    holds when the same object is read again (an empty container: one of the same type, still
    empty); the caller compares the others' snapshots."""
    namespace: dict[str, Any] = {"M": _MISSING, "class_attribute": class_attribute}
    names: dict[int, str] = {}

    def bind(obj: Any, prefix: str) -> str:
        name = names.get(id(obj))
        if name is None:
            name = names[id(obj)] = f"{prefix}{len(names)}"
            namespace[name] = obj
        return name

    lines, typed = [], set()
    for i, read in enumerate(reads):
        owner, name = read.owner, read.name
        value = bind(read.value, "v")
        if read.kind == "member" and read.expected == (torch.Tensor, None):
            continue  # the call's own parameter or buffer
        if read.kind in ("instance", "member"):
            d = object.__getattribute__(owner, "__dict__")
            where = bind(d if read.kind == "instance" else d["_modules"], "d")
            got = f"{where}.get({name!r}, M)"
        elif read.kind == "class":
            d = getattr(owner, "__dict__", None)
            checks = [f"type({bind(owner, 'o')}) is {bind(read.owner_type, 't')}"]
            if isinstance(d, dict) and not _is_data_descriptor(read.value):
                checks.append(f"{name!r} not in {bind(d, 'd')}")
            if (read.owner_type, name) not in typed:
                typed.add((read.owner_type, name))
                checks.append(f"class_attribute({bind(read.owner_type, 't')}, {name!r}) is {value}")
            lines.append(f"    if start <= {i} and not ({' and '.join(checks)}): return {i}")
            continue
        elif read.kind == "global":
            got = f"{bind(owner, 'g')}.get({name!r}, M)"
        else:  # a cell: compared by snapshot (it may be empty)
            lines.append(f"    if start <= {i}: return {i}")
            continue
        if read.by_identity:
            test = f"{got} is {value}"
        elif _empty_container(read.value):
            test = f"(x := {got}).__class__ is {bind(type(read.value), 't')} and not x"
        else:
            test = "False"
        lines.append(f"    if start <= {i} and not ({test}): return {i}")
    source = "def quick(start):\n" + "\n".join([*lines, "    return -1"]) + "\n"
    exec(compile(source, "<fddp guards>", "exec"), namespace)
    return namespace["quick"]


def _empty_container(value: Any) -> bool:
    return (
        isinstance(value, (list, dict, set))
        and not value
        and not getattr(value, "__dict__", None)
        and getattr(value, "default_factory", None) is None
    )


def module_names(models: tuple[nn.Module, ...]) -> dict[int, str]:
    """Each module of ``models`` by id -> ``Root.path`` (the model's class name, then the
    module's path in it)."""
    names: dict[int, str] = {}
    for model in models:
        root = type(model).__name__
        for name, module in model.named_modules():
            names.setdefault(id(module), f"{root}.{name}" if name else root)
    return names


def state_reads(models: tuple[nn.Module, ...]) -> list[Read]:
    """Every attribute of every module of ``models``, as reads (for a capture whose reads were
    not recorded: Dynamo's)."""
    return [
        Read(module, "instance", name, None)
        for model in models
        for module in model.modules()
        for name in vars(module)
        if name not in _MODULE_INTERNALS
    ]


def first_difference(
    reads: list[Read], block: nn.Module | None = None, paths: Mapping[int, str] | None = None
) -> Read | None:
    """The first of ``reads`` that reads differently now (from ``block``, for relative ones)."""
    for read in reads:
        try:
            owner = resolve(read.owner, block)
        except (KeyError, TypeError):
            return read
        try:
            now = read.current(owner, paths, strict=True)
        except NoEvidence:
            return read
        if now != read.expected:
            return read
    return None
