"""What a step's trace can depend on, as a digest that is the same in a restarted process."""

from __future__ import annotations

import collections
import dataclasses
import dis
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Mapping
from typing import Any

import torch

from fddp._base._names import qualified_name

MAX_OBJECTS = 200_000  # beyond this the step reaches too much to fingerprint (a dataset, say)

Path = tuple[tuple[str, Any], ...]  # steps from the root: ("closure", 0), ("attr", "lr"), ...

_VALUES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_VALUES += (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)


_LOCKS = (type(threading.Lock()), type(threading.RLock()))  # no value a trace reads


class Unfingerprintable(Exception):
    """The step reaches more objects than :data:`MAX_OBJECTS`, or one whose state it cannot
    read."""


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
    """Whether the module ``name`` is installed code (enters the key by its version); a module
    of the user's, an editable install's included, is walked."""
    top = name.partition(".")[0]
    if top in _LIBRARY_ROOTS or top in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return file is not None and file.startswith(_library_dirs())


@functools.cache
def _distributions(search_path: tuple[str, ...]) -> Mapping[str, list[str]]:
    """Top-level module names -> the installed distributions that provide them."""
    return importlib.metadata.packages_distributions()


def _library_versions(name: str) -> tuple[Any, ...]:
    """What stands for the installed module ``name`` in the key: its distributions' versions
    (the standard library's is Python's, fddp's its source digest, both in the key already),
    else a digest of its source file."""
    top = name.partition(".")[0]
    if top in ("builtins", "fddp") or top in sys.stdlib_module_names:
        return ()
    if name in sys.builtin_module_names:
        return ()
    found = _versions(top, tuple(sys.path))
    return found if found else ("source", _module_source_digest(sys.modules.get(name)))


@functools.cache
def _versions(top: str, search_path: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The (name, version) of each distribution that provides the top-level module ``top``."""
    own = _own_distribution(top)
    if own is not None:
        return ((own.metadata["Name"], own.version),)
    found = _distributions(search_path).get(top, [])
    try:
        return tuple((dist, importlib.metadata.version(dist)) for dist in sorted(set(found)))
    except importlib.metadata.PackageNotFoundError:  # removed since it was listed
        return ()


def _own_distribution(top: str) -> importlib.metadata.Distribution | None:
    """The distribution named ``top`` if it provably installed the module ``top`` that is
    loaded (a regular package or module, which one distribution owns), without listing every
    installed distribution; None when that is not proven."""
    file = getattr(sys.modules.get(top), "__file__", None)
    try:
        dist = importlib.metadata.distribution(top)
    except importlib.metadata.PackageNotFoundError:
        return None
    if not isinstance(file, str) or not pathlib.Path(file).is_relative_to(
        str(dist.locate_file(""))
    ):
        return None
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return dist if top in listed.split() else None
    files = dist.files or []
    return dist if any(f.parts[0] in (top, f"{top}.py") for f in files) else None


def _module_source_digest(module: types.ModuleType | None) -> str:
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return ""
    try:
        status = os.stat(file)
        return _file_digest(file, status.st_mtime_ns, status.st_size)
    except OSError as e:
        raise Unfingerprintable(f"the module source {file} cannot be read ({e})") from None


@functools.lru_cache(maxsize=4096)
def _file_digest(file: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(pathlib.Path(file).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=4096)
def _imports(code: types.CodeType) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
    """The imports in ``code`` and the code nested in it: (name, level, from-list) each."""
    found: list[tuple[str, int, tuple[str, ...]]] = []
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname == "IMPORT_NAME" and i >= 2:
            level, fromlist = instructions[i - 2].argval, instructions[i - 1].argval
            found.append((ins.argval, level if isinstance(level, int) else 0, fromlist or ()))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _imports(const)
    return tuple(found)


def _imported_modules(fn: types.FunctionType) -> list[types.ModuleType]:
    """The modules ``fn``'s body imports, imported now as the body would import them.

    Raises:
        Unfingerprintable: one of them cannot be imported.
    """
    modules = []
    for name, level, fromlist in _imports(fn.__code__):
        try:
            full = importlib.util.resolve_name(
                "." * level + name, fn.__globals__.get("__package__")
            )
            module = importlib.import_module(full)
            modules.append(module)
            if not fromlist and "." in full:  # ``import a.b`` binds ``a``
                modules.append(sys.modules[full.partition(".")[0]])
            for item in fromlist:
                if item != "*" and not hasattr(module, item):
                    modules.append(importlib.import_module(f"{full}.{item}"))
        except Exception as e:  # the trace would fail the same way
            raise Unfingerprintable(
                f"{fn.__qualname__} imports {'.' * level + name} in its body, which cannot be "
                f"imported now ({type(e).__name__}: {e})"
            ) from None
    return modules


def _is_numpy(obj: Any, kind: str) -> bool:
    """Whether ``obj`` is a ``numpy.<kind>`` (none exists before numpy is imported)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, getattr(numpy, kind))


_ACCESS = {"closure": ".__closure__", "global": ".__globals__", "item": ""}


