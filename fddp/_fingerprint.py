"""What a step's trace can depend on, as a digest that is the same in a restarted process.

A trace runs the step's Python once, so its graph is fixed by the code that runs and every value
that code reads. :func:`fingerprint` walks out from the step: a function's bytecode, constants,
defaults, closure cells and the globals its code names; an object's class and attributes; the
items of containers. Code of installed libraries (torch, fddp, the standard library, anything
under site-packages) enters by name, its versions being part of the persistent cache's key; the
values such code closes over (an optimizer's learning rate) are walked like any other. A tensor
enters by its shape, dtype, device and layout only, and its place on the walk is remembered:
a graph that holds a tensor as a constant records that place and a digest of the values, and a
restarted process finds it there again (:func:`locate`) and checks the values.

What the walk cannot see is state outside what the step reaches (a global flag set in another
module, an environment variable the model reads): the persistent cache's documentation says so.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import pathlib
import sys
import sysconfig
import types
from typing import Any

import torch

MAX_OBJECTS = 200_000  # beyond this the step reaches too much to fingerprint (a dataset, say)

Path = tuple[tuple[str, Any], ...]  # steps from the root: ("closure", 0), ("attr", "lr"), ...

_VALUES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_VALUES += (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)


class Unfingerprintable(Exception):
    """The step reaches more objects than :data:`MAX_OBJECTS`, or one whose identity is lost."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    digest: str
    tensors: dict[int, Path]  # id of each tensor met -> where it was first met


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted(d.rstrip("/") + "/" for d in dirs))


_LIBRARY_ROOTS = {"builtins", "torch", "fddp", "optree", "numpy", "typing", "functools"}


@functools.cache
def _is_library_module(name: str) -> bool:
    """Whether the module ``name`` is installed code (enters the key by its version)."""
    if name.partition(".")[0] in _LIBRARY_ROOTS or name in sys.builtin_module_names:
        return True
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return file is not None and file.startswith(_library_dirs())


def _is_library(obj: Any) -> bool:
    """Whether ``obj`` (a function or class) is installed code; one without a module (defined
    by ``exec``) is the user's."""
    module = getattr(obj, "__module__", None)
    return module is not None and _is_library_module(module)


