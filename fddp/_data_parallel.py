"""fddp.data_parallel: a step traced once per input signature, run as a scheduled graph."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp import _axes, _pending, _replicas, _runtime, _timeline
from fddp._agree import DigestCheck, find_difference, gather_difference
from fddp._collectives import ProcessAxis, process_axis
from fddp._errors import (
    RankFailureError,
    ReplicaMismatchError,
    RetraceWarning,
    ScheduleMismatchError,
    UsageError,
    UsageValueError,
)
from fddp._schedule import _cost, _gate
from fddp._schedule._capture import Captured, DynamoCapture, trace_with_make_fx
from fddp._schedule._pipeline import Options, Program, schedule_graph
from fddp._schedule._plan import Plan
from fddp._signature import Signature, leaf_paths, portable_lines, signature_of
from fddp._tree import leaves_with_paths

RETRACE_WARNING_AFTER = 3  # retraces caused by one leaf before it is named in a warning


_inside = threading.local()
_one_step_at_a_time = threading.Lock()


@contextlib.contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """One data_parallel step at a time per process: collectives must run in the same order on
    every rank, which two threads (or a step inside a step) cannot promise."""
    outer = getattr(_inside, "name", None)
    if outer is not None:
        raise UsageValueError(
            f"{name} was called inside the data_parallel step {outer}: nesting data_parallel "
            "is not supported. Call the undecorated inner function inside the outer step (its "
            "collectives are scheduled with the outer step's), or call the steps one after "
            "the other."
        )
    if not _one_step_at_a_time.acquire(blocking=False):
        raise RuntimeError(
            f"{name} was called while another data_parallel step runs in another thread. "
            "Steps issue collectives that must run in the same order on every rank, which "
            "concurrent calls cannot promise: call the steps from one thread (e.g. run "
            "evaluation after the training step returns, not beside it)."
        )
    _inside.name = name
    try:
        yield
    finally:
        _inside.name = None
        _one_step_at_a_time.release()


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Why an output leaf varies across ranks: the per-rank argument leaf it comes from."""

    output: str
    source: str


@dataclasses.dataclass
class _Entry:
    """A compiled program for one signature, and how to map its outputs back to a pytree."""

    program: Program
    captured: Captured
    dynamo: DynamoCapture | None
    varying_tensors: list[bool] | None = None  # per tensor argument, learned on the first call
    varying_outputs: dict[int, _Origin] | None = None  # output leaf index -> origin

    def run(self, tensors: list[torch.Tensor]) -> Any:
        graph_inputs = [tensors[i] if isinstance(i, int) else i for i in self.captured.inputs]
        results = (self.program.across_steps or self.program.run)(graph_inputs)
        outputs = self.captured.outputs
        assert outputs is not None  # a Dynamo capture learns them in run_first
        leaves = [
            results[v] if kind == "graph" else tensors[v] if kind == "arg" else v
            for kind, v in outputs
        ]
        return optree.tree_unflatten(self.captured.out_spec, leaves)

    def run_first(self, args: tuple, tensors: list[torch.Tensor], axis: ProcessAxis) -> Any:
        """Run a Dynamo capture once through Dynamo, learning where each output leaf comes from."""
        assert self.dynamo is not None  # the entry of a Dynamo capture, run for the first time
        with _axes.bind(axis):
            out, graph_outputs = self.dynamo.run_once(args, self.program.run)
        self.dynamo = None
        leaves, out_spec = optree.tree_flatten(out)
        from_graph = {id(t): k for k, t in enumerate(graph_outputs)}
        from_args = {id(t): i for i, t in enumerate(tensors)}
        outputs = []
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

    def output_origins(self, tensor_paths: list[str]) -> dict[int, _Origin]:
        """Which output leaves vary across ranks, given which tensor arguments do."""
        varying, program = self.varying_tensors, self.program
        outputs, out_spec = self.captured.outputs, self.captured.out_spec
        assert varying is not None and outputs is not None  # both known after the first call
        placeholder_sources = self.captured.inputs
        out_paths = [p for p in _output_paths(out_spec)]
        origins = {}
        for j, (kind, v) in enumerate(outputs):
            source = None
            if kind == "arg" and varying[v]:
                source = tensor_paths[v]
            elif kind == "graph":
                bits = program.output_dependencies[v]
                if bits & program.rank_bit:
                    source = "the rank (fddp.axis_index, or a psum_scatter block)"
                for k, s in enumerate(placeholder_sources):
                    if source is None and bits >> k & 1 and isinstance(s, int) and varying[s]:
                        source = tensor_paths[s]
            if source is not None:
                origins[j] = _Origin(out_paths[j], source)
        return origins