def _describe(path: Path) -> str:
    """``path`` as Python that reaches the object."""
    text = "step" if path[0] == ("root", 0) else f"static argument {path[0][1] - 1}"
    for step, key in path[1:]:
        if step == "import":
            text = f"sys.modules[{key!r}]"
        elif step in ("closure", "global", "item"):
            text += f"{_ACCESS[step]}[{key!r}]"
        elif step != "vars":
            text += f".{key}"
    return text


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
        self.libraries: set[str] = set()  # installed modules met, keyed by their versions
        self.walked: set[tuple[int, frozenset[str]]] = set()  # (module, names) walked

    def emit(self, *parts: Any) -> None:
        self.hash.update(repr(parts).encode())
        self.hash.update(b"\0")

    def visit(self, obj: Any, path: Path) -> None:
        if isinstance(obj, _VALUES) and not isinstance(obj, enum.Enum):
            self.emit(type(obj).__qualname__, repr(obj))  # a float's repr is its exact bits
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
        if isinstance(obj, enum.Enum):
            self.emit("enum", obj.name)
            self.visit(type(obj), (*path, ("attr", "__class__")))
            self.visit(obj.value, (*path, ("attr", "value")))
        elif isinstance(obj, torch.Tensor):
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
            self._module(obj)
        elif isinstance(obj, type):
            self._class(obj, path)
        elif isinstance(obj, (types.BuiltinFunctionType, types.WrapperDescriptorType)) or (
            callable(obj) and type(obj).__module__ in ("builtins", "torch._ops", "torch._C")
        ):
            module = getattr(obj, "__module__", None)
            if isinstance(module, str) and module in sys.modules:
                self.libraries.add(module)  # a C extension's function: its version keys it
            self.emit("builtin", module, qualified_name(obj, module=False))
        elif isinstance(obj, re.Pattern):
            self.emit("pattern", obj.pattern, obj.flags)  # its repr is cut at 200 characters
        elif isinstance(obj, (list, tuple, collections.deque)):
            self.emit(type(obj).__qualname__, len(obj))
            if type(obj) not in (list, tuple, collections.deque):
                self.visit(type(obj), (*path, ("attr", "__class__")))
            for i, item in enumerate(obj):
                self.visit(item, (*path, ("item", i)))
        elif isinstance(obj, dict):
            self._mapping(obj, path)
        elif isinstance(obj, (set, frozenset)):
            self.emit(type(obj).__qualname__, sorted(repr(x) for x in obj))
        elif isinstance(obj, (types.CodeType,)):
            self._code(obj)
        elif _is_numpy(obj, "ndarray"):
            self._array(obj, path)
        elif _is_numpy(obj, "generic"):
            self.emit("numpy scalar", type(obj).__qualname__, obj.tobytes())
        elif isinstance(obj, _LOCKS) or type(obj) is object:  # no state a trace reads
            self.emit(type(obj).__qualname__)
        else:
            self._instance(obj, path)

    def _module(self, module: types.ModuleType) -> None:
        if _is_library_module(module.__name__):
            self.libraries.add(module.__name__)
            self.emit("library module", module.__name__)
        else:
            self.emit("module", module.__name__, _module_source_digest(module))

    def _array(self, obj: Any, path: Path) -> None:
        if obj.dtype.hasobject:
            raise Unfingerprintable(
                f"{_describe(path)} is a numpy array of Python objects; give it a numeric dtype"
            )
        self.emit("ndarray", obj.dtype.str, obj.shape, hashlib.sha256(obj.tobytes()).digest())
        if type(obj).__module__ != "numpy":  # a subclass: its class and attributes too
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
            self.libraries.add(fn.__module__)
            self.emit("library function", fn.__module__, fn.__qualname__)
        else:
            self.emit("function", fn.__qualname__)
            self._code(fn.__code__)
            names = _global_names(fn.__code__)
            for name in sorted(names):
                if name in fn.__globals__:
                    self.emit("global", name)
                    self._global(fn.__globals__[name], names, (*path, ("global", name)))
            for module in _imported_modules(fn):
                self.emit("import", module.__name__)
                self._global(module, names, (*path, ("import", module.__name__)))
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

    def _global(self, value: Any, names: frozenset[str], path: Path) -> None:
        """A global (or imported module) the code names; a user module contributes the
        attributes the code names, and a submodule among them its own (``pkg.sub.f``)."""
        self.visit(value, path)
        if not isinstance(value, types.ModuleType) or _is_library_module(value.__name__):
            return
        if (id(value), names) in self.walked:
            return
        self.walked.add((id(value), names))
        for name in sorted(names):
            if name in vars(value):
                self.emit("module attribute", name)
                self._global(vars(value)[name], names, (*path, ("attr", name)))

    def _class(self, cls: type, path: Path) -> None:
        if _is_library(cls):
            self.libraries.add(cls.__module__)
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
            text = repr(obj)
            if not _is_library(type(obj)) or "0x" in text:
                raise Unfingerprintable(
                    f"{_describe(path)} is a {type(obj).__qualname__} whose state fddp cannot "
                    f"read ({text[:60]}); make it a value the step takes as an argument, or "
                    "give its class a __dict__ or __slots__"
                )
            self.emit("opaque", text)


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
    for name in sorted(walk.libraries):
        walk.emit("installed", name, _library_versions(name))
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
        if step == "import":
            return sys.modules[key]
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