class _Walk:
    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # the walked objects stay alive, so their ids stay unique
        self.tensors: dict[int, Path] = {}

    def emit(self, *parts: Any) -> None:
        self.hash.update(repr(parts).encode())
        self.hash.update(b"\0")

    def visit(self, obj: Any, path: Path) -> None:
        if isinstance(obj, _VALUES):
            self.emit(type(obj).__qualname__, repr(obj))
            return
        if isinstance(obj, enum.Enum):
            self.emit("enum", type(obj).__module__, type(obj).__qualname__, obj.name)
            return
        index = self.seen.get(id(obj))
        if index is not None:
            self.emit("again", index)
            return
        if len(self.seen) >= MAX_OBJECTS:
            raise Unfingerprintable(f"the step reaches more than {MAX_OBJECTS} objects")
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        self._visit_new(obj, path)

    def _visit_new(self, obj: Any, path: Path) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensors.setdefault(id(obj), path)
            kind = type(obj).__qualname__
            self.emit("tensor", kind, tuple(obj.shape), obj.dtype, obj.device.type, obj.layout)
            self.emit(obj.requires_grad)
        elif isinstance(obj, types.FunctionType):
            self._function(obj, path)
        elif isinstance(obj, functools.partial):
            self.emit("partial")
            self.visit(obj.func, (*path, ("attr", "func")))
            self.visit(obj.args, (*path, ("attr", "args")))
            self.visit(obj.keywords, (*path, ("attr", "keywords")))
        elif isinstance(obj, types.MethodType):
            self.emit("method")
            self.visit(obj.__func__, (*path, ("attr", "__func__")))
            self.visit(obj.__self__, (*path, ("attr", "__self__")))
        elif isinstance(obj, types.ModuleType):
            self.emit("module", obj.__name__)
        elif isinstance(obj, type):
            self._class(obj, path)
        elif isinstance(obj, (types.BuiltinFunctionType, types.WrapperDescriptorType)) or (
            callable(obj) and type(obj).__module__ in ("builtins", "torch._ops", "torch._C")
        ):
            self.emit("builtin", getattr(obj, "__module__", None), _qualname(obj))
        elif isinstance(obj, (list, tuple)):
            self.emit(type(obj).__qualname__, len(obj))
            if type(obj) not in (list, tuple):
                self.visit(type(obj), (*path, ("attr", "__class__")))
            for i, item in enumerate(obj):
                self.visit(item, (*path, ("item", i)))
        elif isinstance(obj, dict):
            self._mapping(obj, path)
        elif isinstance(obj, (set, frozenset)):
            self.emit(type(obj).__qualname__, sorted(repr(x) for x in obj))
        elif isinstance(obj, (types.CodeType,)):
            self._code(obj)
        else:
            self._instance(obj, path)

    def _mapping(self, obj: dict, path: Path) -> None:
        self.emit(type(obj).__qualname__, len(obj))
        if type(obj) is not dict:
            self.visit(type(obj), (*path, ("attr", "__class__")))
        for key in sorted(obj, key=repr):
            self.emit("key", repr(key))
            self.visit(obj[key], (*path, ("item", key)))
        self.emit("order", [repr(k) for k in obj])  # code that iterates sees this order

    def _code(self, code: types.CodeType) -> None:
        self.emit("code", code.co_code, code.co_names, code.co_freevars, code.co_flags)
        self.emit(code.co_argcount, code.co_kwonlyargcount, code.co_varnames)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const)
            else:
                self.emit("const", type(const).__qualname__, repr(const))

    def _function(self, fn: types.FunctionType, path: Path) -> None:
        if _is_library(fn):
            self.emit("library function", fn.__module__, fn.__qualname__)
        else:
            self.emit("function", fn.__qualname__)
            self._code(fn.__code__)
            for name in sorted(_global_names(fn.__code__)):
                if name in fn.__globals__:
                    self.emit("global", name)
                    self._global(fn.__globals__[name], fn.__code__, (*path, ("global", name)))
        self.visit(fn.__defaults__, (*path, ("attr", "__defaults__")))
        self.visit(fn.__kwdefaults__, (*path, ("attr", "__kwdefaults__")))
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled
                self.emit("empty cell")
                continue
            self.visit(contents, (*path, ("closure", i)))
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.visit(wrapped, (*path, ("attr", "__wrapped__")))

    def _global(self, value: Any, code: types.CodeType, path: Path) -> None:
        """A global the code names; a user module contributes the attributes the code names."""
        self.visit(value, path)
        if isinstance(value, types.ModuleType) and not _is_library_module(value.__name__):
            for name in sorted(_global_names(code)):
                if name in vars(value):
                    self.emit("module attribute", name)
                    self.visit(vars(value)[name], (*path, ("attr", name)))

    def _class(self, cls: type, path: Path) -> None:
        if _is_library(cls):
            self.emit("library class", cls.__module__, cls.__qualname__)
            return
        self.emit("class", cls.__module__, cls.__qualname__)
        for i, base in enumerate(cls.__bases__):
            self.visit(base, (*path, ("attr", "__bases__"), ("item", i)))
        for name in sorted(vars(cls)):
            if name in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
                continue
            attribute = vars(cls)[name]
            self.emit("class attribute", name)
            if isinstance(attribute, (staticmethod, classmethod)):
                attribute = attribute.__func__
            elif isinstance(attribute, property):
                attribute = (attribute.fget, attribute.fset)  # its tensors are not located
            self.visit(attribute, (*path, ("class attribute", name)))

    def _instance(self, obj: Any, path: Path) -> None:
        self.emit("object")
        self.visit(type(obj), (*path, ("attr", "__class__")))
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            self._mapping(state, (*path, ("vars", None)))
        for name in _slots(type(obj)):
            if hasattr(obj, name):
                self.emit("slot", name)
                self.visit(getattr(obj, name), (*path, ("attr", name)))
        if state is None and not _slots(type(obj)):
            self.emit(
                "opaque", repr(obj) if _is_library(type(obj)) and "0x" not in repr(obj) else ""
            )


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s != "__dict__"]
    return names


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> frozenset[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


def fingerprint(*roots: Any) -> Fingerprint:
    """The digest of ``roots`` (the step, then its static arguments) and where each tensor was
    met, as paths from ``roots``.

    Raises:
        Unfingerprintable: the walk met more than :data:`MAX_OBJECTS` objects.
    """
    walk = _Walk()
    for i, root in enumerate(roots):
        walk.visit(root, (("root", i),))
    return Fingerprint(walk.hash.hexdigest(), walk.tensors)


def locate(roots: tuple[Any, ...], path: Path) -> Any:
    """The object at ``path`` from ``roots``, as :func:`fingerprint` recorded it.

    Raises:
        LookupError: the path leads nowhere in this process.
    """
    step, index = path[0]
    obj: Any = roots[index]
    for step, key in path[1:]:
        obj = _follow(obj, step, key)
    return obj


def _follow(obj: Any, step: str, key: Any) -> Any:
    try:
        if step == "closure":
            return obj.__closure__[key].cell_contents
        if step == "global":
            return obj.__globals__[key]
        if step == "attr":
            return getattr(obj, key)
        if step == "vars":
            return vars(obj)
        if step == "item":
            return obj[key]
        if step == "class attribute":
            attribute = vars(obj)[key]
            return (
                attribute.__func__
                if isinstance(attribute, (staticmethod, classmethod))
                else attribute
            )
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise LookupError(f"{step} {key!r}: {e}") from None
    raise LookupError(f"unknown step {step!r}")


@functools.cache
def fddp_source_digest() -> str:
    """A digest of fddp's own source files: a changed fddp never loads an older program."""
    root = pathlib.Path(__file__).resolve().parent  # the package: this module sits at its top
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        digest.update(str(file.relative_to(root)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()
