"""Replicated arguments stay replicated: compared on first calls, per-rank outputs refused."""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError
from fddp._base._tree import leaves_with_paths
from fddp._compiler._program import Compiled
from fddp._ranks import _digests, _runtime
from fddp._ranks._signature import leaf_paths
from fddp._sharding import sharded_positions


def describe_source(source: str) -> str:
    return source if source.startswith("the rank") else f"argument leaf {source}"


def tensor_paths(args: tuple) -> list[str]:
    leaves = optree.tree_leaves(args)
    return [p for p, x in zip(leaf_paths(args), leaves) if isinstance(x, torch.Tensor)]


def tensor_indices_of_arg(args: tuple, n: int) -> range:
    """Positions, among all tensor leaves of ``args``, of those inside argument ``n``."""
    before = sum(isinstance(x, torch.Tensor) for a in args[:n] for x in optree.tree_leaves(a))
    count = sum(isinstance(x, torch.Tensor) for x in optree.tree_leaves(args[n]))
    return range(before, before + count)


class ReplicaGuard:
    """The replication checks of one step object (``argnums``: its ``check_replicas``)."""

    def __init__(
        self, name: str, group: dist.ProcessGroup | None, argnums: tuple[int, ...]
    ) -> None:
        self._name, self._group, self._argnums = name, group, argnums
        self._digest_checks_left = 2  # the first call; eager steps also the second
        # per-rank output leaves of the last call: id -> (the leaf, its path, its source)
        self._fed_back: dict[int, tuple[weakref.ref, str, str]] = {}

    def _checked(self, args: tuple) -> list[int]:
        """The positions checked: those asked for, but sharded parameters (per rank by
        design)."""
        sharded = sharded_positions(args)
        return [
            n % len(args)
            for n in self._argnums
            if -len(args) <= n < len(args) and n % len(args) not in sharded
        ]

    def _several_ranks(self) -> bool:
        return bool(self._argnums) and _runtime.world_size(self._group) > 1

    def check_digests(self, args: tuple, *, eager: bool, known: torch.Tensor | None = None) -> None:
        """The replicated arguments must agree bitwise before the first call and, for eager
        steps that the replication analysis cannot see, before the second (which catches a
        first call that made them differ, e.g. a forgotten pmean). ``known``: the digests of
        all of ``args``' tensor leaves, where the caller has them."""
        if self._digest_checks_left == 0 or not (eager or self._digest_checks_left == 2):
            return
        self._digest_checks_left -= 1
        self.compare_digests(args, known)

    def compare_digests(self, args: tuple, known: torch.Tensor | None = None) -> None:
        """Raise :class:`ReplicaMismatchError` on every rank if the replicated arguments differ
        (their trees, shapes, dtypes or bits); collective."""
        if not self._several_ranks():
            return
        what = f"arguments {list(self._argnums)} of {self._name}"
        if self._digest_checks_left < 2:  # a first call has been checked
            what += " after the first call (does the step average its gradients with fddp.pmean?)"
        checked = self._checked(args)
        if known is not None:
            known = known[[i for n in checked for i in tensor_indices_of_arg(args, n)]]
        _digests.check_identical([args[n] for n in checked], self._group, what, known)

    def first_run(self, args: tuple, tensors: list[torch.Tensor]) -> list[bool]:
        """Before a traced signature's first run: the replicated arguments agree
        (:meth:`check_digests`), and which tensor arguments differ between ranks
        (:meth:`varying_tensors`); each tensor is hashed once for both."""
        several = _runtime.world_size(self._group) > 1
        known = _digests.digests(tensors) if several else None
        self.check_digests(args, eager=False, known=known)
        return self.varying_tensors(args, tensors, known)

    def varying_tensors(
        self, args: tuple, tensors: list[torch.Tensor], known: torch.Tensor | None = None
    ) -> list[bool]:
        """First call of a signature: which tensor arguments differ between ranks (one small
        all-gather of digests); the replicated arguments must not. ``known``: the tensors'
        digests, where the caller has them."""
        if _runtime.world_size(self._group) == 1:
            return [False] * len(tensors)
        varying = _digests.varying(tensors, self._group, known)
        paths = tensor_paths(args)
        for n in self._checked(args):
            for i in tensor_indices_of_arg(args, n):
                if varying[i]:
                    raise ReplicaMismatchError(
                        f"arguments {list(self._argnums)} of {self._name} differ between "
                        f"ranks: leaf {paths[i]} is not the same on every rank. Replicas must "
                        "start from the same values: create them from the same seed and model "
                        "code, or call fddp.replicate(tree) before training."
                    )
        return varying

    def before_run(self, compiled: Compiled, args: tuple, tensors: list[torch.Tensor]) -> None:
        """The checks due before a traced call runs: on its program's first run, those of
        :meth:`first_run`; on every run, :meth:`refuse_fed_back`."""
        if compiled.varying_tensors is None:
            compiled.varying_tensors = self.first_run(args, tensors)
        self.refuse_fed_back(args)

    def after_run(self, compiled: Compiled, args: tuple, out: Any) -> None:
        """After a traced call: its per-rank output leaves (learned after its program's first
        run), to refuse them next time."""
        if compiled.varying_outputs is None:
            assert compiled.varying_tensors is not None  # learned before the first run
            compiled.varying_outputs = compiled.output_sources(
                compiled.varying_tensors, tensor_paths(args)
            )
        self.remember(compiled.varying_outputs, out)

    def remember(self, varying: dict[int, tuple[str, str]], out: Any) -> None:
        """After a call: its per-rank output leaves (index -> path, source), to refuse them
        next time."""
        self._fed_back = {}
        if not varying:
            return
        leaves = optree.tree_leaves(out)
        for j, (path, source) in varying.items():
            if isinstance(leaves[j], torch.Tensor):
                self._fed_back[id(leaves[j])] = (weakref.ref(leaves[j]), path, source)

    def refuse_fed_back(self, args: tuple) -> None:
        """A per-rank output of the last call passed back as a replicated argument is the
        signature of a forgotten ``pmean``: the replicas have started to drift apart."""
        if not self._fed_back:
            return
        for n in self._checked(args):
            paths, leaves, _ = leaves_with_paths(args[n])
            for path, leaf in zip(paths, leaves):
                found = self._fed_back.get(id(leaf))
                if found is None or found[0]() is not leaf:
                    continue
                _, output, source = found
                raise ReplicaMismatchError(
                    f"{self._name}: argument {n} leaf {path} is output leaf {output} of "
                    "the previous call, which differs between ranks: it is computed from the "
                    f"per-rank {describe_source(source)} with no collective in between, so the "
                    "replicas have started to drift apart. Average the gradients with "
                    "fddp.pmean(grads) (or pmean/psum the value) before the update. Per-rank "
                    "values are fine as metrics that are only logged; arguments that may "
                    "differ per rank are left out with check_replicas=(...)."
                )
