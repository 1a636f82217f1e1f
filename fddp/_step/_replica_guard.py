"""Replicated inputs stay replicated: what must agree on each call, and the evidence that does."""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._base._errors import ReplicaMismatchError
from fddp._base._tree import leaves_with_paths
from fddp._compiler._passes._replication import drawn_bit, generator_bit
from fddp._compiler._program import Compiled
from fddp._ranks import _digests, _runtime
from fddp._ranks._agree import Line, find_difference
from fddp._ranks._signature import Signature, leaf_paths
from fddp._sharding import per_rank_leaves, sharded_positions

GENERATOR = "the random generator's state"
VALUE = "the value of argument leaf "  # the label of a replicated leaf's value, then its path
GENERATOR_SOURCE = -1  # in a set of sources: the random generator's state
RANK_SOURCE = -2  # in a set of sources: the rank itself
NEW = "not an output of this step"  # the origin of a tensor the step has not returned
_CALLS_REMEMBERED = 8  # outputs of this many last calls are known by their origin
_SHOWN_NUMEL = 8  # a tensor of at most this many elements is named by its values


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


def readable_paths(tree: Any) -> list[str]:
    """Each leaf's path as Python reaches it (``[1][0].count``, ``[0]['fc.weight']``)."""
    accessors, _, _ = optree.tree_flatten_with_accessor(tree)
    return [accessor.codify("") for accessor in accessors]


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (a CPU byte tensor)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def sources_of(compiled: Compiled, j: int) -> set[int]:
    """The sources output leaf ``j`` of ``compiled`` is computed from without a collective in
    between: tensor argument indices, :data:`GENERATOR_SOURCE`, :data:`RANK_SOURCE`."""
    outputs = compiled.captured.outputs
    assert outputs is not None  # known after the first call
    kind, v = outputs[j]
    if kind == "arg":
        return {v}
    if kind != "graph":
        return set()
    program, inputs = compiled.program, compiled.captured.inputs
    bits = program.output_dependencies[v]
    found = {s for k, s in enumerate(inputs) if isinstance(s, int) and bits >> k & 1}
    if bits & program.rank_bit:
        found.add(RANK_SOURCE)
    if bits & generator_bit(program.rank_bit):
        found.add(GENERATOR_SOURCE)
    return found


def _draws(compiled: Compiled, through_collectives: bool) -> bool:
    """Whether a random draw of the program reaches an output without a collective in
    between, or (``through_collectives``) at all."""
    program = compiled.program
    bit = (drawn_bit if through_collectives else generator_bit)(program.rank_bit)
    return any(bits & bit for bits in program.output_dependencies)


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


def _describe(t: torch.Tensor, digest: torch.Tensor) -> str:
    """A tensor as a line's value: small ones by their values, others by a digest of their
    bits."""
    bits = f"digest {int(digest[0]) & (2**64 - 1):016x}"
    if t.numel() <= _SHOWN_NUMEL:
        text = f"{t.tolist()!r}" if t.dim() else f"{t.item()!r}"
        nan = t.is_floating_point() and bool(torch.isnan(t).any())
        return f"{text} with {bits}" if nan else text  # NaNs of other bits print alike
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} with {bits}"


