"""What traced Python reads and writes besides its tensors, recorded while it runs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import random
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch._C._dynamo.guards import GlobalStateGuard

from fddp._compiler._capture._opcode_trace import OpcodeTrace
from fddp._compiler._capture._saved_state import SavedState
from fddp._compiler._capture._snapshots import (
    GONE,
    MISSING,
    NoEvidence,
    cell_value,
    immutable_or_code,
    snapshot,
)

# reads of a module's own machinery (its member dicts, read through ``__getattr__`` as members)
_MODULE_INTERNALS = frozenset({"__dict__", "__class__", "_parameters", "_buffers", "_modules"})


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
    value: Any = MISSING  # what was read (for messages, and as a quick check)
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
            value = raw_read(owner, self.kind, self.name, self.owner_type)
        except Gone:
            return GONE
        if self.kind == "member" and isinstance(value, torch.Tensor):
            return self.expected  # the call's own parameter or buffer: an input, not a value
        return snapshot(value, paths, strict=strict, constants=constants)


class Gone(Exception):
    pass


def raw_read(owner: Any, kind: str, name: str, owner_type: type | None) -> Any:
    """Read without running the owner's Python (no properties, no ``__getattr__``)."""
    try:
        if kind == "instance":
            return object.__getattribute__(owner, "__dict__")[name]
        if kind == "member":
            d = object.__getattribute__(owner, "__dict__")
            for members in ("_parameters", "_buffers", "_modules"):
                if name in d[members]:
                    return d[members][name]
            raise Gone
        if kind == "class":
            if type(owner) is not owner_type:
                raise Gone
            d = getattr(owner, "__dict__", None)
            attribute = class_attribute(owner_type, name)
            if attribute is MISSING or (
                isinstance(d, dict) and name in d and not is_data_descriptor(attribute)
            ):
                raise Gone
            return attribute
        if kind == "global":
            return owner[name]
        if kind == "cell":
            return owner.cell_contents
        assert kind == "state"
        return owner
    except (KeyError, ValueError, AttributeError, TypeError) as e:
        raise Gone from e


def class_attribute(klass: type, name: str) -> Any:
    """``name`` as found along ``klass``'s MRO (``MISSING`` if nowhere)."""
    for owner in klass.__mro__:
        if name in vars(owner):
            return vars(owner)[name]
    return MISSING


def is_data_descriptor(attribute: Any) -> bool:
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
    for the duration). The thread's Python outside torch, fddp and the standard library is
    also followed opcode by opcode (:class:`OpcodeTrace`): the globals and closure variables it
    loads, the imports it makes, the builtins it calls that read what no record sees, and its
    writes to globals and closure variables. Every container, plain object,
    user class or module, and generator met is compared again afterwards (:class:`SavedState`):
    a difference is a write.

    ``paths`` (id of each module of a block -> its path) makes the reads of those modules
    relative to the block, so they can be read again from another block of the same structure.

    ``whole_step`` records a whole step's capture, whose program is reused while its reads read
    the same: an object whose state cannot be compared counts by identity, the step's writes
    stay as they are (its trace-time side effects) and what the opcode trace cannot check (a
    name looked up by name, an opaque builtin, an import) is left unwatched instead of refused;
    under another trace function (a debugger's, coverage's) no code is followed
    (``unwatched`` says so).
    """

    def __init__(
        self,
        *,
        paths: Mapping[int, str] | None = None,
        whole_step: bool = False,
    ) -> None:
        self.whole_step = whole_step
        self.undoes_writes = not whole_step  # and snapshots strictly
        self.unwatched: str | None = None  # why the code was not followed
        self.paths = paths
        self.reads: dict[tuple[int, str, str], Read] = {}
        self.keep: list[Any] = []  # the owners read, alive while their ids key ``reads``
        self.writes: list[str] = []
        self.refused: str | None = None
        self.saved = SavedState(paths)  # what the writes replaced
        # the functions met, by code: where the opcode trace finds a closure variable's cell
        self.functions: dict[types.CodeType, list[types.FunctionType]] = {}
        self.busy = False  # noting a read: the code that runs now is the recorder's own
        self.code_trace = OpcodeTrace(self)  # the thread's trace function while following

    # -- what the wrapped attribute lookup and the opcode trace report --

    def module_read(self, module: nn.Module, name: str, value: Any, member: bool) -> None:
        if (
            name in _MODULE_INTERNALS
            or self.refused is not None
            or isinstance(module, fx.GraphModule)
        ):
            return  # a graph module is the capture's own
        self.busy = True
        try:
            self._module_read(module, name, value, member)
        finally:
            self.busy = False

    def _module_read(self, module: nn.Module, name: str, value: Any, member: bool) -> None:
        if self.undoes_writes:
            self.saved.save_module(module)
        owner: Any = module
        if self.paths is not None and id(module) in self.paths:
            owner = _Path(self.paths[id(module)])
        if member:
            kind = "member"
        else:
            d = object.__getattribute__(module, "__dict__")
            attribute = class_attribute(type(module), name)
            kind = "instance" if name in d and not is_data_descriptor(attribute) else "class"
            if kind == "class":
                value = attribute
        if kind == "instance" and getattr(value, "_fddp_installed", False):
            return  # a replaying forward fddp put on the block: not the block's own
        self.read(owner, kind, name, value, type(module) if kind == "class" else None)

    def read(self, owner: Any, kind: str, name: str, value: Any, owner_type: type | None) -> None:
        """Note a read (the caller holds ``busy``: a snapshot runs no recorded code)."""
        key = (id(owner) if not isinstance(owner, _Path) else hash(owner), kind, name)
        if key in self.reads:
            return
        try:
            expected = (
                (torch.Tensor, None)
                if kind == "member" and isinstance(value, torch.Tensor)
                else snapshot(value, self.paths, strict=self.undoes_writes, met=self._meet)
            )
        except NoEvidence as e:
            self.refused = f"{_describe_owner(owner)}.{name} {e}"
            return
        self.reads[key] = Read(
            owner, kind, name, expected, owner_type, value, immutable_or_code(value)
        )
        self.keep.append(owner)

    def _meet(self, value: Any) -> None:
        """A function (kept for its closure cells) or a mutable object (compared afterwards)."""
        if isinstance(value, types.FunctionType):
            known = self.functions.setdefault(value.__code__, [])
            if not any(f is value for f in known):
                known.append(value)
            return
        if self.undoes_writes:
            self.saved.save(value)

    def meet_functions(self, *values: Any) -> None:
        """Note the functions ``values`` are or wrap (a step, the functions passed to it): the
        opcode trace finds their closure variables' cells through them."""
        for value in values:
            for function in _functions_within(value):
                self._meet(function)

    def absorb(self, reads: list[Read], block: nn.Module) -> None:
        """Record ``reads`` (a template's, relative to its block) as read from ``block``."""
        self.busy = True
        try:
            for read in reads:
                owner = resolve(read.owner, block)
                try:
                    value = raw_read(owner, read.kind, read.name, read.owner_type)
                except Gone:
                    value = MISSING
                self.read(owner, read.kind, read.name, value, read.owner_type)
        finally:
            self.busy = False


