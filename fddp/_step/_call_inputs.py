"""What one call brings to the agreement: the leaves that must agree, by digest or by origin."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import optree
import torch

from fddp._ranks import _digests
from fddp._ranks._agree import Line
from fddp._ranks._signature import leaf_paths
from fddp._sharding import per_rank_leaves
from fddp._step._held_tensors import Moved

GENERATOR = "the random generator's state"
VALUE = "the value of argument leaf "  # the label of a replicated leaf's value, then its path
GENERATOR_SOURCE = -1  # in a set of sources: the random generator's state
RANK_SOURCE = -2  # in a set of sources: the rank itself
NEW = "not an output of this step"  # the origin of a tensor the step has not returned
_SHOWN_NUMEL = 8  # a tensor of at most this many elements is named by its values


def tensor_paths(args: tuple) -> list[str]:
    leaves = optree.tree_leaves(args)
    return [p for p, x in zip(leaf_paths(args), leaves) if isinstance(x, torch.Tensor)]


def tensor_indices_of_arg(args: tuple, n: int) -> range:
    """Positions, among all tensor leaves of ``args``, of those inside argument ``n``."""
    before = sum(isinstance(x, torch.Tensor) for a in args[:n] for x in optree.tree_leaves(a))
    count = sum(isinstance(x, torch.Tensor) for x in optree.tree_leaves(args[n]))
    return range(before, before + count)


def readable_paths(tree: Any) -> list[str]:
    """Each leaf's path as Python reaches it (``[1][0].count``, ``[0]['fc.weight']``)."""
    accessors, _, _ = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") for accessor in accessors]


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (a CPU byte tensor)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a signature's tensor arguments stand: their paths, which must be the same on
    every rank (the replicated arguments' leaves; integer ones first, as a step count names a
    skipped call best) and which a sharded layout makes per rank, with that layout."""

    paths: list[str]
    replicated: list[int]
    per_rank: dict[int, str]


def layout_of(args: tuple, argnums: tuple[int, ...]) -> Layout:
    leaves = optree.tree_leaves(args)
    tensor_of_leaf: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            tensor_of_leaf[i] = len(tensor_of_leaf)
    per_rank = {tensor_of_leaf[i]: why for i, why in per_rank_leaves(args).items()}
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    positions = sorted({n % len(args) for n in argnums if -len(args) <= n < len(args)})
    replicated = [i for n in positions for i in tensor_indices_of_arg(args, n) if i not in per_rank]
    replicated.sort(key=lambda i: tensors[i].is_floating_point() or tensors[i].is_complex())
    paths = [p for p, x in zip(readable_paths(args), leaves) if isinstance(x, torch.Tensor)]
    return Layout(paths, replicated, per_rank)


def describe_tensor(t: torch.Tensor, digest: torch.Tensor) -> str:
    """A tensor as a line's value: small ones by their values, others by a digest of their
    bits."""
    bits = f"digest {int(digest[0]) & (2**64 - 1):016x}"
    if t.numel() <= _SHOWN_NUMEL:
        text = f"{t.tolist()!r}" if t.dim() else f"{t.item()!r}"
        nan = t.is_floating_point() and bool(torch.isnan(t).any())
        return f"{text} with {bits}" if nan else text  # NaNs of other bits print alike
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} with {bits}"


@dataclasses.dataclass
class Returned:
    """An output of one of the step's calls: the tensor, where it came out, whether it is the
    same on every rank (and its version then, to notice writes since)."""

    ref: weakref.ref
    output: int  # its index among the call's output leaves
    call: int
    replicated: bool
    version: int
    paths: list[str]  # the paths of the call's output leaves

    @property
    def origin(self) -> str:
        return f"output {self.paths[self.output]} of call {self.call}"


@dataclasses.dataclass
class Inputs:
    """What one call brings to the agreement beyond its signature.

    ``layout`` says which tensor arguments must be the same on every rank; each of those was
    either hashed now (``hashed``: index -> its digest) or is known to be the same everywhere
    from its origin: a replicated output of one of this step's calls (``origins``: index ->
    :class:`Returned`), which every rank must then name alike. Per-rank leaves
    of a sharded layout enter by their origin alone. ``generator``: the random generator's
    state, where the step's results depend on it. ``held``: the tensors the program holds by
    reference (closed over), those written since the ranks last agreed on them hashed now.
    """

    layout: Layout
    tensors: list[torch.Tensor]
    hashed: dict[int, torch.Tensor]
    origins: dict[int, Returned]
    generator: torch.Tensor | None = None
    held: Moved | None = None

    def terms(self) -> str:
        """The call's inputs as text to digest: for each replicated leaf its digest or origin,
        for each per-rank leaf its origin, the generator's state."""
        hashed, origins = self.hashed, self.origins
        terms: list[Any] = [
            (i, origins[i].call, origins[i].output) if i not in hashed else (i, *hashed[i].tolist())
            for i in self.layout.replicated
        ]
        terms += [
            (i, origins[i].call, origins[i].output) if i in origins else (i,)
            for i in self.layout.per_rank
        ]
        if self.generator is not None:
            terms.append((GENERATOR_SOURCE, _digests.digests([self.generator])[0].tolist()))
        if self.held is not None:
            terms += self.held.terms()
        return repr(terms)

    def _origin(self, i: int) -> str:
        known = self.origins.get(i)
        return NEW if known is None else known.origin

    def integer_labels(self) -> set[str]:
        """The labels of the replicated integer leaves (a step count: a skipped call)."""
        return {
            VALUE + self.layout.paths[i]
            for i in self.layout.replicated
            if not (self.tensors[i].is_floating_point() or self.tensors[i].is_complex())
        }

    def lines(self) -> tuple[list[Line], list[Line]]:
        """Every source as labelled lines, each replicated leaf by its value (hashed now where
        only its origin was known) and every tensor the program holds, then where each leaf
        comes from (compared only where every rank knows; per-rank leaves by origin)."""
        paths, order = self.layout.paths, self.layout.replicated
        unknown = [i for i in order if i not in self.hashed]
        found = dict(zip(unknown, _digests.digests([self.tensors[i] for i in unknown])))
        values: list[Line] = []
        if self.generator is not None:
            bits = int(_digests.digests([self.generator])[0, 0]) & (2**64 - 1)
            values.append((GENERATOR, f"digest {bits:016x}"))
        for i in order:
            digest = self.hashed.get(i, found.get(i))
            assert digest is not None
            values.append((VALUE + paths[i], describe_tensor(self.tensors[i], digest)))
        if self.held is not None:
            values += [(label, describe_tensor(t, d)) for label, t, d in self.held.values()]
        origins = [(VALUE + paths[i], self._origin(i)) for i in order]
        origins += [
            (f"argument leaf {paths[i]} ({why})", self._origin(i))
            for i, why in self.layout.per_rank.items()
        ]
        return values, origins
