"""Parts of a state that only resume together: tied by the step that returned them, for a save."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch


@dataclasses.dataclass
class _Tie:
    parts: dict[str, list[weakref.ref]]  # each part's tensors, by the name a message gives it
    why: str


_ties: weakref.WeakKeyDictionary[Any, _Tie] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def tie(owner: Any, parts: dict[str, list[torch.Tensor]], why: str) -> None:
    """From now on, until ``owner`` ties (or unties) again, a save of any tensor of one of
    ``parts`` must hold a tensor of each other part (:func:`missing`); ``why`` says why."""
    refs = {name: [weakref.ref(t) for t in tensors] for name, tensors in parts.items()}
    with _lock:
        _ties[owner] = _Tie(refs, why)


def untie(owner: Any) -> None:
    with _lock:
        _ties.pop(owner, None)


def missing(leaves: list[Any]) -> str | None:
    """Where ``leaves`` (the tensors a save holds) hold some parts of a tie but not all: which
    part is there, which is missing, and why they belong together; None when nothing is
    missing."""
    held = {id(x) for x in leaves if isinstance(x, torch.Tensor)}
    with _lock:
        ties = list(_ties.values())
    for found in ties:
        present = {
            name: any(ref() is not None and id(ref()) in held for ref in refs)
            for name, refs in found.parts.items()
        }
        if any(present.values()) and not all(present.values()):
            here = ", ".join(name for name, is_there in present.items() if is_there)
            gone = ", ".join(name for name, is_there in present.items() if not is_there)
            return f"it holds {here} but not {gone}, which {found.why}"
    return None