def _functions_within(value: Any, depth: int = 4) -> Iterator[types.FunctionType]:
    """``value`` if a function, the function a method or partial calls, and those in a
    function's closure cells and ``__wrapped__`` (a decorator's), ``depth`` levels down."""
    if depth == 0:
        return
    if isinstance(value, (types.MethodType, functools.partial)):
        value = value.__func__ if isinstance(value, types.MethodType) else value.func
    if not isinstance(value, types.FunctionType):
        return
    yield value
    inner = [cell_value(c) for c in value.__closure__ or ()]
    for found in [*inner, getattr(value, "__wrapped__", None)]:
        yield from _functions_within(found, depth - 1)


@dataclasses.dataclass(frozen=True)
class _Path:
    """A module's place in the block a relative read is made from."""

    path: str


def _describe_owner(owner: Any) -> str:
    if isinstance(owner, _Path):
        return f"self.{owner.path}" if owner.path else "self"
    if isinstance(owner, dict):
        return str(owner.get("__name__", "a namespace"))
    return type(owner).__qualname__


# ---- the wrapped attribute lookup of modules ----


def _recorded_getattribute(self: nn.Module, name: str) -> Any:
    recorder = _LOCAL.recorder
    if recorder is None or recorder.busy:
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
    torch's global state (autocast, grad mode); for a template (``undoes_writes``), what was
    written is put back as it was (the caller traces the code again, or not at all)."""
    if sys.gettrace() is not None:  # a debugger's or coverage's
        if recorder.whole_step:
            recorder.unwatched = "the step was captured under another trace function"
        else:
            recorder.refused = "runs under another trace function"
    outer = _LOCAL.recorder
    _LOCAL.recorder = recorder
    recorder.saved.forget_modules()
    torch_state = GlobalStateGuard()
    python_random = random.getstate()
    # a whole step's code is followed only while the step runs (see following)
    tracing = recorder.undoes_writes and recorder.refused is None
    try:
        with _module_reads_wrapped():
            if tracing:
                sys.settrace(recorder.code_trace.on_call)
            try:
                yield recorder
            finally:
                if tracing:
                    sys.settrace(None)
    finally:
        _LOCAL.recorder = outer
        if recorder.undoes_writes:  # also when the code raised: what it wrote is put back
            _check_writes(recorder, torch_state, python_random)


@contextlib.contextmanager
def following() -> Iterator[None]:
    """Within the block, this thread's whole-step recorder follows the code opcode by opcode:
    around the step itself, not the capture's machinery around it, which a trace function
    would slow (every frame runs unspecialized while one is set)."""
    recorder = _LOCAL.recorder
    if recorder is None or not recorder.whole_step or recorder.unwatched is not None:
        yield
        return
    sys.settrace(recorder.code_trace.on_call)
    try:
        yield
    finally:
        sys.settrace(None)


def _check_writes(recorder: Recorder, torch_state: GlobalStateGuard, python_random: Any) -> None:
    if not torch_state.check():
        recorder.writes.append(f"changes torch's {torch_state.reason().strip()}")
    if random.getstate() != python_random:
        recorder.writes.append("draws from Python's random generator")
        recorder.saved.on_restore(lambda: random.setstate(python_random))
    recorder.writes += recorder.saved.changed()
    if recorder.writes:
        recorder.saved.restore()


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
