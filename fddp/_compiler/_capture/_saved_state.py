"""What recorded Python may write, saved when first met, so that its writes can be put back."""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fddp._compiler._capture._snapshots import MISSING, cell_value, snapshot

_CLASS_FIXED = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"})


class SavedState:
    """The objects and modules a recording met, as first met, and the writes it saw, each with
    what puts it back.

    ``paths`` (id of each module of a block -> its path) is the recording's: an object's
    snapshot names a block's modules by path.
    """

    def __init__(self, paths: Mapping[int, str] | None) -> None:
        self.paths = paths
        self._objects: dict[int, tuple[Any, Any, Any]] = {}  # id -> (object, snapshot, copy)
        self._modules: dict[int, tuple[nn.Module, list[dict]]] = {}  # id -> module, its dicts
        self._steps: list[Callable[[], None]] = []  # put back the writes seen, last first

    def save(self, value: Any) -> None:
        """Keep ``value``'s snapshot and contents, unless it was met before."""
        if id(value) in self._objects:
            return
        before = snapshot(value, self.paths, strict=False)
        self._objects[id(value)] = (value, before, _copy(value))

    def save_module(self, module: nn.Module) -> None:
        """Keep ``module``'s attributes, parameters, buffers and children, unless met before."""
        if id(module) not in self._modules:
            self._modules[id(module)] = (module, _module_dicts(module))

    def forget_modules(self) -> None:
        """Drop the modules kept (parameters swapped in for a run differ from the last's)."""
        self._modules.clear()

    def save_cell(self, cell: types.CellType) -> None:
        """A write to ``cell``: put back its contents as they are now."""
        old = cell_value(cell)
        self._steps.append(lambda: _set_cell(cell, old))

    def save_item(self, namespace: dict, name: str) -> None:
        """A write to ``namespace[name]``: put back its value as it is now."""
        old = namespace.get(name, MISSING)
        self._steps.append(lambda: _set_item(namespace, name, old))

    def on_restore(self, step: Callable[[], None]) -> None:
        """Run ``step`` to put back a write seen (after those saved later)."""
        self._steps.append(step)

    def changed(self) -> list[str]:
        """The objects and modules met whose contents differ now from when first met."""
        found = []
        for value, before, _ in self._objects.values():
            if snapshot(value, self.paths, strict=False) != before:
                found.append(f"changes a {type(value).__qualname__}")
        for module, dicts in self._modules.values():
            if not _same_dicts(_module_dicts(module), dicts):
                found.append(f"changes the attributes of a {type(module).__qualname__}")
        return found

    def restore(self) -> bool:
        """Put back every write saved and every object met as it was first met; whether
        everything could be."""
        complete = True
        for value, _, saved in self._objects.values():
            complete &= _restore(value, saved)
        for module, dicts in self._modules.values():
            for now, saved in zip(_live_dicts(module), dicts):
                now.clear()
                now.update(saved)
        for step in reversed(self._steps):
            step()
        self._steps.clear()
        return complete


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


def _set_cell(cell: types.CellType, value: Any) -> None:
    if value is MISSING:
        del cell.cell_contents
    else:
        cell.cell_contents = value


def _set_item(namespace: dict, name: str, value: Any) -> None:
    if value is MISSING:
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
            if vars(value).get(name, MISSING) is not item and name not in _CLASS_FIXED:
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