@dataclasses.dataclass
class Inputs:
    """What one call brings to the agreement beyond its signature.

    ``layout`` says which tensor arguments must be the same on every rank; each of those was
    either hashed now (``hashed``: index -> its digest) or is known to be the same everywhere
    from its origin: a replicated output of one of this step's calls (``origins``: index ->
    :class:`Returned`), which every rank must then name alike. Per-rank leaves
    of a sharded layout enter by their origin alone. ``generator``: the random generator's
    state, where the step's results depend on it.
    """

    layout: Layout
    tensors: list[torch.Tensor]
    hashed: dict[int, torch.Tensor]
    origins: dict[int, Returned]
    generator: torch.Tensor | None = None

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
        only its origin was known), then where each leaf comes from (compared only where every
        rank knows; per-rank leaves by origin)."""
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
            values.append((VALUE + paths[i], _describe(self.tensors[i], digest)))
        origins = [(VALUE + paths[i], self._origin(i)) for i in order]
        origins += [
            (f"argument leaf {paths[i]} ({why})", self._origin(i))
            for i, why in self.layout.per_rank.items()
        ]
        return values, origins


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
class _Facts:
    """What the guard learned of one program: per output leaf its sources and path (once its
    outputs are known), and the sources its replicated outputs need beyond the replicated
    arguments."""

    ref: weakref.ref
    needed: set[int]
    sources: list[frozenset[int]] | None = None
    paths: list[str] | None = None

    def outputs(self, compiled: Compiled, out: Any) -> tuple[list[frozenset[int]], list[str]]:
        if self.sources is None or self.paths is None:
            count = len(compiled.captured.outputs or ())
            interned: dict[frozenset[int], frozenset[int]] = {}
            self.sources = []
            for j in range(count):
                found = frozenset(sources_of(compiled, j))
                self.sources.append(interned.setdefault(found, found))
            self.paths = readable_paths(out)
        return self.sources, self.paths


class ReplicaGuard:
    """The replication checks of one step object (``argnums``: its ``check_replicas``;
    ``generator``: whether every random draw must agree, as under the invariant mode)."""

    def __init__(
        self,
        name: str,
        group: dist.ProcessGroup | None,
        argnums: tuple[int, ...],
        *,
        generator: bool = False,
    ) -> None:
        self._name, self._group, self._argnums = name, group, argnums
        self._generator = generator
        self._layouts: dict[Signature, Layout] = {}
        self._known: dict[int, Returned] = {}  # id of an output tensor -> what it is
        self._by_call: collections.deque[list[int]] = collections.deque()  # their ids by call
        self._last: Compiled | None = None  # the program the last call ran
        self._calls = 0  # calls whose outputs were recorded
        self._first_checked: set[int] = set()  # what a program's first run found the same
        self._facts: dict[int, _Facts] = {}  # by the id of the program
        # per-rank output leaves of the last call: id -> (the leaf, its path, its source)
        self._fed_back: dict[int, tuple[weakref.ref, str, str]] = {}

    def _several_ranks(self) -> bool:
        return _runtime.world_size(self._group) > 1

    def layout(self, signature: Signature, args: tuple) -> Layout:
        found = self._layouts.get(signature)
        if found is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            found = self._layouts[signature] = layout_of(args, self._argnums)
        return found

    def inputs(
        self,
        signature: Signature,
        args: tuple,
        tensors: list[torch.Tensor],
        compiled: Compiled | None,
        device: torch.device,
        *,
        eager: bool = False,
    ) -> Inputs | None:
        """What this call brings to the agreement (None in a world of one; ``compiled``: the
        program the call will run, None before its first compile or in an ``eager`` step,
        which under the invariant mode brings the generator's state on every call). The replicated
        arguments' leaves, and what the replicated outputs fed back into them were computed
        from (learned on earlier calls of ``compiled``), each hashed unless it is the unchanged
        replicated output of a call (one hash per new tensor, none for a step's own state)."""
        self._first_checked = set()
        if not self._several_ranks():
            return None
        layout = self.layout(signature, args)
        needed = self._needed(layout, tensors, compiled)
        more = needed - set(layout.replicated) - set(layout.per_rank)
        replicated = [*layout.replicated, *sorted(i for i in more if i >= 0)]
        layout = dataclasses.replace(layout, replicated=replicated)
        origins: dict[int, Returned] = {}
        unproven = []
        for i in [*replicated, *layout.per_rank]:
            known = self._known.get(id(tensors[i]))
            if known is None or known.ref() is not tensors[i]:
                unproven.append(i)
                continue
            origins[i] = known
            if i in layout.per_rank:
                continue
            if not known.replicated or known.version != tensors[i]._version:
                unproven.append(i)
        hashed_indices = [i for i in unproven if i not in layout.per_rank]
        found = _digests.digests([tensors[i] for i in hashed_indices])
        hashed = dict(zip(hashed_indices, found))
        generator = None
        if GENERATOR_SOURCE in needed or (self._generator and eager):
            generator = generator_state(device)
        return Inputs(layout, tensors, hashed, origins, generator)

    def _needed(
        self, layout: Layout, tensors: list[torch.Tensor], compiled: Compiled | None
    ) -> set[int]:
        """The sources this call's replicated outputs need beyond the replicated arguments:
        learned from the last call of the same program, whose outputs that come back in them
        were computed from these."""
        if compiled is None or compiled.varying_outputs is None:
            return set()
        program: Compiled = compiled
        facts = self._facts_of(program)
        needed = facts.needed
        if self._last is not program or facts.sources is None:
            return needed
        todo = [*layout.replicated, *(i for i in needed if i >= 0)]
        seen = set(todo)
        merged: set[int] = set()  # the source sets taken in (a foreach update's outputs share one)
        while todo:
            i = todo.pop()
            known = self._known.get(id(tensors[i])) if 0 <= i < len(tensors) else None
            if known is None or known.ref() is not tensors[i] or known.call != self._calls:
                continue
            sources = facts.sources[known.output]
            if id(sources) in merged:
                continue
            merged.add(id(sources))
            for source in sources - seen:
                seen.add(source)
                needed.add(source)
                if source >= 0:
                    todo.append(source)
        return needed

    def _facts_of(self, compiled: Compiled) -> _Facts:
        """What is known of ``compiled``; at first, under the invariant mode, that its random
        draws must agree."""
        facts = self._facts.get(id(compiled))
        if facts is None or facts.ref() is not compiled:
            if len(self._facts) >= 64:
                self._facts = {k: f for k, f in self._facts.items() if f.ref() is not None}
            needed = {GENERATOR_SOURCE} if self._generator and _draws(compiled, True) else set()
            facts = self._facts[id(compiled)] = _Facts(weakref.ref(compiled), needed)
        return facts

    def after_call(self, compiled: Compiled | None, inputs: Inputs | None, out: Any) -> None:
        """Record the call's output tensors: where each came out, and whether it is the same
        on every rank: computed, without a collective in between, only from sources this call
        checked (``inputs``), by a program the ranks compared."""
        self._calls += 1
        self._last = compiled
        if inputs is None:
            return
        call = self._calls
        checked = {*inputs.layout.replicated, *(() if inputs.generator is None else (-1,))}
        checked |= self._first_checked
        self._first_checked = set()
        varying = None if compiled is None else compiled.varying_outputs
        if compiled is None or varying is None:
            sources, paths = None, readable_paths(out)
        else:
            sources, paths = self._facts_of(compiled).outputs(compiled, out)
        ids = []
        within: dict[int, bool] = {}  # per distinct source set, whether this call checked it
        for j, leaf in enumerate(optree.tree_leaves(out)):
            if not isinstance(leaf, torch.Tensor):
                continue
            replicated = False
            if sources is not None and j not in varying:  # type: ignore[operator]
                found = within.get(id(sources[j]))
                if found is None:
                    found = within[id(sources[j])] = sources[j] <= checked
                replicated = found
            self._known[id(leaf)] = Returned(
                weakref.ref(leaf), j, call, replicated, leaf._version, paths
            )
            ids.append(id(leaf))
        self._forget(ids, call)

    def _forget(self, ids: list[int], call: int) -> None:
        """Keep the outputs of the last few calls only."""
        self._by_call.append(ids)
        if len(self._by_call) > _CALLS_REMEMBERED:
            for k in self._by_call.popleft():
                known = self._known.get(k)
                if known is not None and known.call <= call - _CALLS_REMEMBERED:
                    del self._known[k]

    def first_run(
        self,
        args: tuple,
        tensors: list[torch.Tensor],
        compiled: Compiled,
        device: torch.device,
        hashed: dict[int, torch.Tensor] | None = None,
    ) -> list[bool]:
        """Before a traced signature's first run: which tensor arguments differ between ranks
        (one small all-gather of digests, the random generator's state with them where the
        program draws from it); the replicated arguments must not, nor the generator where a
        random draw reaches an output that is otherwise the same on every rank. ``hashed``:
        digests the call already has (its :class:`Inputs`), not computed again."""
        if not self._several_ranks():
            return [False] * len(tensors)
        extra = [generator_state(device)] if _draws(compiled, self._generator) else []
        sources = [*tensors, *extra]
        hashed = hashed or {}
        rest = [i for i in range(len(sources)) if i not in hashed]
        known = torch.zeros(len(sources), 2, dtype=torch.int64)
        if hashed:
            known[list(hashed)] = torch.stack(list(hashed.values()))
        known[rest] = _digests.digests([sources[i] for i in rest])
        varying = _digests.varying(sources, self._group, known)
        generator_varies = bool(extra) and varying.pop()
        layout = layout_of(args, self._argnums)
        paths = layout.paths
        for i in layout.replicated:
            if varying[i]:
                raise ReplicaMismatchError(
                    f"arguments {list(self._argnums)} of {self._name} differ between "
                    f"ranks: leaf {paths[i]} is not the same on every rank. Replicas must "
                    "start from the same values: create them from the same seed and model "
                    "code, or call fddp.replicate(tree) before training; check_replicas=False "
                    "turns this check off."
                )
        if generator_varies and self._generator_matters(compiled, varying):
            bits = int(_digests.digests(extra)[0, 0]) & (2**64 - 1)
            named = find_difference([(GENERATOR, f"digest {bits:016x}")], self._group)
            raise ReplicaMismatchError(
                f"{self._name}: {named}, and the step's results depend on its draws"
                + (
                    " (under the invariant mode, dropout is drawn from it: the results would "
                    "depend on the world size)"
                    if self._generator
                    else " where they must be the same on every rank"
                )
                + ". Seed every rank alike (torch.manual_seed(seed) before the first call, "
                "and fddp.save/load its state with the checkpoint)."
            )
        self._first_checked = {i for i, differs in enumerate(varying) if not differs}
        if extra and not generator_varies:
            self._first_checked.add(GENERATOR_SOURCE)
        return varying

    def _generator_matters(self, compiled: Compiled, varying: list[bool]) -> bool:
        """Under the invariant mode, always; otherwise where a random draw reaches an output
        computed from nothing else that differs between ranks."""
        if self._generator:
            return True
        outputs = compiled.captured.outputs or []
        for j in range(len(outputs)):
            sources = sources_of(compiled, j)
            if GENERATOR_SOURCE in sources and not any(
                s == RANK_SOURCE or (s >= 0 and varying[s]) for s in sources
            ):
                return True
        return False

    def before_run(
        self,
        compiled: Compiled,
        args: tuple,
        tensors: list[torch.Tensor],
        device: torch.device,
        inputs: Inputs | None,
    ) -> None:
        """The checks due before a traced call runs: on its program's first run, those of
        :meth:`first_run`; on every run, :meth:`refuse_fed_back`."""
        if compiled.varying_tensors is None:
            hashed = None if inputs is None else inputs.hashed
            compiled.varying_tensors = self.first_run(args, tensors, compiled, device, hashed)
        self.refuse_fed_back(args)

    def after_run(self, compiled: Compiled, args: tuple, out: Any, inputs: Inputs | None) -> None:
        """After a traced call: its per-rank output leaves (learned after its program's first
        run), to refuse them next time, and what every output is (:meth:`after_call`)."""
        if compiled.varying_outputs is None:
            assert compiled.varying_tensors is not None  # learned before the first run
            compiled.varying_outputs = compiled.output_sources(
                compiled.varying_tensors, tensor_paths(args)
            )
        self.remember(compiled.varying_outputs, out)
        self.after_call(compiled, inputs, out)

    def compare_trees(self, args: tuple) -> None:
        """Raise :class:`ReplicaMismatchError` on every rank if the replicated arguments' trees
        differ (structure, shapes, dtypes, bits; a sharded layout's per-rank leaves by shape
        alone); collective. Run when the signatures differ, to name the leaf."""
        if not self._argnums or not self._several_ranks():
            return
        checked = [n % len(args) for n in self._argnums if -len(args) <= n < len(args)]
        per_rank = set(per_rank_leaves(tuple(args[n] for n in checked)))
        paths, leaves, spec = leaves_with_paths([args[n] for n in checked])
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        digests = iter(_digests.digests(tensors))
        lines: list[Line] = []
        for k, (path, leaf) in enumerate(zip(paths, leaves)):
            digest = next(digests) if isinstance(leaf, torch.Tensor) else None
            if digest is None:
                text = repr(leaf)
            elif k in per_rank:
                text = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}"
            else:
                text = _describe(leaf, digest)
            lines.append((f"leaf {path}", text))
        lines.append(("the tree structure", str(spec)))
        difference = find_difference(lines, self._group)
        if difference is not None:
            raise ReplicaMismatchError(
                f"arguments {list(self._argnums)} of {self._name} differ between ranks: "
                f"{difference}. Replicas must start from the same values: create them from "
                "the same seed and model code, or call fddp.replicate(tree) before training."
            )

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
