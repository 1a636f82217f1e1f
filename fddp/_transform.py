"""fddp.data_parallel: a step traced once per input signature, run as a scheduled graph."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp import _axes, _runtime, _timeline
from fddp._collectives import ProcessAxis, process_axis
from fddp._replicas import check_identical
from fddp._schedule import _fingerprint
from fddp._schedule._capture import Captured, CaptureError, DynamoCapture, trace_with_make_fx
from fddp._schedule._compile import Options, Program, schedule_graph
from fddp._schedule._plan import Schedule
from fddp._tree import path_str


def _signature(spec: optree.PyTreeSpec, leaves: list[Any]) -> tuple:
    """What a compiled program depends on: structure, tensor metadata, values of other leaves."""
    parts = []
    first_seen: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            alias = first_seen.setdefault(id(leaf), i)
            parts.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.device, alias))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    f"data_parallel: argument leaf of type {type(leaf).__name__} is neither a "
                    "tensor nor hashable; non-tensor arguments are compiled in as constants, so "
                    "they must be hashable (ints, floats, strings, tuples)."
                ) from None
            parts.append((type(leaf), leaf))
    return (spec, tuple(parts))


def _difference(old: tuple, new: tuple, paths: list[str]) -> str:
    if old[0] != new[0]:
        return f"tree structure changed: {old[0]} -> {new[0]}"
    for path, a, b in zip(paths, old[1], new[1]):
        if a != b:
            return f"argument leaf {path} changed: {_describe(a)} -> {_describe(b)}"
    return "signature changed"


def _describe(part: tuple) -> str:
    if len(part) == 5:
        shape, _, dtype, device, _ = part
        return f"{dtype} {list(shape)} on {device}"
    return repr(part[1])


def _portable(key: tuple) -> list[str]:
    """A signature as ranks can compare it: the tree, then one line per leaf.

    Devices enter by type only (rank r computes on ``cuda:r``), and non-tensor leaves by value
    only when their repr cannot hold an address.
    """
    spec, parts = key
    lines = [str(spec)]
    for index, part in enumerate(parts):
        if len(part) == 5:
            shape, stride, dtype, device, alias = part
            line = f"{dtype} {list(shape)} on {device.type} (strides {list(stride)})"
            lines.append(line + (f", the same tensor as leaf {alias}" if alias != index else ""))
        else:
            kind, value = part
            plain = kind in (bool, int, float, str, type(None))
            lines.append(f"{kind.__qualname__} {value!r}" if plain else kind.__qualname__)
    return lines


def _digest(lines: list[str]) -> int:
    """A 56-bit digest, the same in every process (``hash`` of a str is not)."""
    text = "\n".join(lines).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _donated_leaves(args: tuple, argnums: tuple[int, ...]) -> set[int]:
    """Indices, among all tensor leaves of ``args``, of those inside donated arguments."""
    for n in argnums:
        if not -len(args) <= n < len(args):
            raise ValueError(
                f"donate_argnums refers to argument {n}, but the step got {len(args)} arguments."
            )
    wanted = {n % len(args) for n in argnums}
    donated, index = set(), 0
    for n, arg in enumerate(args):
        count = sum(isinstance(x, torch.Tensor) for x in optree.tree_leaves(arg))
        if n in wanted:
            donated.update(range(index, index + count))
        index += count
    return donated


@dataclasses.dataclass
class _Entry:
    """A compiled program for one signature, and how to map its outputs back to a pytree."""

    program: Program
    captured: Captured
    dynamo: DynamoCapture | None

    def run(self, tensors: list[torch.Tensor]) -> Any:
        graph_inputs = [tensors[i] if isinstance(i, int) else i for i in self.captured.inputs]
        results = self.program.run(graph_inputs)
        leaves = [
            results[v] if kind == "graph" else tensors[v] if kind == "arg" else v
            for kind, v in self.captured.outputs
        ]
        return optree.tree_unflatten(self.captured.out_spec, leaves)

    def run_first(self, args: tuple, tensors: list[torch.Tensor], axis: ProcessAxis) -> Any:
        """Run a Dynamo capture once through Dynamo, learning where each output leaf comes from."""
        with _axes.bind(axis):
            out = self.dynamo.run_once(args)
        graph_outputs = self.dynamo.graph_outputs
        self.dynamo = None
        leaves, self.captured.out_spec = optree.tree_flatten(out)
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
        self.captured.outputs = outputs
        return out


class DataParallelStep:
    """A replicated training step; call it like the step it wraps."""

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
    ) -> None:
        functools.update_wrapper(self, step_fn)
        self._step_fn = step_fn
        self._axis_name = axis_name
        self._options = options
        self._donate_argnums = donate_argnums
        self._group = group
        self._trace = trace
        self._unchecked_argnums = check_replicas
        self._tracing = False
        self._cache: dict[tuple, _Entry] = {}
        self._last_key: tuple | None = None
        self._digests: dict[tuple, int] = {}
        self.retraces = 0

    def _axis(self, traced: bool = False) -> ProcessAxis:
        return process_axis(self._axis_name, self._group, traced=traced)

    def _check_replicas(self, args: tuple) -> None:
        """Once, before the first step: the replicated arguments must agree across ranks."""
        argnums, self._unchecked_argnums = self._unchecked_argnums, ()
        if argnums and _runtime.world_size(self._group) > 1:
            chosen = [args[n] for n in argnums if -len(args) <= n < len(args)]
            group = self._group if self._group is not None else dist.group.WORLD
            check_identical(chosen, group, f"arguments {list(argnums)} of {self.__name__}")

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike) -> Iterator[None]:
        """Record the steps run inside the block as a Chrome trace at ``path`` (written by rank 0).

        Every rank's operators and its all-reduces, as measured by ``torch.profiler``, one
        process per rank; open it in https://ui.perfetto.dev or render it with
        ``fddp.plot_timeline``.
        """
        self._tracing = True
        try:
            with _timeline.record(path, self._group):
                yield
        finally:
            self._tracing = False

    def __call__(self, *args: Any) -> Any:
        if self._unchecked_argnums:
            self._check_replicas(args)
        if not self._trace:
            with _axes.bind(self._axis()):
                return self._step_fn(*args)
        leaves, spec = optree.tree_flatten(args)
        key = _signature(spec, leaves)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        start = time.monotonic()
        try:
            if _runtime.world_size(self._group) > 1:
                self._agree_on_signature(key, args)
            entry = self._cache.get(key)
            if entry is None:
                entry = self._compile(key, args, tensors)
            if entry.captured.outputs is None:
                return entry.run_first(args, tensors, self._axis(traced=True))
            with _timeline.step_range() if self._tracing else contextlib.nullcontext():
                return entry.run(tensors)
        except RuntimeError as e:
            if isinstance(e, _runtime.RankFailureError) or not _runtime.is_peer_failure(e):
                raise
            raise _runtime.peer_failure(e, self.__name__, time.monotonic() - start) from e

    def _agree_on_signature(self, key: tuple, args: tuple) -> None:
        """Every call: one tiny all-reduce (on the CPU) checks that all ranks pass the same
        signature. Without it a rank whose batch alone changed shape would trace the step again
        while the others run the cached one, and all would wait for the timeout."""
        digest = self._digests.get(key)
        if digest is None:
            digest = self._digests.setdefault(key, _digest(_portable(key)))
        bounds = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self._group)
        if int(bounds[0]) == digest == -int(bounds[1]):
            return
        everyone: list[Any] = [None] * _runtime.world_size(self._group)
        dist.all_gather_object(everyone, _portable(key), group=self._group)
        r, theirs = next((r, e) for r, e in enumerate(everyone) if e != everyone[0])
        ours = everyone[0]
        if theirs[0] != ours[0]:
            what = f"tree structure {theirs[0]} on rank {r}, {ours[0]} on rank 0"
        else:
            paths = [path_str(p) for p in optree.tree_paths(args)]
            i = next(i for i, (a, b) in enumerate(zip(theirs[1:], ours[1:])) if a != b)
            what = (
                f"argument leaf {paths[i]} is {theirs[i + 1]} on rank {r}, {ours[i + 1]} on rank 0"
            )
        raise _fingerprint.ScheduleMismatchError(
            f"{self.__name__}: rank {r} was called with other argument shapes than rank 0 "
            f"({what}). Every rank must pass arguments of the same shapes and dtypes in every "
            "step, the last batch of an epoch included: drop it, or pad it to the full size "
            "and mask the padding in the loss."
        )

    def schedule(self, *args: Any) -> Schedule:
        """The compiled plan for these arguments (captures if needed; runs nothing).

        Returns:
            A :class:`Schedule`: every collective in launch order with its bucket, leaves, bytes,
            and the compute nodes before its launch and its wait; ``print`` it for a table.
        """
        if not self._trace:
            raise ValueError("schedule() needs a traced step; this one has trace=False.")
        leaves, spec = optree.tree_flatten(args)
        key = _signature(spec, leaves)
        entry = self._cache.get(key)
        if entry is None:
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            entry = self._compile(key, args, tensors)
        return entry.program.schedule

    def _compile(self, key: tuple, args: tuple, tensors: list[torch.Tensor]) -> _Entry:
        _runtime.init()
        if self._last_key is not None:
            self.retraces += 1
            paths = [path_str(p) for p in optree.tree_paths(args)]
            _runtime.log_rank0(
                "data_parallel: retracing %s: %s",
                self.__name__,
                _difference(self._last_key, key, paths),
            )
        self._last_key = key
        error, entry = None, None
        try:
            with _axes.bind(self._axis(traced=True)):
                entry = self._capture(args, tensors)
        except Exception as e:  # every rank must learn about it before anyone runs a collective
            error = e
        group = self._group if self._group is not None else dist.group.WORLD
        _fingerprint.agree(entry.program.sequence if entry else None, error, group)
        program, captured = entry.program, entry.captured
        program.schedule = dataclasses.replace(program.schedule, capture_seconds=captured.seconds)
        _runtime.log_rank0(
            "data_parallel: compiled %s (captured with %s)\n%s",
            self.__name__,
            captured.method,
            program.schedule,
        )
        self._cache[key] = entry
        return entry

    def _capture(self, args: tuple, tensors: list[torch.Tensor]) -> _Entry:
        """make_fx first; Dynamo for steps make_fx cannot trace (see ``_capture``)."""
        donated = _donated_leaves(args, self._donate_argnums)
        try:
            captured = trace_with_make_fx(self._step_fn, args)
        except Exception as e:
            make_fx_error = e
            _runtime.log_rank0(
                "data_parallel: make_fx could not trace %s (%s: %s); capturing with Dynamo",
                self.__name__,
                type(e).__name__,
                str(e).split("\n")[0],
            )
        else:
            return _Entry(schedule_graph(captured, self._options, donated), captured, None)
        programs: list[Program] = []

        def make_executable(captured: Captured) -> Callable:
            programs.append(schedule_graph(captured, self._options, donated))
            return programs[-1].run

        dynamo = DynamoCapture(self._step_fn, make_executable)
        try:
            captured = dynamo.trace(args, tensors)
        except CaptureError as e:
            raise CaptureError(f"{e}\n{_first_attempt(make_fx_error)}") from e
        return _Entry(programs[0], captured, dynamo)


def _first_attempt(error: Exception) -> str:
    """What make_fx said: for a step that fails eagerly too, the plain error is the clearest."""
    first_line = str(error).strip().split("\n")[0]
    return (
        f"Before Dynamo, make_fx stopped with {type(error).__name__}: {first_line}\n"
        "If the step fails the same way when run eagerly (data_parallel(step, trace=False)), "
        "fix that error first."
    )


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
            gradients until it holds this many bytes. The default, None, uses a sixteenth of
            all gradient bytes (at least ``first_bucket_cap_mb``, at most DDP's 25 MiB), about
            8 to 16 buckets: with each bucket's update running while later buckets are in
            flight, several mid-sized buckets overlap better than DDP's few large ones.
        first_bucket_cap_mb: cap of the first bucket, small so communication starts early.
        compile: False runs the scheduled FX graph; True or ``"inductor"`` compiles it.
        donate_argnums: arguments whose storage the step may reuse for its outputs.
        comm_dtype: cast each bucket to this dtype for the all-reduce (e.g. ``torch.bfloat16``).
        group: the process group (default: the world).
        trace: False runs ``step_fn`` eagerly (collectives bucketed per call, no overlap).
        check_replicas: on the first call, verify (one small all-gather of checksums) that
            these arguments are identical on every rank; True means argument 0 (the
            parameters), False turns the check off.

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
        )
    if (bucket_cap_mb is not None and bucket_cap_mb <= 0) or first_bucket_cap_mb <= 0:
        raise ValueError("bucket_cap_mb and first_bucket_cap_mb must be positive (MiB).")
    options = Options(
        bucket_cap_bytes=None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20),
        first_bucket_cap_bytes=int(first_bucket_cap_mb * 2**20),
        comm_dtype=comm_dtype,
        compile=compile,
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
    )
