"""A program's guards: what its capture read, checked before each reuse."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.guards import GlobalStateGuard

from fddp._compiler._capture._evidence import (
    Gone,
    Read,
    class_attribute,
    is_data_descriptor,
    raw_read,
)
from fddp._compiler._capture._snapshots import MISSING, immutable_or_code

_MEMBERS = ("_parameters", "_buffers", "_modules")  # where nn.Module's __getattr__ looks


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
            value = raw_read(read.owner, read.kind, read.name, read.owner_type)
        except Gone:
            value = MISSING
        expected = read.current(read.owner, None, strict=False, constants=self._constants)
        return dataclasses.replace(
            read, expected=expected, value=value, by_identity=immutable_or_code(value)
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
            value = raw_read(owner, read.kind, read.name, read.owner_type)
        except Gone:
            value = MISSING
        if value is read.value and value is not MISSING:  # the same object, other contents
            return f"{what} changed: its contents, now {_short(repr(value))}"
        before, now = ("(gone)" if v is MISSING else repr(v) for v in (read.value, value))
        return f"{what} changed: {_short(before)} -> {_short(now)}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quick_check(reads: list[Read]) -> Callable[[int], int]:
    """A function of ``start`` that returns the index of the first read from ``start`` on that
    may read differently now (-1 for none): each read as one expression, generated once, that
    holds when the same object is read again (an empty container: one of the same type, still
    empty); the caller compares the others' snapshots."""
    namespace: dict[str, Any] = {"M": MISSING, "class_attribute": class_attribute}
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
            if read.kind == "member":  # the dict it was found in: parameters, buffers, children
                d = next((d[m] for m in _MEMBERS if name in d[m]), d["_modules"])
            where = bind(d, "d")
            got = f"{where}.get({name!r}, M)"
        elif read.kind == "class":
            d = getattr(owner, "__dict__", None)
            checks = [f"type({bind(owner, 'o')}) is {bind(read.owner_type, 't')}"]
            if isinstance(d, dict) and not is_data_descriptor(read.value):
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