def _output_paths(spec: optree.PyTreeSpec) -> list[str]:
    dummy = optree.tree_unflatten(spec, list(range(spec.num_leaves)))
    return leaf_paths(dummy)


def _settled() -> None:
    """The signature check of a world of one."""


class DataParallelStep:
    """A replicated training step; call it like the step it wraps."""

    __name__: str  # the step's, copied by functools.update_wrapper

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *,
        axis_name: str,
        options: Options,
        donate_argnums: tuple[int, ...],
        group: dist.ProcessGroup | None,
        trace: bool,
        check_replicas: tuple[int, ...],
        cache_size: int,
    ) -> None:
        functools.update_wrapper(self, step_fn)
        self._step_fn = step_fn
        self._axis_name = axis_name
        self._options = options
        self._donate_argnums = donate_argnums
        self._group = group
        self._trace = trace
        self._replicated_argnums = check_replicas
        self._cache_size = cache_size
        self._profiling = False
        self._cache: collections.OrderedDict[Signature, _Entry] = collections.OrderedDict()
        self._lines: dict[Signature, tuple[list, int]] = {}
        self._last_signature: Signature | None = None
        self._retraces_by_leaf: collections.Counter[str] = collections.Counter()
        self._warned: set[str] = set()
        self._replicas_checks_left = 2
        self._fed_back: dict[int, tuple[weakref.ref, _Origin]] = {}
        self._side_group: dist.ProcessGroup | None = None
        self.retraces = 0
        # Inside a user's torch.compile the step runs as one opaque call. Wrapped here, not at
        # class definition, so that importing fddp does not import Dynamo.
        self._opaque_call = torch.compiler.disable(self._guarded_call)

    def _axis(self, traced: bool = False) -> ProcessAxis:
        return process_axis(self._axis_name, self._group, traced=traced)

    def _world(self) -> int:
        return _runtime.world_size(self._group)

    @contextlib.contextmanager
    def profile(self, path: str | os.PathLike) -> Iterator[None]:
        """Record the steps run inside the block as a Chrome trace at ``path`` (written by rank 0).

        Every rank's operators and its all-reduces, as measured by ``torch.profiler``, one
        process per rank; open it in https://ui.perfetto.dev or render it with
        ``fddp.plot_timeline``.
        """
        self._profiling = True
        try:
            with _timeline.record(path, self._group):
                yield
        finally:
            self._profiling = False

    def __call__(self, *args: Any) -> Any:
        return self._opaque_call(*args)

    def _guarded_call(self, *args: Any) -> Any:
        with _exclusive(self.__name__):
            start = time.monotonic()
            try:
                return self._call(args)
            except RuntimeError as e:
                if isinstance(e, RankFailureError) or not _runtime.is_peer_failure(e):
                    raise
                raise _runtime.peer_failure(e, self.__name__, time.monotonic() - start) from e

    def _call(self, args: tuple) -> Any:
        _runtime.ensure_group()
        signature, leaves = signature_of(args)  # a pending output has its value's signature
        if not self._options.overlap_steps and any(map(_pending.is_pending, leaves)):
            args = _pending.finished(args)
            leaves = optree.tree_leaves(args)
        if self._replicas_checks_left == 2 or not self._trace:
            self._check_replicas(args)
        check = self._check_signature(signature, args) if self._world() > 1 else _settled
        if not self._trace:
            check()
            with _axes.bind(self._axis()):
                return self._step_fn(*args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self._fed_back:
            self._refuse_varying_feedback(args)
        entry = self._cache.get(signature)
        if entry is None:
            check()  # before the capture agreement's collectives
            entry = self._compile(signature, args, tensors)
        self._cache.move_to_end(signature)
        if entry.varying_tensors is None:
            check()
            self._learn_replication(entry, args, tensors)
        if entry.captured.outputs is None:
            check()
            out = entry.run_first(args, tensors, self._axis(traced=True))
        else:
            if not entry.program.gated or entry.program.across_steps is not None:
                check()  # a merged program runs the last call's tail before its gate
            profiling = _timeline.step_range() if self._profiling else contextlib.nullcontext()
            with profiling, _gate.armed(check):
                out = entry.run(tensors)
        check()  # a step without collectives has no gate
        if entry.varying_outputs is None:
            entry.varying_outputs = entry.output_origins(_tensor_paths(args))
        self._remember_varying(entry, out)
        return out

    def _check_signature(self, signature: Signature, args: tuple) -> Callable[[], None]:
        """Every call: one tiny all-reduce checks that all ranks pass the same signature.

        Without it a rank whose batch alone changed shape would trace the step again while the
        others run the cached one, and all would wait for the timeout; on the eager path its
        collectives would mix unrelated leaves. The all-reduce is launched here; the returned
        function settles it (waits, and raises on every rank if they differ), and must run
        before the step's first collective: the scheduled graph's gate calls it there.
        """
        if signature not in self._lines:
            if len(self._lines) > 4 * self._cache_size:
                self._lines.clear()
            self._lines[signature] = portable_lines(signature, args)
        lines, digest = self._lines[signature]
        group = self._agreement_group()
        in_flight: list[DigestCheck] = [DigestCheck(digest, group)]

        def settle() -> None:
            if not in_flight or in_flight.pop().same():
                return
            difference = gather_difference(lines, group)
            raise ScheduleMismatchError(
                f"{self.__name__}: ranks were called with different arguments: {difference}. "
                "Every rank must pass arguments of the same structure, shapes, dtypes and "
                "non-tensor values in every step, the last batch of an epoch included: drop "
                "it, or pad it to the full size and mask the padding in the loss."
            )

        return settle

    def _agreement_group(self) -> dist.ProcessGroup | None:
        """The group the per-call signature check runs on. With ``overlap_steps`` the last
        call's buckets may still be on the wire: a check queued behind them on the same group
        would wait for them before this call could start, so it gets a group of its own."""
        if not self._options.overlap_steps:
            return self._group
        if self._side_group is None:
            ranks = dist.get_process_group_ranks(self._group or dist.group.WORLD)
            self._side_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._side_group

    def _replicated_args(self, args: tuple) -> list[int]:
        return [n % len(args) for n in self._replicated_argnums if -len(args) <= n < len(args)]

    def _check_replicas(self, args: tuple) -> None:
        """The replicated arguments must agree before the first call and, for eager steps that
        the replication analysis cannot see, before the second (which catches a first call that
        made them differ, e.g. a forgotten pmean)."""
        if self._replicas_checks_left == 0 or self._world() == 1 or not self._replicated_argnums:
            return
        self._replicas_checks_left -= 1
        chosen = [args[n] for n in self._replicated_args(args)]
        what = f"arguments {list(self._replicated_argnums)} of {self.__name__}"
        if self._replicas_checks_left == 0:
            what += " after the first call (does the step average its gradients with fddp.pmean?)"
        _replicas.check_identical(chosen, self._group, what)

    def _learn_replication(self, entry: _Entry, args: tuple, tensors: list[torch.Tensor]) -> None:
        """First call of a signature: which tensor arguments differ between ranks (one small
        all-gather of digests); the replicated arguments must not."""
        if self._world() == 1:
            entry.varying_tensors = [False] * len(tensors)
            return
        varying = _replicas.varying(tensors, self._group)
        paths = _tensor_paths(args)
        for n in self._replicated_args(args):
            for i in _tensor_indices_of_arg(args, n):
                if varying[i]:
                    raise ReplicaMismatchError(
                        f"arguments {list(self._replicated_argnums)} of {self.__name__} differ "
                        f"between ranks: leaf {paths[i]} is not the same on every rank. "
                        "Replicas must start from the same values: create them from the same "
                        "seed and model code, or call fddp.replicate(tree) before training."
                    )
        entry.varying_tensors = varying

    def _remember_varying(self, entry: _Entry, out: Any) -> None:
        self._fed_back = {}
        if not entry.varying_outputs:
            return
        leaves = optree.tree_leaves(out)
        for j, origin in entry.varying_outputs.items():
            if isinstance(leaves[j], torch.Tensor):
                self._fed_back[id(leaves[j])] = (weakref.ref(leaves[j]), origin)

    def _refuse_varying_feedback(self, args: tuple) -> None:
        """A per-rank output of the last call passed back as a replicated argument is the
        signature of a forgotten ``pmean``: the replicas have started to drift apart."""
        for n in self._replicated_args(args):
            paths, leaves, _ = leaves_with_paths(args[n])
            for path, leaf in zip(paths, leaves):
                found = self._fed_back.get(id(leaf))
                if found is None or found[0]() is not leaf:
                    continue
                origin = found[1]
                raise ReplicaMismatchError(
                    f"{self.__name__}: argument {n} leaf {path} is output leaf "
                    f"{origin.output} of the previous call, which differs between ranks: it is "
                    f"computed from the per-rank {_describe_source(origin.source)} with no "
                    "collective in between, so the replicas have started to drift apart. "
                    "Average the gradients with fddp.pmean(grads) (or pmean/psum the value) "
                    "before the update. Per-rank values are fine as metrics that are only "
                    "logged; arguments that may differ per rank are left out with "
                    "check_replicas=(...)."
                )

    def schedule(self, *args: Any) -> Plan:
        """The compiled plan for these arguments (captures if needed; runs nothing).

        Returns:
            A :class:`fddp.typing.Plan`: every collective in launch order with its bucket,
            leaves, bytes, and the compute nodes before its launch and its wait; after the first
            call with these arguments, whether each output is replicated or per-rank. ``print``
            it for a
            table.
        """
        entry = self._entry_for(args, "schedule()")
        schedule = entry.program.schedule
        if entry.program.across_steps is not None:
            schedule = dataclasses.replace(
                schedule, across_steps=entry.program.across_steps.describe()
            )
        if entry.varying_outputs is None:
            return schedule
        paths = _output_paths(entry.captured.out_spec)
        replication = tuple(
            (
                path,
                f"per-rank (from {_describe_source(entry.varying_outputs[j].source)})"
                if j in entry.varying_outputs
                else "replicated",
            )
            for j, path in enumerate(paths)
        )
        return dataclasses.replace(schedule, replication=replication)

    def graph(self, *args: Any) -> torch.fx.GraphModule:
        """The scheduled FX graph run for these arguments (captures if needed; runs nothing).

        The graph after bucketing and overlap (and, without ``compile=True``, reinplacing):
        the one :meth:`schedule` describes, which the step runs (with ``compile=True``, the one
        Inductor compiles). Read it (``print(pstep.graph(*args).code)``); do not modify it.
        """
        return self._entry_for(args, "graph()").program.graph

    def _entry_for(self, args: tuple, what: str) -> _Entry:
        """The compiled program for ``args``, captured now if needed (nothing runs)."""
        if not self._trace:
            raise ValueError(f"{what} needs a traced step; this one has trace=False.")
        signature, leaves = signature_of(args)
        entry = self._cache.get(signature)
        if entry is None:
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            entry = self._compile(signature, args, tensors)
        return entry

    def _note_retrace(self, signature: Signature, args: tuple) -> None:
        if self._last_signature is None:
            return
        self.retraces += 1
        path, reason = self._last_signature.difference(signature, leaf_paths(args))
        _runtime.log_rank0("data_parallel: retracing %s: %s", self.__name__, reason)
        if path is None:
            return
        self._retraces_by_leaf[path] += 1
        if self._retraces_by_leaf[path] >= RETRACE_WARNING_AFTER and path not in self._warned:
            self._warned.add(path)
            warnings.warn(
                f"{self.__name__} was traced again {self._retraces_by_leaf[path]} times because "
                f"argument leaf {path} keeps changing (last: {reason}). Every new value of a "
                "non-tensor argument, and every new shape, compiles the step again: pass a "
                "changing number as a tensor (torch.tensor(value)), and pad batches to a few "
                f"fixed shapes. At most {self._cache_size} programs are kept "
                "(data_parallel(..., cache_size=...)).",
                RetraceWarning,
                stacklevel=4,
            )

    def _compile(self, signature: Signature, args: tuple, tensors: list[torch.Tensor]) -> _Entry:
        self._note_retrace(signature, args)
        self._last_signature = signature
        error: Exception | None = None
        entry: _Entry | None = None
        machine = self._measured_machine(tensors)  # before a capture error can split the ranks
        try:
            with _axes.bind(self._axis(traced=True)):
                entry = self._capture(args, tensors, machine)
        except UsageError as e:
            error = e
        except Exception as e:  # every rank must learn about it before anyone runs a collective
            error = e
        self._agree_on_program(entry.program.sequence if entry else None, error)
        assert entry is not None  # every rank raised the capture error otherwise
        program, captured = entry.program, entry.captured
        _runtime.log_rank0(
            "data_parallel: compiled %s (captured with %s)\n%s",
            self.__name__,
            captured.method,
            program.schedule,
        )
        if program.across_steps is not None:
            program.across_steps.where = self.__name__
        self._cache[signature] = entry
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def _agree_on_program(self, sequence: list[str] | None, error: BaseException | None) -> None:
        """Every rank's capture outcome and collective sequence, compared; the same error on
        every rank, so no rank waits forever for a peer that never reaches the first collective."""
        status = f"failed with {type(error).__name__}: {error}" if error else "captured"
        lines = [("the capture", status.split("\n")[0])]
        lines += [(f"collective #{i}", s) for i, s in enumerate(sequence or [])]
        difference = find_difference(lines, self._group) if self._world() > 1 else None
        if error is not None:
            raise error
        if difference is None:
            return
        if difference.label == "the capture":
            failed_rank, status = (
                (difference.rank, difference.theirs)
                if difference.ours == "captured"
                else (0, difference.ours)
            )
            raise RuntimeError(
                f"{self.__name__}: rank {failed_rank} {status.removeprefix('failed with ')} while "
                "capturing the step; this rank stops too instead of waiting for it."
            )
        raise ScheduleMismatchError(
            f"{self.__name__}: ranks compiled different collective sequences: {difference}. The "
            "step must issue the same collectives with the same shapes on every rank: check "
            "that every rank passes batches of the same shape and that no branch depends on "
            "the rank."
        )

    def _measured_machine(self, tensors: list[torch.Tensor]) -> _cost.Machine | None:
        """The link and compute figures the default bucket cap is chosen from (measured on the
        group's first compile, a collective); None when the cap is set or there is one rank."""
        if self._options.bucket_cap_bytes is not None or self._world() == 1:
            return None
        device = next((t.device for t in tensors if t.is_floating_point()), None)
        return _cost.measured(self._group, device or _runtime.local_device())

    def _capture(
        self, args: tuple, tensors: list[torch.Tensor], machine: _cost.Machine | None
    ) -> _Entry:
        """make_fx first; Dynamo for steps make_fx cannot trace (see ``_capture``)."""
        donated = _donated_leaves(args, self._donate_argnums)
        fused_backward = self._options.compile in (False, "fx")
        try:
            captured = trace_with_make_fx(self._step_fn, args, fused_backward=fused_backward)
        except UsageError:
            raise
        except Exception as e:
            make_fx_error = e
            _runtime.log_rank0(
                "data_parallel: make_fx could not trace %s (%s: %s); capturing with Dynamo",
                self.__name__,
                type(e).__name__,
                str(e).split("\n")[0],
            )
        else:
            return _Entry(schedule_graph(captured, self._options, donated, machine), captured, None)
        dynamo = DynamoCapture(self._step_fn, fused_backward=fused_backward)
        captured = dynamo.trace(args, tensors, make_fx_error)
        return _Entry(schedule_graph(captured, self._options, donated, machine), captured, dynamo)


def _describe_source(source: str) -> str:
    return source if source.startswith("the rank") else f"argument leaf {source}"


def _tensor_paths(args: tuple) -> list[str]:
    leaves = optree.tree_leaves(args)
    return [p for p, x in zip(leaf_paths(args), leaves) if isinstance(x, torch.Tensor)]


def _tensor_indices_of_arg(args: tuple, n: int) -> range:
    before = sum(isinstance(x, torch.Tensor) for a in args[:n] for x in optree.tree_leaves(a))
    count = sum(isinstance(x, torch.Tensor) for x in optree.tree_leaves(args[n]))
    return range(before, before + count)


def _donated_leaves(args: tuple, argnums: tuple[int, ...]) -> set[int]:
    """Indices, among all tensor leaves of ``args``, of those inside donated arguments."""
    for n in argnums:
        if not -len(args) <= n < len(args):
            raise ValueError(
                f"donate_argnums refers to argument {n}, but the step got {len(args)} arguments."
            )
    donated: set[int] = set()
    for n in {n % len(args) for n in argnums}:
        donated.update(_tensor_indices_of_arg(args, n))
    return donated


def data_parallel(
    step_fn: Callable[..., Any] | None = None,
    *,
    axis_name: str = _axes.DEFAULT_AXIS,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float = 1.0,
    compile: bool | str = False,
    donate_argnums: int | Sequence[int] = (),
    comm_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    trace: bool = True,
    check_replicas: bool | Sequence[int] = True,
    cache_size: int = 16,
    overlap_steps: bool = False,
) -> Any:
    """Turn a pure training step into one replicated over the ranks of a process group.

    ``step_fn(*args)`` is traced once per input signature (tree structure, shapes, dtypes,
    devices, non-tensor values) into one graph; the per-leaf all-reduces it issues (through
    ``fddp.pmean``/``psum`` with ``axis_name``) are merged into buckets in the order the backward
    pass produces the gradients, each bucket's all-reduce is launched right after its last
    gradient exists and waited for right before its result is first used.

    Args:
        step_fn: ``step(*args) -> outputs``, pure: same inputs, same outputs.
        axis_name: the name collectives inside the step use for this replica axis.
        bucket_cap_mb: bucket size cap in MiB (DDP's ``bucket_cap_mb``): a bucket takes
            gradients until it holds this many bytes. The default, None, chooses it at each
            compile from a cost model: the link's latency and bandwidth and the compute speed
            are measured once per process group (rank 0's figures, broadcast, so every rank
            makes the same choice) and the step's graph replayed for each candidate cap.
            Unless the model sees a difference of more than 5 %, the cap is a sixteenth of all
            gradient bytes (at least ``first_bucket_cap_mb`` and five link latencies' worth of
            transfer, at most DDP's 25 MiB). ``schedule()`` prints the choice and the
            figures. On more than two ranks the cap can change the order of a gradient's sums
            (last-bit differences), so set it for bitwise reproducible runs.
        first_bucket_cap_mb: cap of the first bucket, small so communication starts early.
        compile: False runs the scheduled FX graph; True or ``"inductor"`` compiles it.
        donate_argnums: arguments whose storage the step may reuse for its outputs.
        comm_dtype: cast each bucket to this dtype for the all-reduce (e.g. ``torch.bfloat16``).
        group: the process group (default: the world).
        trace: False runs ``step_fn`` eagerly (collectives bucketed per call, no overlap).
        check_replicas: arguments that must be identical on every rank; True means argument
            0 (the parameters), False none. On the first call with each signature one small
            all-gather of bitwise digests verifies them (and finds which other arguments are
            per-rank, such as the batch); on later calls an output of the previous call that
            is computed from per-rank values without a collective (a forgotten ``pmean``)
            and passed back as one of them raises ``ReplicaMismatchError``.
        cache_size: how many compiled programs (one per input signature) are kept; the least
            recently used is dropped beyond that. A leaf that keeps changing is named in a
            ``RetraceWarning``.
        overlap_steps: return before the last buckets are reduced. The buckets launched last
            (the first layers' gradients, about half the bytes) are launched last-first at
            the end of the backward pass, and their waits and the updates that need them
            move into the next call, each just before the first use of its result: the next
            forward runs its first layers while the rest is still on the wire. The outputs
            they produce come back as tensors that are completed when passed to the next
            call or touched in any other way (an operator, ``print``, ``.item()``,
            ``fddp.save``, ``fddp.block_until_ready``); results are bitwise those of the
            plain step. Only for steps where communication is the bottleneck, and measure:
            it moves half the launches to the end of the backward pass, which costs where
            the wire had been idle (README, "Overlap across steps"). Touching an output every
            step (``loss.item()``) makes the step wait for it. Needs ``compile=False``.

    Returns:
        A callable with ``step_fn``'s signature, with ``.schedule(*args)`` for the plan.

    >>> import fddp, torch
    >>> @fddp.data_parallel
    ... def step(w, x):
    ...     g = fddp.grad(lambda w: ((x @ w) ** 2).mean())(w)
    ...     return w - 0.1 * fddp.pmean(g)
    >>> step(torch.ones(2), torch.ones(3, 2))
    tensor([0.6000, 0.6000])
    """
    if step_fn is None:
        return functools.partial(
            data_parallel,
            axis_name=axis_name,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            compile=compile,
            donate_argnums=donate_argnums,
            comm_dtype=comm_dtype,
            group=group,
            trace=trace,
            check_replicas=check_replicas,
            cache_size=cache_size,
            overlap_steps=overlap_steps,
        )
    if (bucket_cap_mb is not None and bucket_cap_mb <= 0) or first_bucket_cap_mb <= 0:
        raise ValueError("bucket_cap_mb and first_bucket_cap_mb must be positive (MiB).")
    if compile not in (False, True, "fx", "inductor"):
        raise ValueError(f"compile={compile!r}: use False (run the FX graph) or True/'inductor'.")
    if cache_size < 1:
        raise ValueError(f"cache_size={cache_size}: keep at least one compiled program.")
    if overlap_steps and compile not in (False, "fx"):
        raise ValueError(
            "overlap_steps runs the scheduled graph without Inductor: use compile=False."
        )
    options = Options(
        bucket_cap_bytes=None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20),
        first_bucket_cap_bytes=int(first_bucket_cap_mb * 2**20),
        comm_dtype=comm_dtype,
        compile=compile,
        overlap_steps=overlap_steps,
    )
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return DataParallelStep(
        step_fn,
        axis_name=axis_name,
        options=options,
        donate_argnums=donate,
        group=group,
        trace=trace,
        check_replicas=(0,) if check_replicas is True else tuple(check_replicas or ()),
        cache_size=cache_size,
    )
