"""A compiled step: the scheduled graph's runner and how the step's outputs come out of it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import optree
import torch
from torch import fx

from fddp._base import _axes
from fddp._compiler import _backend, _plan
from fddp._compiler._capture._trace import Captured, DynamoCapture
from fddp._compiler._passes import _across_steps, _cost, _gate
from fddp._ranks._signature import leaf_paths

RANK_SOURCE = "the rank (fddp.axis_index, or a psum_scatter block)"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within the block, as it was afterwards.

    Compiling a step allocates millions of small objects and almost no garbage cycles: the
    collections they set off walked the whole growing heap (about 0.9 s of a 32-layer model's
    first call). Running one allocates a Python tensor per graph node (about 30,000 at 96
    layers), and activations that live across the step's collections were promoted until a full
    collection of the heap (the compiled graph included, 0.4 s at 96 layers) ran every 10 to 20
    steps. A step's tensors die by reference count; the collector runs after it, as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclasses.dataclass
class Program:
    """A scheduled graph ready to run, with its plan, its collective sequence, and for each
    graph output the placeholders it depends on without a collective in between (see
    ``_replication.dependencies``). ``graph_of`` returns the graph (a program loaded from the
    persistent cache builds it when asked)."""

    graph_of: Callable[[], fx.GraphModule]
    schedule: _plan.Plan
    sequence: list[str]
    run: _backend.Runner
    output_dependencies: list[int]
    rank_bit: int
    profile: _cost.Profile  # what the cap was chosen from
    cap: int
    across_steps: _across_steps.AcrossSteps | None = None  # overlap_steps=True, if any wait
    gated: bool = False  # a gate settles the call's signature check before the first collective
    generated: _backend.Generated | None = None  # the fx backend's code
    # the captured program's digest, as the ranks compare it (``_identity.program_lines``);
    # kept with a program in the persistent cache
    known_graph_digest: int | None = None

    @functools.cached_property
    def graph(self) -> fx.GraphModule:
        return self.graph_of()

    def graph_digest(self) -> int:
        """The digest of the captured program the ranks compared (set by the compile)."""
        assert self.known_graph_digest is not None
        return self.known_graph_digest


@dataclasses.dataclass
class Compiled:
    """The program for one signature, the capture it came from, and what its first call learns.

    A Dynamo capture (``dynamo`` set) learns where each output leaf comes from on its first run,
    which goes through Dynamo. The first call also learns which tensor arguments differ across
    ranks (``varying_tensors``, before it runs) and so which outputs do (``varying_outputs``:
    output leaf -> its path and what it is computed from, see :meth:`output_sources`).
    """

    program: Program
    captured: Captured
    dynamo: DynamoCapture | None
    varying_tensors: list[bool] | None = None
    varying_outputs: dict[int, tuple[str, str]] | None = None
    from_cache: bool = False  # loaded from the persistent program cache
    # the tensors the program holds by reference that the ranks compared at the compile
    # (``_identity.held_tensors``: closed over, constants), by node name, and the versions of
    # the first of them when the ranks last agreed on their values (kept by the step; the rest
    # are inference tensors, which have no version counter)
    held: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    held_versions: list[int] = dataclasses.field(default_factory=list)
    # what its first run that returns calls with it (writing it to the persistent cache: a
    # Dynamo capture learns its outputs in that run), then forgets
    after_first_run: Callable[[Compiled], None] | None = None

    def changed(self) -> str | None:
        """What the capture read (a module's attribute, autocast ...) that reads differently
        now, None when nothing does: the program computes what the step would."""
        guards = self.captured.guards
        return None if guards is None else guards.check()

    @property
    def first_call(self) -> bool:
        """Whether the next call is the first (it runs collectives of its own before the step)."""
        return self.varying_tensors is None or self.dynamo is not None

    def run(
        self,
        args: tuple,
        tensors: list[torch.Tensor],
        settle: Callable[[], None],
        axes: Sequence[_axes.Axis],
    ) -> Any:
        """Run the step; ``settle`` (the call's agreement) runs before its first collective,
        and before anything at all when no gate sits in the graph."""
        if self.dynamo is not None:
            settle()
            out = self._run_first(args, tensors, axes)
        else:
            out = self._run_program(tensors, settle)
        after, self.after_first_run = self.after_first_run, None
        if after is not None:
            after(self)
        return out

    def _run_program(self, tensors: list[torch.Tensor], settle: Callable[[], None]) -> Any:
        program = self.program
        if not program.gated or program.across_steps is not None:
            settle()  # a merged program runs the last call's tail before its gate
        with _gate.armed(settle), collector_paused():
            results = (program.across_steps or program.run)(self.graph_inputs(tensors))
        settle()
        outputs = self.captured.outputs
        assert outputs is not None  # a Dynamo capture learns them in _run_first
        leaves = [
            results[v] if kind == "graph" else tensors[v] if kind == "arg" else v
            for kind, v in outputs
        ]
        return optree.tree_unflatten(self.captured.out_spec, leaves)

    def graph_inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[i] if isinstance(i, int) else i for i in self.captured.inputs]

    def _run_first(
        self, args: tuple, tensors: list[torch.Tensor], axes: Sequence[_axes.Axis]
    ) -> Any:
        """Run a Dynamo capture once through Dynamo, learning where each output leaf comes from."""
        assert self.dynamo is not None
        with _axes.bind(*axes):
            out, graph_outputs = self.dynamo.run_once(args, self.program.run)
        self.dynamo = None
        leaves, out_spec = optree.tree_flatten(out)
        from_graph = {id(t): k for k, t in enumerate(graph_outputs)}
        from_args = {id(t): i for i, t in enumerate(tensors)}
        outputs: list[tuple[str, Any]] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                outputs.append(("const", leaf))
            elif id(leaf) in from_graph:
                outputs.append(("graph", from_graph[id(leaf)]))
            elif id(leaf) in from_args:
                outputs.append(("arg", from_args[id(leaf)]))
            else:
                raise AssertionError("an output tensor of the captured step has no known source")
        self.captured = dataclasses.replace(self.captured, outputs=outputs, out_spec=out_spec)
        return out

    def output_paths(self) -> list[str]:
        spec = self.captured.out_spec
        assert spec is not None  # known after the first call
        return leaf_paths(optree.tree_unflatten(spec, list(range(spec.num_leaves))))

    def output_sources(
        self, varying: list[bool], tensor_paths: list[str]
    ) -> dict[int, tuple[str, str]]:
        """Which output leaves vary across ranks, given which tensor arguments do: output leaf
        -> its path and the path of a per-rank argument leaf it is computed from without a
        collective in between (or :data:`RANK_SOURCE`)."""
        program, outputs, inputs = self.program, self.captured.outputs, self.captured.inputs
        assert outputs is not None  # known after the first call
        per_rank = 0  # a bit per placeholder that holds a varying argument
        for k, s in enumerate(inputs):
            if isinstance(s, int) and varying[s]:
                per_rank |= 1 << k
        sources = {}
        for j, (kind, v) in enumerate(outputs):
            if kind == "arg" and varying[v]:
                sources[j] = tensor_paths[v]
            elif kind == "graph":
                bits = program.output_dependencies[v]
                if bits & program.rank_bit:
                    sources[j] = RANK_SOURCE
                elif bits & per_rank:
                    first = (bits & per_rank & -(bits & per_rank)).bit_length() - 1
                    sources[j] = tensor_paths[cast(int, inputs[first])]
        paths = self.output_paths() if sources else []
        return {j: (paths[j], source) for j, source in sources.items()}
