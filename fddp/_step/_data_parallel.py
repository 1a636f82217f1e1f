"""fddp.data_parallel: a step traced once per input signature, run as a compiled graph."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import optree
import torch
import torch.distributed as dist

from fddp import _sharding
from fddp._base import _axes
from fddp._base._names import qualified_name
from fddp._collectives._ops import ProcessAxis, process_axis
from fddp._compiler import _pipeline
from fddp._compiler._cache import _persistent
from fddp._compiler._cache._memory import ProgramCache
from fddp._compiler._plan import Plan
from fddp._compiler._program import Compiled
from fddp._func import _invariant
from fddp._func._invariant import Invariant
from fddp._func._remat import Policy, checked_policy
from fddp._ranks import _pending, _runtime, _timeline
from fddp._ranks._signature import Signature
from fddp._step import _step_lock
from fddp._step._call_check import READ_AS_TRACED, CallCheck
from fddp._step._call_inputs import tensor_indices_of_arg
from fddp._step._held_tensors import agreed_at_compile
from fddp._step._modes import KnownModels
from fddp._step._options import StepOptions, argnums, backend, replicated
from fddp._step._replica_guard import ReplicaGuard
from fddp._step._schedule import plan_of


class DataParallelStep:
    """A replicated training step; call it like the step it wraps.

    Made by :func:`fddp.data_parallel`; also has :meth:`schedule`, :meth:`graph` and
    :meth:`profile`, and ``retraces``, the number of compiles after the first.
    """

    __name__: str  # the step's, copied by functools.update_wrapper

    def __init__(self, step_fn: Callable[..., Any], options: StepOptions) -> None:
        """``step_fn`` as a data-parallel step built with ``options``."""
        functools.update_wrapper(self, step_fn)
        if not hasattr(self, "__name__"):  # a functools.partial or another callable object
            self.__name__ = qualified_name(step_fn, module=False).rpartition(".")[2]
        self._described = [("the step", qualified_name(step_fn)), *options.lines()]
        # the step's reduction context: the invariant mode's, else the one an fddp.Loss sums over
        step_fn = _invariant.wrapped(
            options.invariant, options.axis_name, step_fn, sub_axes=tuple(options.axes)
        )
        self._step_fn = step_fn
        self._capture_method = "make_fx"  # "dynamo" once make_fx failed: it is not tried again
        self._models = KnownModels()
        self._options = options
        self._compiler_options = options.for_compiler
        self._group = options.group
        self._profiling = False
        name, group, replicated = self.__name__, options.group, options.check_replicas
        self._calls = CallCheck(name, group, self._described, own_group=options.overlap_steps)
        self._programs: ProgramCache[Compiled] = ProgramCache(name, options.cache_size)
        invariant = options.invariant is not None  # every random draw must agree
        self._replicas = ReplicaGuard(name, group, replicated, generator=invariant)
        # Inside a user's torch.compile the step runs as one opaque call. Wrapped here, not at
        # class definition, so that importing fddp does not import Dynamo.
        self._opaque_call = torch.compiler.disable(self._guarded_call)

    @property
    def retraces(self) -> int:
        """How many times the step was compiled again for a new signature."""
        return self._programs.retraces

    def _axis(self, traced: bool = False) -> ProcessAxis:
        return process_axis(self._options.axis_name, self._group, traced=traced)

    def _axes(self, traced: bool = False) -> list[ProcessAxis]:
        """The step's axis, then the ``axes`` it was given (each over a subgroup)."""
        more = [process_axis(n, g, traced=traced) for n, g in self._options.axes.items()]
        return [self._axis(traced), *more]

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
        with (
            _step_lock.exclusive(self.__name__),
            _runtime.peer_failures(lambda: f"{self.__name__}, call {self._calls.calls}"),
        ):
            return self._call(args)

    def _call(self, args: tuple) -> Any:
        _runtime.ensure_group()
        # a pending output has its value's signature
        signature, leaves = self._models.signature(args)
        if not self._options.overlap_steps and any(map(_pending.is_pending, leaves)):
            args = _pending.finished(args)  # another step's pending outputs, finished first
            leaves = optree.tree_leaves(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        compiled = self._programs.get(signature) if self._options.trace else None
        device = _runtime.step_device(tensors)
        eager = not self._options.trace
        inputs = self._replicas.inputs(signature, args, tensors, compiled, device, eager=eager)
        check = self._calls.launch(
            signature,
            args,
            "called the step",
            lambda: self._replicas.compare_trees(args),
            inputs,
            reads=self._programs.changed or READ_AS_TRACED,
        )
        if not self._options.trace:
            out = self._run_eagerly(args, check.settle)
            self._replicas.after_call(None, inputs, out)
            return out
        if compiled is None or compiled.first_call:
            check.settle()  # before the collectives of a compile or of a first call
        if compiled is None:
            signature, compiled = self._compile(signature, args)
        self._replicas.before_run(compiled, args, tensors, device, inputs)
        with _timeline.step_range() if self._profiling else contextlib.nullcontext():
            out = compiled.run(args, tensors, check.settle, self._axes(traced=True))
        self._replicas.after_run(compiled, args, out, inputs)
        return out

    def _run_eagerly(self, args: tuple, settle: Callable[[], None]) -> Any:
        settle()
        with _axes.bind(*self._axes()):
            return self._sharded_step(args)(*args)

    def schedule(self, *args: Any) -> Plan:
        """The compiled plan for these arguments (captures if needed; runs nothing).

        Compiling for new arguments is a collective: call it on every rank, or after a first
        call with these arguments.

        Returns:
            A :class:`fddp.typing.Plan`: every collective in launch order with its bucket,
            leaves, bytes, and the compute nodes before its launch and its wait; after the first
            call with these arguments, whether each output is replicated or per-rank. ``print``
            it for a table.
        """
        return plan_of(self._compiled_for(args, "called schedule()"))

    def graph(self, *args: Any) -> torch.fx.GraphModule:
        """The scheduled FX graph run for these arguments (captures if needed; runs nothing).

        The graph after bucketing and overlap (and, without ``compile=True``, reinplacing):
        the one :meth:`schedule` describes, which the step runs (with ``compile=True``, the one
        Inductor compiles). Read it (``print(pstep.graph(*args).code)``); do not modify it.
        Like :meth:`schedule`, compiling for new arguments is a collective.
        """
        return self._compiled_for(args, "called graph()").program.graph

    def _compiled_for(self, args: tuple, request: str) -> Compiled:
        """The compiled program for ``args``, compiled now if needed (nothing runs)."""
        if not self._options.trace:
            raise ValueError(
                f"{request.removeprefix('called ')} needs a traced step; this one has trace=False."
            )
        signature, _ = self._models.signature(args)
        compiled = self._programs.get(signature)
        if compiled is None:
            self._calls.launch(signature, args, request).settle()
            _, compiled = self._compile(signature, args)
        return compiled

    def _compile(self, signature: Signature, args: tuple) -> tuple[Signature, Compiled]:
        """Capture and schedule the step for ``signature`` (every rank at once: it measures
        the link on the group's first compile and compares what the ranks compiled).

        Returns:
            The program and the signature it is kept under, which holds the train/eval modes
            of the models the capture ran.
        """
        self._programs.note_compile(signature, args)
        tensors = [x for x in optree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        donated = _donated_leaves(args, self._options.donate_argnums)
        kept_as = None  # a program that overlaps steps or runs over a mesh is not kept on disk
        if not (self._options.overlap_steps or self._options.axes):
            kept_as = _persistent.Identity(self._step_fn, signature, tuple(self._described))
        with _axes.bind(*self._axes(traced=True)):
            compiled = _pipeline.compile_step(
                self._sharded_step(args),
                args,
                tensors,
                self._compiler_options,
                donated,
                self._group,
                self.__name__,
                kept_as=kept_as,
                method=self._capture_method,
            )
        agreed_at_compile(compiled)
        self._capture_method = compiled.captured.method
        signature = self._models.after_compile(signature, args, compiled)
        _runtime.log_rank0(
            "data_parallel: compiled %s (captured with %s)\n%s",
            self.__name__,
            compiled.captured.method,
            compiled.program.schedule,
        )
        if compiled.program.across_steps is not None:
            compiled.program.across_steps.where = self.__name__
        self._programs.put(signature, compiled)
        return signature, compiled

    def _sharded_step(self, args: tuple) -> Callable[..., Any]:
        """The step as traced: sharded parameter arguments gathered for it and its outputs in
        their positions cut back into shards (``fddp.shard_params``)."""
        with _axes.bind(*self._axes()):
            in_place = self._compiler_options.in_place  # the FX backend runs fddp's schedule
            return _sharding.gathering(self._step_fn, args, self.__name__, in_place)


def _donated_leaves(args: tuple, argnums: tuple[int, ...]) -> set[int]:
    """Indices, among all tensor leaves of ``args``, of those inside donated arguments."""
    for n in argnums:
        if not -len(args) <= n < len(args):
            raise ValueError(
                f"donate_argnums refers to argument {n}, but the step got {len(args)} arguments."
            )
    donated: set[int] = set()
    for n in {n % len(args) for n in argnums}:
        donated.update(tensor_indices_of_arg(args, n))
    return donated


@overload
def data_parallel(
    step_fn: Callable[..., Any],
    *,
    axis_name: str = ...,
    bucket_cap_mb: float | None = ...,
    first_bucket_cap_mb: float = ...,
    compile: bool | str = ...,
    donate_argnums: int | Sequence[int] = ...,
    comm_dtype: torch.dtype | None = ...,
    group: dist.ProcessGroup | None = ...,
    axes: Mapping[str, dist.ProcessGroup] | None = ...,
    trace: bool = ...,
    check_replicas: bool | Sequence[int] = ...,
    cache_size: int = ...,
    overlap_steps: bool = ...,
    remat: Policy | None = ...,
    invariant: Invariant | int | None = ...,
) -> DataParallelStep: ...


@overload
def data_parallel(
    step_fn: None = ...,
    *,
    axis_name: str = ...,
    bucket_cap_mb: float | None = ...,
    first_bucket_cap_mb: float = ...,
    compile: bool | str = ...,
    donate_argnums: int | Sequence[int] = ...,
    comm_dtype: torch.dtype | None = ...,
    group: dist.ProcessGroup | None = ...,
    axes: Mapping[str, dist.ProcessGroup] | None = ...,
    trace: bool = ...,
    check_replicas: bool | Sequence[int] = ...,
    cache_size: int = ...,
    overlap_steps: bool = ...,
    remat: Policy | None = ...,
    invariant: Invariant | int | None = ...,
) -> Callable[[Callable[..., Any]], DataParallelStep]: ...


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
    axes: Mapping[str, dist.ProcessGroup] | None = None,
    trace: bool = True,
    check_replicas: bool | Sequence[int] = True,
    cache_size: int = 16,
    overlap_steps: bool = False,
    remat: Policy | None = None,
    invariant: Invariant | int | None = None,
) -> DataParallelStep | Callable[[Callable[..., Any]], DataParallelStep]:
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
            (last-bit differences), and the figures differ from run to run: ``fddp.save`` and
            ``fddp.save_sharded`` record them, and a run that loads such a checkpoint before
            its first compile chooses as the saved run did (a resumed run is bitwise the
            uninterrupted one); set the cap for runs that must agree without a checkpoint.
        first_bucket_cap_mb: cap of the first bucket, small so communication starts early.
        compile: False (or ``"fx"``) runs the scheduled FX graph; True (or ``"inductor"``)
            compiles it with Inductor.
        donate_argnums: arguments whose storage the step may reuse for its outputs.
        comm_dtype: cast each bucket to this dtype for the all-reduce (e.g. ``torch.bfloat16``).
        group: the process group (default: the world).
        axes: more named axes for the step's collectives, each over a subgroup of ``group``
            (every rank passes its own subgroup of each name): a 2-D mesh, such as hybrid
            sharding's ``{"shard": ranks_of_my_node, "replicate": my_peers_on_other_nodes}``
            (docs/guides/from-fsdp2.md, "Hybrid sharding"). ``axis_name`` still names the whole
            group. Steps with ``axes`` are not written to the persistent program cache.
        trace: False runs ``step_fn`` eagerly (collectives bucketed per call, no overlap).
        check_replicas: arguments that must be identical on every rank; True means argument
            0 (the parameters), False none. Every call compares them, and what the step
            computes them from without a collective (its optimizer state, a hyperparameter
            passed as a tensor), by a bitwise digest, or, for a replicated output of one of
            the step's last calls passed back unchanged, by that origin (no hash); a
            sharded layout's per-rank values by origin only. On the first call with each
            signature one small all-gather of digests also finds which other arguments are
            per-rank, such as the batch; an output computed from those without a collective
            (a forgotten ``pmean``) and passed back as a replicated argument raises
            ``ReplicaMismatchError``. A tensor the compiled step closes over (a learning rate,
            a hyperparameter tensor) written in place since the ranks last agreed on it (its
            version counter moved) is hashed into the call's check too. False turns the
            comparison of argument values and of those tensors off.
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
            the wire had been idle (docs/how-it-works.md, "The passes"). Touching an output
            every step (``loss.item()``) makes the step wait for it. Needs ``compile=False``.
        remat: a policy from ``fddp.remat_policies``: activations are recomputed in the
            backward pass instead of kept from the forward (activation checkpointing). It
            applies to the regions ``fddp.remat`` marks that have no policy of their own;
            when the step marks none, each call of a model's repeated block (a child of a
            ``ModuleList`` or ``Sequential`` with an identical sibling) is a region, and
            without those each forward pass. Gradients are bitwise those without it;
            ``schedule()`` lists what each region keeps and recomputes, and the bytes
            (docs/guides/remat.md).
        invariant: a chunk size or :class:`fddp.Invariant`: bitwise the same results on any
            number of ranks, under ``fddp.vmap`` and with any bucket cap. ``value_and_grad``
            and ``grad`` inside the step compute the loss (a mean over examples) and its
            gradient per chunk of the batch argument and average them exactly over the global
            batch (int64 on the wire); ``pmean`` of their results returns them as they are.
            Every rank's batch must be a multiple of the chunk size. It composes with
            ``overlap_steps``, ``axes``, ``shard_params`` and ``shard_state``; ``compile=True``
            is refused (docs/guides/determinism.md).

    Every rank must build the step with the same options and call it at the same points: on
    every call the ranks compare the step, its options, the arguments' signature, the count of
    calls and the replicated inputs (``check_replicas``; the random generator's state where a
    draw reaches a replicated result, always with ``invariant``), in one small all-reduce
    settled before the step's first collective and before anything is written into a donated
    argument; on every compile, the captured program whole, every constant by value. A
    difference is a ``ScheduleMismatchError`` or ``ReplicaMismatchError`` on every rank
    (docs/guides/troubleshooting.md, "What the ranks compare").

    Returns:
        A :class:`DataParallelStep` with ``step_fn``'s signature, with ``.schedule(*args)``
        for the plan (used as ``@data_parallel(...)``, a decorator that makes one).

    >>> import fddp, torch
    >>> @fddp.data_parallel
    ... def step(w, x):
    ...     g = fddp.grad(lambda w: ((x @ w) ** 2).mean())(w)
    ...     return w - 0.1 * fddp.pmean(g)
    >>> step(torch.ones(2), torch.ones(3, 2))
    tensor([0.6000, 0.6000])
    """
    options = StepOptions(
        axis_name=axis_name,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        compile=backend(compile),
        donate_argnums=argnums(donate_argnums),
        comm_dtype=comm_dtype,
        group=group,
        axes=dict(axes or {}),
        trace=trace,
        check_replicas=replicated(check_replicas),
        cache_size=cache_size,
        overlap_steps=overlap_steps,
        remat=checked_policy(remat, "data_parallel(remat=...)"),
        invariant=_invariant.checked(invariant),
    )
    if step_fn is None:
        return functools.partial(DataParallelStep, options=options)
    return DataParallelStep(step_fn, options)
