"""fddp.data_parallel: a step traced once per input signature, run as a compiled graph."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import optree
import torch
import torch.distributed as dist

from fddp import _sharding
from fddp._base import _axes, _model_calls
from fddp._collectives._bucket_policy import CapPolicy
from fddp._collectives._ops import ProcessAxis, process_axis
from fddp._compiler import _pipeline
from fddp._compiler._cache import _persistent
from fddp._compiler._cache._memory import ProgramCache
from fddp._compiler._plan import Plan
from fddp._compiler._program import Compiled
from fddp._func import _invariant
from fddp._func._invariant import Invariant
from fddp._func._remat import Policy, checked_policy
from fddp._ranks import _machine, _mesh, _pending, _runtime, _timeline
from fddp._ranks._agree import Line
from fddp._ranks._signature import Modes, Signature, signature_of
from fddp._step import _step_lock
from fddp._step._call_check import CallCheck
from fddp._step._replica_guard import (
    ReplicaGuard,
    describe_source,
    tensor_indices_of_arg,
    tensor_paths,
)


class DataParallelStep:
    """A replicated training step; call it like the step it wraps.

    Made by :func:`fddp.data_parallel`; also has :meth:`schedule`, :meth:`graph` and
    :meth:`profile`, and ``retraces``, the number of compiles after the first.
    """

    __name__: str  # the step's, copied by functools.update_wrapper

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *,
        axis_name: str,
        options: _pipeline.Options,
        described: list[Line],
        donate_argnums: tuple[int, ...],
        group: dist.ProcessGroup | None,
        axes: dict[str, dist.ProcessGroup],
        trace: bool,
        check_replicas: tuple[int, ...],
        cache_size: int,
    ) -> None:
        functools.update_wrapper(self, step_fn)
        if not hasattr(self, "__name__"):  # a functools.partial or another callable object
            self.__name__ = _qualified_name(step_fn).rpartition(".")[2]
        self._step_fn = step_fn
        self._described = described
        self._unsaved: dict[Signature, _persistent.Key] = {}  # to write after a first run
        self._capture_method = "make_fx"  # "dynamo" once make_fx failed: it is not tried again
        self._modes: Modes | None = None  # the models captures ran: their modes key programs
        self._axis_name = axis_name
        self._options = options
        self._donate_argnums = donate_argnums
        self._group = group
        self._more_axes = axes
        self._trace = trace
        self._profiling = False
        name = self.__name__
        self._calls = CallCheck(
            name, group, described, own_group=options.overlap_steps, replicated=check_replicas
        )
        self._programs: ProgramCache[Compiled] = ProgramCache(name, cache_size)
        self._replicas = ReplicaGuard(name, group, check_replicas)
        # Inside a user's torch.compile the step runs as one opaque call. Wrapped here, not at
        # class definition, so that importing fddp does not import Dynamo.
        self._opaque_call = torch.compiler.disable(self._guarded_call)

    @property
    def retraces(self) -> int:
        """How many times the step was compiled again for a new signature."""
        return self._programs.retraces

    def _axis(self, traced: bool = False) -> ProcessAxis:
        return process_axis(self._axis_name, self._group, traced=traced)

    def _axes(self, traced: bool = False) -> list[ProcessAxis]:
        """The step's axis, then the ``axes`` it was given (each over a subgroup)."""
        more = [process_axis(n, g, traced=traced) for n, g in self._more_axes.items()]
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
        signature, leaves = signature_of(args, self._modes)
        if not self._options.overlap_steps and any(map(_pending.is_pending, leaves)):
            args = _pending.finished(args)  # another step's pending outputs, finished first
            leaves = optree.tree_leaves(args)
        check = self._calls.launch(
            signature, args, "called the step", lambda: self._replicas.compare_digests(args)
        )
        if not self._trace:
            return self._run_eagerly(args, check.settle)
        compiled = self._programs.get(signature)
        if compiled is None or compiled.first_call:
            check.settle()  # before the collectives of a compile or of a first call
        if compiled is None:
            signature, compiled = self._compile(signature, args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self._before_run(compiled, args, tensors)
        with _timeline.step_range() if self._profiling else contextlib.nullcontext():
            out = compiled.run(args, tensors, check.settle, self._axes(traced=True))
        key = self._unsaved.pop(signature, None)
        if key is not None:
            _persistent.save(key, compiled)
        self._replicas.remember(self._origins(compiled, args), out)
        return out

    def _run_eagerly(self, args: tuple, settle: Callable[[], None]) -> Any:
        settle()
        self._replicas.check_digests(args, eager=True)
        with _axes.bind(*self._axes()):
            return self._sharded_step(args)(*args)

    def _before_run(self, compiled: Compiled, args: tuple, tensors: list[torch.Tensor]) -> None:
        """The replication checks due before this call runs."""
        if compiled.varying_tensors is None:
            compiled.varying_tensors = self._replicas.first_run(args, tensors)
        self._replicas.refuse_fed_back(args)

    def _origins(self, compiled: Compiled, args: tuple) -> dict[int, tuple[str, str]]:
        """The per-rank output leaves of ``compiled`` (path, source), learned after its first
        run."""
        if compiled.varying_outputs is None:
            assert compiled.varying_tensors is not None  # learned before the first run
            compiled.varying_outputs = compiled.output_sources(
                compiled.varying_tensors, tensor_paths(args)
            )
        return compiled.varying_outputs

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
        compiled = self._compiled_for(args, "called schedule()")
        plan = compiled.program.schedule
        if compiled.program.across_steps is not None:
            plan = dataclasses.replace(plan, across_steps=compiled.program.across_steps.describe())
        if compiled.varying_outputs is None:
            return plan
        replication = tuple(
            (
                path,
                f"per-rank (from {describe_source(compiled.varying_outputs[j][1])})"
                if j in compiled.varying_outputs
                else "replicated",
            )
            for j, path in enumerate(compiled.output_paths())
        )
        return dataclasses.replace(plan, replication=replication)

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
        if not self._trace:
            raise ValueError(
                f"{request.removeprefix('called ')} needs a traced step; this one has trace=False."
            )
        signature, _ = signature_of(args, self._modes)
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
        leaves = optree.tree_leaves(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        machine = self._measured_machine(tensors)  # before a capture error can split the ranks
        donated = _donated_leaves(args, self._donate_argnums)
        key = None
        if not (self._options.overlap_steps or self._more_axes):
            key = _persistent.key_for(
                self._step_fn, signature, leaves, self._described, donated, self._group
            )
        device = _device(tensors)
        agreed_cap = self._agreed_cap(key, machine, device)
        with _axes.bind(*self._axes(traced=True)):
            compiled = _pipeline.compile_step(
                self._sharded_step(args),
                args,
                tensors,
                self._options,
                donated,
                machine,
                self._group,
                self.__name__,
                cached=None
                if key is None
                else functools.partial(
                    _persistent.load, key, self._options, machine, device, agreed_cap
                ),
                agreed_cap=agreed_cap,
                method=self._capture_method,
                compare_graphs=not _sharding.holds_shards(args),
            )
        self._capture_method = compiled.captured.method
        signature = self._with_modes(signature, args, compiled)
        if key is not None and not compiled.from_cache:
            self._unsaved[signature] = key
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

    def _with_modes(self, signature: Signature, args: tuple, compiled: Compiled) -> Signature:
        """``signature`` with the modes of every model the step is known to run, those of
        this capture included (a program loaded from the persistent cache could have run any
        model ``fddp.functional`` wraps)."""
        ran = _model_calls.functional_models() if compiled.from_cache else compiled.captured.models
        known = self._modes.models if self._modes is not None else ()
        if all(any(m is k for k in known) for m in ran):
            return signature
        self._modes = Modes([*known, *(m for m in ran if not any(m is k for k in known))])
        return signature_of(args, self._modes)[0]

    def _agreed_cap(
        self,
        key: _persistent.Key | None,
        machine: _machine.Machine | None,
        device: torch.device,
    ) -> int | None:
        """Where the cost model chooses the cap on several ranks, every rank takes the cap that
        rank 0 proposes from its persistent cache (a broadcast at each compile, whether or not
        a rank has the cache on); None where rank 0 has no cached program for the step."""
        if machine is None:
            return None
        proposed = -1
        if _runtime.rank(self._group) == 0:
            restored = _machine.restored(self._group, device)
            proposed = _persistent.proposal(key, self._options, machine, restored)
        cap = torch.tensor([proposed], dtype=torch.int64, device=device)
        dist.broadcast(cap, group=self._group, group_src=0)
        return None if int(cap) < 0 else int(cap)

    def _sharded_step(self, args: tuple) -> Callable[..., Any]:
        """The step as traced: sharded parameter arguments gathered for it and its outputs in
        their positions cut back into shards (``fddp.shard_params``)."""
        with _axes.bind(*self._axes()):
            fx_backend = self._options.in_place  # the FX backend runs fddp's schedule as it is
            return _sharding.gathering(self._step_fn, args, self.__name__, fx_backend)

    def _measured_machine(self, tensors: list[torch.Tensor]) -> _machine.Machine | None:
        """The link and compute figures the default bucket cap is chosen from (measured on the
        group's first compile, a collective); None when the policy needs none."""
        if not self._options.cap.measures(_runtime.world_size(self._group)):
            return None
        return _machine.measured(self._group, _device(tensors))


def _device(tensors: list[torch.Tensor]) -> torch.device:
    """Where the step computes: its first floating-point argument's device."""
    device = next((t.device for t in tensors if t.is_floating_point()), None)
    return device or _runtime.local_device()


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
    every call the ranks compare the step, its options and the arguments' signature (one small
    all-reduce, settled before the step's first collective and before anything is written into
    a donated argument), and a difference is a ``ScheduleMismatchError`` on every rank.

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
    options: dict[str, Any] = dict(
        axis_name=axis_name,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        compile=compile,
        donate_argnums=donate_argnums,
        comm_dtype=comm_dtype,
        group=group,
        axes=axes,
        trace=trace,
        check_replicas=check_replicas,
        cache_size=cache_size,
        overlap_steps=overlap_steps,
        remat=remat,
        invariant=invariant,
    )
    if step_fn is None:
        return functools.partial(_data_parallel, **options)
    return _data_parallel(step_fn, **options)


def _checked_axes(
    axes: Mapping[str, dist.ProcessGroup], axis_name: str, group: dist.ProcessGroup | None
) -> dict[str, dist.ProcessGroup]:
    """``data_parallel``'s ``axes``, each a process group of ranks of ``group``."""
    if not axes:
        return {}
    _runtime.ensure_group()
    _mesh.check_axes(axes, group)  # a collective: every rank's groups, one verdict everywhere
    outer = set(dist.get_process_group_ranks(group or dist.group.WORLD))
    for name, sub in axes.items():
        if name == axis_name:
            raise ValueError(
                f"data_parallel: axes names {name!r}, which is axis_name, the whole group's "
                "axis; give the subgroup another name."
            )
        if not isinstance(sub, dist.ProcessGroup):
            raise TypeError(
                f"data_parallel: axes[{name!r}] is a {type(sub).__name__}; pass the "
                "torch.distributed process group (e.g. from dist.new_subgroups or a "
                "DeviceMesh's get_group) that this rank belongs to."
            )
        if not set(dist.get_process_group_ranks(sub)) <= outer:
            raise ValueError(
                f"data_parallel: axes[{name!r}] holds ranks outside the step's group; each "
                "axis must be a subgroup of group."
            )
    return dict(axes)


def _qualified_name(fn: Callable[..., Any]) -> str:
    fn = getattr(fn, "func", fn)  # a functools.partial: the function it binds
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _backend(compile: bool | str) -> str:
    """``compile=`` decoded: ``"fx"`` (False, or ``"fx"``) or ``"inductor"`` (True)."""
    backend = "inductor" if compile is True else "fx" if compile is False else compile
    if backend not in _pipeline.BACKENDS:
        raise ValueError(
            f"compile={compile!r}: use False (run the scheduled FX graph) or True (compile it "
            "with Inductor; 'inductor' and 'fx' name the two as well)."
        )
    return backend


def _data_parallel(
    step_fn: Callable[..., Any],
    *,
    axis_name: str,
    bucket_cap_mb: float | None,
    first_bucket_cap_mb: float,
    compile: bool | str,
    donate_argnums: int | Sequence[int],
    comm_dtype: torch.dtype | None,
    group: dist.ProcessGroup | None,
    axes: Mapping[str, dist.ProcessGroup] | None,
    trace: bool,
    check_replicas: bool | Sequence[int],
    cache_size: int,
    overlap_steps: bool,
    remat: Policy | None = None,
    invariant: Invariant | int | None = None,
    built_with: Sequence[Line] = (),
) -> DataParallelStep:
    """``data_parallel``; ``built_with``: more labelled lines on how the step was built (a
    transform's own options), compared across ranks on every call before data_parallel's."""
    if (bucket_cap_mb is not None and bucket_cap_mb <= 0) or first_bucket_cap_mb <= 0:
        raise ValueError("bucket_cap_mb and first_bucket_cap_mb must be positive (MiB).")
    if cache_size < 1:
        raise ValueError(f"cache_size={cache_size}: keep at least one compiled program.")
    backend = _backend(compile)
    if overlap_steps and backend != "fx":
        raise ValueError(
            "overlap_steps runs the scheduled graph without Inductor: use compile=False."
        )
    cap = CapPolicy(
        fixed=None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20),
        first=int(first_bucket_cap_mb * 2**20),
    )
    policy = checked_policy(remat, "data_parallel(remat=...)")
    options = _pipeline.Options(cap, comm_dtype, backend, overlap_steps, policy)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    more_axes = _checked_axes(axes or {}, axis_name, group)
    checked = (0,) if check_replicas is True else tuple(check_replicas or ())
    described: list[Line] = [
        (
            "the step",
            f"{getattr(step_fn, '__module__', '')}.{getattr(step_fn, '__qualname__', '')}",
        ),
        *built_with,
        ("option axis_name", repr(axis_name)),
        ("option bucket_cap_mb", repr(bucket_cap_mb)),
        ("option first_bucket_cap_mb", repr(first_bucket_cap_mb)),
        ("option compile", repr(backend)),
        ("option donate_argnums", repr(donate)),
        ("option comm_dtype", repr(comm_dtype)),
        ("option trace", repr(trace)),
        ("option check_replicas", repr(checked)),
        ("option cache_size", repr(cache_size)),
        ("option overlap_steps", repr(overlap_steps)),
        ("option remat", repr(policy)),
        ("option axes", repr({n: dist.get_world_size(g) for n, g in more_axes.items()})),
    ]
    chunked = _invariant.checked(invariant)
    if chunked is not None:
        if comm_dtype is not None:
            raise ValueError(
                "invariant mode reduces gradients as exact int64 sums; comm_dtype would cast "
                "them. Use one or the other."
            )
        _invariant.check_backend(backend)
        described.append(("option invariant", repr(chunked)))
    # the step's reduction context: the invariant mode's, else the one an fddp.Loss sums over
    step_fn = _invariant.wrapped(chunked, axis_name, step_fn, sub_axes=tuple(more_axes))
    return DataParallelStep(
        step_fn,
        axis_name=axis_name,
        options=options,
        described=described,
        donate_argnums=donate,
        group=group,
        axes=more_axes,
        trace=trace,
        check_replicas=checked,
        cache_size=cache_size,
    )
