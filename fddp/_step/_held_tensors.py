"""Tensors a program holds by reference: hashed on a call only where written since agreed."""

from __future__ import annotations

import dataclasses

import torch

from fddp._compiler._program import Compiled
from fddp._ranks import _digests

HELD = "the tensor the step closes over, "  # the label of a held tensor's value, then its node


def label(node: str) -> str:
    """The label of the value of the held tensor of node ``node``."""
    return f"{HELD}node '{node}'"


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter, which every in-place write moves; -1 for an inference tensor,
    which has none (it is hashed on every call)."""
    return -1 if t.is_inference() else t._version


def agreed_at_compile(compiled: Compiled) -> None:
    """Record the versions of the tensors ``compiled`` holds, whose values the ranks compared
    when they compiled it."""
    compiled.held_versions = [version_of(t) for _, t in compiled.held]


@dataclasses.dataclass
class Moved:
    """The tensors a call's program holds, with those written since the ranks last agreed on
    them hashed now (``hashed``: position in ``compiled.held`` -> digest, ``versions``: theirs
    as hashed)."""

    compiled: Compiled
    hashed: dict[int, torch.Tensor]
    versions: dict[int, int]

    def terms(self) -> list[tuple]:
        """The hashed tensors as terms of the call's digest."""
        held = self.compiled.held
        return [
            (label(held[k][0]), str(held[k][1].dtype), *held[k][1].shape, *d.tolist())
            for k, d in self.hashed.items()
        ]

    def values(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Every held tensor with its label and digest (hashed now where it was not moved), for
        the lines the ranks compare when their digests differ: a rank that did not write it
        names its value too."""
        held = self.compiled.held
        rest = [k for k in range(len(held)) if k not in self.hashed]
        found = {**self.hashed, **dict(zip(rest, _digests.digests([held[k][1] for k in rest])))}
        return [(label(name), t, found[k]) for k, (name, t) in enumerate(held)]

    def settled(self) -> None:
        """The ranks agreed on these values: later calls hash only what moves past them."""
        for k, version in self.versions.items():
            self.compiled.held_versions[k] = version


def moved(compiled: Compiled) -> Moved:
    """The tensors ``compiled`` holds, those whose version moved since the ranks last agreed on
    them hashed now (in the common case none: one version read per tensor)."""
    agreed = compiled.held_versions
    assert len(agreed) == len(compiled.held)  # recorded by agreed_at_compile
    now = [version_of(t) for _, t in compiled.held]
    if now == agreed and -1 not in now:
        return Moved(compiled, {}, {})
    versions = {k: v for k, (v, was) in enumerate(zip(now, agreed)) if v != was or v < 0}
    found = _digests.digests([compiled.held[k][1] for k in versions])
    return Moved(compiled, dict(zip(versions, found)), versions)
