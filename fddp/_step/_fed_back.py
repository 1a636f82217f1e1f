"""A per-rank output passed back as a replicated argument is refused before the replicas drift."""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch

from fddp._base._errors import ReplicaMismatchError
from fddp._base._tree import leaves_with_paths
from fddp._sharding import per_rank_leaves, sharded_positions
from fddp._step._program_facts import describe_source


class FedBack:
    """The per-rank output leaves of a step object's last call, refused as replicated
    arguments of the next (``argnums``: its ``check_replicas``)."""

    def __init__(self, name: str, argnums: tuple[int, ...]) -> None:
        self._name, self._argnums = name, argnums
        # per-rank output leaves of the last call: id -> (the leaf, its path, its source)
        self._fed_back: dict[int, tuple[weakref.ref, str, str]] = {}

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

    def refuse(self, args: tuple) -> None:
        """A per-rank output of the last call passed back as a replicated argument is the
        signature of a forgotten ``pmean``: the replicas have started to drift apart."""
        if not self._fed_back:
            return
        sharded = sharded_positions(args)
        checked = [
            n % len(args)
            for n in self._argnums
            if -len(args) <= n < len(args) and n % len(args) not in sharded
        ]
        per_rank = per_rank_leaves(args)
        offset = {n: sum(len(optree.tree_leaves(a)) for a in args[:n]) for n in checked}
        for n in checked:
            paths, leaves, _ = leaves_with_paths(args[n])
            for k, (path, leaf) in enumerate(zip(paths, leaves)):
                found = self._fed_back.get(id(leaf))
                if found is None or found[0]() is not leaf or offset[n] + k in per_rank:
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
