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


def agreed_at_compile(compiled: Compiled) -> None:
    """Record the versions of the tensors ``compiled`` holds, whose values the ranks compared
    when they compiled it. Inference tensors, which have no version counter, go last in
    ``compiled.held``, past its versions: they are hashed on every call."""
    compiled.held.sort(key=lambda held: held[1].is_inference())
    compiled.held_versions = [t._version for _, t in compiled.held if not t.is_inference()]


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
    """The tensors ``compiled`` holds, those written since the ranks last agreed on them (their
    version counters moved; inference tensors always) hashed now: in the common case none, one
    version read per tensor."""
    agreed, held = compiled.held_versions, compiled.held
    now = [t._version for _, t in held[: len(agreed)]]
    if now == agreed and len(agreed) == len(held):
        return Moved(compiled, {}, {})
    versions = {k: v for k, (v, was) in enumerate(zip(now, agreed)) if v != was}
    written = [*versions, *range(len(agreed), len(held))]
    found = _digests.digests([held[k][1] for k in written])
    return Moved(compiled, dict(zip(written, found)), versions)
