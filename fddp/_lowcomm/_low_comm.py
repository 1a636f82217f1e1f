"""Low-communication data parallelism: LocalSGD, DiLoCo and streaming DiLoCo as step transforms."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

import optree
import torch
import torch.distributed as dist

from fddp._base import _axes, _invariant_marks, _saved_together
from fddp._base._axes import DEFAULT_AXIS
from fddp._base._errors import RetraceWarning, UsageValueError
from fddp._base._tree import path_str
from fddp._base._types import GradientTransformation
from fddp._collectives._ops import axis_index, axis_size, pmean
from fddp._compiler._plan import Plan
from fddp._optim._alias import sgd
from fddp._optim._update import apply_updates
from fddp._ranks._described import tensor_kind
from fddp._step._data_parallel import DataParallelStep
from fddp._step._options import StepOptions, as_line, backend, by_name


class LowCommState(NamedTuple):
    """The replicated state of a low-communication step (a pytree: save it with ``fddp.save``).

    Attributes:
        step: inner steps taken so far, an int64 scalar tensor on the CPU (it selects what a
            call synchronizes, read in Python before the call).
        params: the parameters as last synchronized (DiLoCo's outer parameters; ``()`` for
            LocalSGD, which needs none).
        opt_state: the outer optimizer's state, one per fragment (``()`` for LocalSGD).
        pending: per fragment, its averaged outer gradient between the call that launched it
            and the call that applies it (only when ``delay >= 2``; otherwise ``()``).
    """

    step: torch.Tensor
    params: Any
    opt_state: tuple
    pending: tuple

    def lost_with_its_rank(self) -> str:
        """Why no survivor can rebuild this state when its rank dies (``fddp.recoverable``)."""
        return (
            "the state is a low-communication step's (fddp.diloco / fddp.local_sgd): between "
            "outer syncs each rank's parameters and inner optimizer state are its own and die "
            "with it, and recoverable re-slices one global batch per synchronous step. Restart "
            "DiLoCo from a checkpoint taken after an outer sync instead."
        )

    def saved_with_per_rank_values(self) -> bool:  # fddp.save(rank0_only=True) then checks
        return True  # that they are the same everywhere (inner parameters differ between syncs)


class _Outer(NamedTuple):
    """The state without its step counter: what the compiled program takes and returns."""

    params: Any
    opt_state: tuple
    pending: tuple


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one call synchronizes, by fragment index.

    Attributes:
        launch_before: fragments whose outer gradient is taken from the call's input
            parameters (``delay >= 1``): its all-reduce overlaps the call's inner step.
        launch_after: fragments whose outer gradient is taken after the inner step and
            applied at once (``delay == 0``).
        apply: fragments whose averaged outer gradient is applied after the inner step.
    """

    launch_before: tuple[int, ...] = ()
    launch_after: tuple[int, ...] = ()
    apply: tuple[int, ...] = ()

    @property
    def syncs(self) -> bool:
        return bool(self.launch_before or self.launch_after or self.apply)


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When each fragment synchronizes: fragment ``k``'s outer step is applied after inner steps
    ``c`` with ``c % every == offsets[k]`` (and ``c >= delay``, so its outer gradient, taken at
    inner step ``c - delay``, exists)."""

    every: int
    offsets: tuple[int, ...]
    delay: int

    def phase(self, count: int) -> Phase:
        """The phase of the call that takes inner step ``count + 1``."""
        done = count + 1  # inner steps taken once this call's inner step is done
        apply = tuple(
            k
            for k, o in enumerate(self.offsets)
            if done % self.every == o and done >= max(self.delay, 1)
        )
        if self.delay == 0:
            return Phase(launch_after=apply)
        launch = tuple(
            k for k, o in enumerate(self.offsets) if (count + self.delay) % self.every == o
        )
        return Phase(launch_before=launch, apply=apply)

    def phases(self) -> set[Phase]:
        """Every distinct phase (one compiled program each)."""
        return {self.phase(c) for c in range(self.every + self.delay)}


def fragment_offsets(every: int, fragments: int) -> tuple[int, ...]:
    """Staggered sync points in ``[0, every)``: fragment ``k`` at ``(k + 1) * every // F``
    modulo ``every``, so the last fragment syncs with non-streaming DiLoCo's cadence."""
    return tuple(((k + 1) * every // fragments) % every for k in range(fragments))


def fragment_bounds(sizes: Sequence[int], fragments: int) -> tuple[tuple[int, int], ...]:
    """Split leaves (their element counts, in tree order) into ``fragments`` contiguous,
    non-empty groups of about equal size: group ``k`` ends at the first leaf where the running
    total reaches ``(k + 1) / fragments`` of all elements (the paper's contiguous layers)."""
    total = sum(sizes)
    cuts = [0]
    running = 0
    for i, size in enumerate(sizes):
        running += size
        k = len(cuts)
        if k < fragments and running * fragments >= total * k and i + 1 > cuts[-1]:
            cuts.append(i + 1)
    while len(cuts) < fragments:  # tiny trailing leaves: give each remaining fragment one
        cuts.append(cuts[-1] + 1)
    for k in range(fragments - 1, 0, -1):  # keep every group non-empty and inside the leaves
        cuts[k] = min(cuts[k], len(sizes) - (fragments - k))
    cuts.append(len(sizes))
    return tuple((cuts[k], cuts[k + 1]) for k in range(fragments))


def _nonfinite_ranks(
    leaves: list[torch.Tensor], dtype: torch.dtype, axis_name: str
) -> torch.Tensor:
    """A vector with one entry per replica, nonzero at this replica's index where one of
    ``leaves`` holds a NaN or Inf: averaged with the values it describes (the same all-reduce),
    it says on every replica which replicas sent non-finite values."""
    device = leaves[0].device
    finite = torch.stack([torch.isfinite(x).all() for x in leaves]).all()
    here = torch.arange(axis_size(axis_name), device=device) == axis_index(axis_name).to(device)
    return (here & ~finite).to(dtype)


def _averaged_outer_gradient(
    outer: list[torch.Tensor],
    inner: list[torch.Tensor],
    comm_dtype: torch.dtype | None,
    axis_name: str,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The mean over replicas of ``outer - inner`` sent in ``comm_dtype``, and which replicas'
    differences were not finite (:func:`_nonfinite_ranks`), in one all-reduce."""
    deltas = [o - p for o, p in zip(outer, inner, strict=True)]
    sent = deltas if comm_dtype is None else [d.to(comm_dtype) for d in deltas]
    *averaged, flags = pmean([*sent, _nonfinite_ranks(deltas, sent[0].dtype, axis_name)], axis_name)
    return [a.to(d.dtype) for a, d in zip(averaged, deltas)], flags


def _outer_step(
    opt: GradientTransformation,
    outer: list[torch.Tensor],
    opt_state: Any,
    outer_grad: list[torch.Tensor],
    inner: list[torch.Tensor],
    mix: float,
) -> tuple[list[torch.Tensor], Any, list[torch.Tensor]]:
    """The outer optimizer's step on one fragment, and the inner parameters it restarts from:
    ``mix * inner + (1 - mix) * new_outer`` (a copy of ``new_outer`` for ``mix == 0``)."""
    updates, opt_state = opt.update(outer_grad, opt_state, outer)
    new_outer = apply_updates(outer, updates)
    if mix == 0:
        restart = [o.clone() for o in new_outer]
    else:
        restart = [mix * p + (1 - mix) * o for p, o in zip(inner, new_outer)]
    return new_outer, opt_state, restart


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How a low-communication step synchronizes: its options, fixed at construction, compared
    across ranks on every call as the ``transform`` of its :class:`StepOptions` (floats by their
    bits, the outer optimizer by the values its functions close over)."""

    LABEL: ClassVar[str] = "option"

    name: str = dataclasses.field(metadata=as_line(label="the transform"))
    step: Callable[..., Any] = dataclasses.field(metadata=by_name("the inner step"))
    every: int
    fragments: int
    delay: int
    mix: float
    comm_dtype: torch.dtype | None = dataclasses.field(
        metadata=as_line(label="option comm_dtype of the outer gradients")
    )
    outer: GradientTransformation | None  # None: LocalSGD (average the parameters)

    @functools.cached_property
    def cadence(self) -> Cadence:
        return Cadence(self.every, fragment_offsets(self.every, self.fragments), self.delay)


def _local_step(
    rule: _Rule,
    axis_name: str,
    phase: Phase,
    outer: _Outer,
    params: Any,
    *args: Any,
) -> tuple[Any, ...]:
    """One call on one replica: the user's inner step, then what ``phase`` synchronizes.

    Returns ``(outer, params, *the step's other outputs, flags)``: ``flags``, per fragment
    synchronized, which replicas sent non-finite values (:func:`_nonfinite_ranks`). The
    parameters are matched to the outer ones by path; fragments follow the outer ones' order.
    """
    if rule.outer is None:  # LocalSGD: every leaf in one fragment, averaged
        out = _inner_step(rule, params, args)
        if not phase.syncs:
            return (outer, *out, ())
        leaves, spec = optree.tree_flatten(out[0])
        bad = _nonfinite_ranks(leaves, leaves[0].dtype, axis_name)
        *averaged, bad = pmean([*leaves, bad], axis_name)
        return (outer, optree.tree_unflatten(spec, averaged), *out[1:], (bad,))
    leaves, spec = optree.tree_flatten(params)
    outer_leaves = optree.tree_leaves(outer.params)
    order = _matching(rule.name, params, outer.params)
    bounds = fragment_bounds([x.numel() for x in outer_leaves], rule.fragments)
    flags: dict[int, torch.Tensor] = {}
    launched: dict[int, list[torch.Tensor]] = {}
    for k in phase.launch_before:
        a, b = bounds[k]
        launched[k], flags[k] = _averaged_outer_gradient(
            outer_leaves[a:b], [leaves[i] for i in order[a:b]], rule.comm_dtype, axis_name
        )
    out = _inner_step(rule, params, args)
    stepped = optree.tree_leaves(out[0])
    inner = [stepped[i] for i in order]  # in the outer parameters' order
    for k in phase.launch_after:
        a, b = bounds[k]
        launched[k], flags[k] = _averaged_outer_gradient(
            outer_leaves[a:b], inner[a:b], rule.comm_dtype, axis_name
        )
    new_outer, opt_states, pending = list(outer_leaves), list(outer.opt_state), list(outer.pending)
    for k in sorted(set(phase.apply) | set(phase.launch_after)):
        a, b = bounds[k]
        outer_grad = launched.pop(k) if k in launched else pending[k]
        new_outer[a:b], opt_states[k], inner[a:b] = _outer_step(
            rule.outer, new_outer[a:b], opt_states[k], outer_grad, inner[a:b], rule.mix
        )
    for k, averaged in launched.items():  # in flight until a later call applies it
        pending[k] = averaged
    new_state = _Outer(
        optree.tree_unflatten(optree.tree_structure(outer.params), new_outer),
        tuple(opt_states),
        tuple(pending),
    )
    for j, i in enumerate(order):
        stepped[i] = inner[j]
    in_order = tuple(flags[k] for k in sorted(flags))
    return (new_state, optree.tree_unflatten(spec, stepped), *out[1:], in_order)


def _matching(who: str, params: Any, outer_params: Any) -> list[int]:
    """For each leaf of the outer parameters, the index of the leaf of ``params`` at the same
    path (a dict's keys in any order), both of one shape and dtype.

    Raises:
        UsageValueError: naming the paths that only one of them has, or the first leaf whose
            shape or dtype differs.
    """
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    outer_paths, outer_leaves, outer_spec = optree.tree_flatten_with_path(outer_params)
    if spec == outer_spec:  # the same paths in the same order
        order = list(range(len(leaves)))
    else:
        index = {path: i for i, path in enumerate(paths)}
        missing = [path_str(p) for p in outer_paths if p not in index]
        known = set(outer_paths)
        extra = [path_str(p) for p in paths if p not in known]
        if missing or extra:
            raise UsageValueError(
                f"{who}: the parameters and the state's outer parameters (state.params, from "
                f"step.init(params)) hold different leaves: the parameters lack "
                f"{', '.join(missing) or 'none'} and have {', '.join(extra) or 'none'}, which "
                "the state lacks. Leaves are matched by path (a dict's "
                "keys), not by position: pass the tree step.init was given (a dict's keys in "
                "any order), or start a new state with step.init(params)."
            )
        order = [index[p] for p in outer_paths]
    for path, o, i in zip(outer_paths, outer_leaves, order):
        x = leaves[i]
        if (x.shape, x.dtype) != (o.shape, o.dtype):
            raise UsageValueError(
                f"{who}: parameter leaf {path_str(path)} is {tensor_kind(x)}, but the state's "
                "outer parameters (state.params, from step.init(params)) have "
                f"{tensor_kind(o)} there. "
                "Pass the parameters step.init was given, of the same shapes and dtypes, or "
                "start a new state with step.init(params)."
            )
    return order


def _inner_step(rule: _Rule, params: Any, args: tuple) -> tuple:
    with _invariant_marks.entered(None):  # per-rank by design: an fddp.Loss of its own batch
        out = rule.step(params, *args)
    if not isinstance(out, tuple) or not out:
        raise TypeError(
            f"{rule.name}: the step must return a tuple whose first element is the new "
            f"parameters, (params, ...); it returned {type(out).__name__}."
        )
    if optree.tree_structure(out[0]) != optree.tree_structure(params):
        raise TypeError(
            f"{rule.name}: the step's first output must be the new parameters, with the "
            f"structure of its first argument ({optree.tree_structure(params)}); it is "
            f"{optree.tree_structure(out[0])}."
        )
    return out


class LowCommStep:
    """A step that synchronizes every few calls; made by :func:`fddp.local_sgd` and
    :func:`fddp.diloco`.

    ``state = lstep.init(params)``, then ``state, params, *outs = lstep(state, params, *args)``
    where the wrapped step is ``step(params, *args) -> (params, *outs)``. On ranks the call
    runs through ``fddp.data_parallel`` with ``state`` as its only replicated argument; inside
    ``fddp.vmap`` (with ``in_dims=(None, 0, ...)``, ``out_dims=(None, 0, ...)``) it runs the
    replicas in one process. :meth:`schedule` is the plan of the program a call would run.
    """

    __name__: str

    def __init__(self, rule: _Rule, options: StepOptions) -> None:
        """``options``: as given to the transform, its ``donate_argnums`` numbered as the
        call's arguments."""
        functools.update_wrapper(self, rule.step)
        self._rule = rule
        self._axis_name = options.axis_name
        self._group = options.group
        local = functools.partial(_local_step, rule, options.axis_name)
        program = _named(local, f"{rule.name}({getattr(rule.step, '__name__', 'step')})")
        options = dataclasses.replace(
            options,
            transform=rule,
            donate_argnums=tuple(n + 1 for n in options.donate_argnums),  # after the phase
            check_replicas=(1,),  # the outer state; the inner parameters are per-rank
            cache_size=len(rule.cadence.phases()) + 4,
        )
        self._programs = DataParallelStep(program, options)
        self._local = local

    @property
    def every(self) -> int:
        return self._rule.cadence.every

    def init(self, params: Any) -> LowCommState:
        """The state at the start of training from the replicated ``params``: the outer
        parameters (a copy), one outer optimizer state per fragment, the counter at 0."""
        count = torch.zeros((), dtype=torch.int64)
        if self._rule.outer is None:
            return LowCommState(count, (), (), ())
        leaves = optree.tree_leaves(params)
        if self._rule.fragments > len(leaves):
            raise ValueError(
                f"{self._rule.name}: fragments={self._rule.fragments}, but params has "
                f"{len(leaves)} leaves; a fragment is a contiguous group of at least one leaf: "
                f"use fragments <= {len(leaves)}."
            )
        bounds = fragment_bounds([x.numel() for x in leaves], self._rule.fragments)
        outer = optree.tree_map(lambda x: x.detach().clone(), params)
        opt_state = tuple(self._rule.outer.init(leaves[a:b]) for a, b in bounds)
        pending: tuple = ()
        if self._rule.cadence.delay >= 2:
            pending = tuple([torch.zeros_like(x) for x in leaves[a:b]] for a, b in bounds)
        return LowCommState(count, outer, opt_state, pending)

    def phase(self, state: LowCommState) -> Phase:
        """What the next call with ``state`` synchronizes."""
        return self._rule.cadence.phase(int(state.step))

    def __call__(self, state: LowCommState, params: Any, *args: Any) -> tuple[Any, ...]:
        if not isinstance(state, LowCommState):
            raise TypeError(
                f"{self._rule.name}: the first argument must be the LowCommState from "
                f"step.init(params) (or the previous call), not {type(state).__name__}."
            )
        phase = self.phase(state)
        outer = _Outer(state.params, state.opt_state, state.pending)
        if _axes.find(self._axis_name) is not None:  # inside fddp.vmap: replicas here
            *out, _ = self._local(phase, outer, params, *args)
        else:
            with _one_program_per_phase():
                *out, flags = self._programs(phase, outer, params, *args)
            _refuse_nonfinite(self._rule, int(state.step), flags)
        new_outer = out[0]
        new_state = LowCommState(
            state.step + 1, new_outer.params, new_outer.opt_state, new_outer.pending
        )
        self._tie(new_state, out[1])
        return (new_state, *out[1:])

    def _tie(self, state: LowCommState, params: Any) -> None:
        """Between synchronizations the inner parameters differ per rank and from the state's:
        a save holding one without the other could not resume this run (``fddp.save``
        refuses it, naming the missing part)."""
        rule = self._rule
        synced = rule.fragments == 1 and rule.cadence.delay == 0
        if synced and int(state.step) % rule.cadence.every == 0:
            _saved_together.untie(self)
            return
        parts = {"the LowCommState": state, "the inner parameters": params}
        _saved_together.tie(
            self,
            {
                name: [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
                for name, tree in parts.items()
            },
            f"{rule.name} returned together at inner step {int(state.step)}, between "
            "synchronizations (the inner parameters differ per rank and from the state's); "
            "save them in one checkpoint (each rank its own file: rank0_only=False), or save "
            "right after a synchronization",
        )

    def schedule(self, state: LowCommState, params: Any, *args: Any) -> Plan:
        """The compiled plan of the call ``self(state, params, *args)`` would make (its
        collectives; after a first call of that phase, each output's replication: output
        ``[0]`` is the outer state without the counter, ``[1]`` the parameters, the last which
        ranks sent non-finite values)."""
        outer = _Outer(state.params, state.opt_state, state.pending)
        with _one_program_per_phase():
            return self._programs.schedule(self.phase(state), outer, params, *args)


def _refuse_nonfinite(rule: _Rule, count: int, flags: tuple[torch.Tensor, ...]) -> None:
    """Raise on every rank where a replica sent a NaN or Inf in the call that took inner step
    ``count + 1`` (``flags``: per fragment launched, :func:`_nonfinite_ranks`, averaged)."""
    if not flags:
        return
    bad = torch.stack([f.ne(0) for f in flags]).any(dim=0)
    if not bool(bad.any()):
        return
    ranks = bad.nonzero().flatten().tolist()
    applied = count + max(rule.cadence.delay, 1)  # inner steps done when it would be applied
    outer_step = -(-applied // rule.cadence.every)
    sent = "parameters" if rule.outer is None else "outer gradient (outer - inner parameters)"
    raise FloatingPointError(
        f"{rule.name}: the {sent} of rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} held NaN or Inf at outer step {outer_step} (the "
        f"synchronization after inner step {applied}). Nothing was applied: every rank raises "
        "here and the state and parameters from before this call are unchanged (unless "
        "donated). Look for the cause in that rank's inner steps (learning rate, data, loss "
        "scale), or skip such inner updates with fddp.optim.apply_if_finite."
    )


@contextlib.contextmanager
def _one_program_per_phase() -> Iterator[None]:
    """No RetraceWarning for the phase argument (leaf [0]): a program per phase is by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*argument leaf \[0\] ", RetraceWarning)
        yield


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def program(*args: Any) -> Any:
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def _check_every(who: str, every: int) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(
            f"{who}: every={every!r}; it is the number of inner steps between "
            "synchronizations, an int >= 1 (every=1 synchronizes on every call)."
        )


def _check_donate(who: str, donate_argnums: int | Sequence[int]) -> tuple[int, ...]:
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if any(n == 0 for n in donate):
        raise ValueError(
            f"{who}: donate_argnums includes 0, the LowCommState, which the calls between "
            "synchronizations return unchanged; donate the parameters (1) and later arguments."
        )
    if any(n < 0 for n in donate):
        raise ValueError(f"{who}: donate_argnums must be non-negative indices; got {donate}.")
    return donate


def _options(
    axis_name: str,
    donate_argnums: tuple[int, ...],
    group: dist.ProcessGroup | None,
    compile: bool | str,
    bucket_cap_mb: float | None,
) -> StepOptions:
    """The data-parallel options ``local_sgd`` and ``diloco`` take, as ``data_parallel``'s."""
    return StepOptions(
        axis_name=axis_name,
        donate_argnums=donate_argnums,
        group=group,
        compile=backend(compile),
        bucket_cap_mb=bucket_cap_mb,
    )


def local_sgd(
    step_fn: Callable[..., Any],
    *,
    every: int,
    axis_name: str = DEFAULT_AXIS,
    donate_argnums: int | Sequence[int] = (),
    group: dist.ProcessGroup | None = None,
    compile: bool | str = False,
    bucket_cap_mb: float | None = None,
) -> LowCommStep:
    """LocalSGD: run ``step_fn`` locally on every rank and average the parameters every
    ``every`` calls.

    Args:
        step_fn: ``step(params, *args) -> (params, *outs)``, without ``pmean`` of the
            gradients (outputs you ``pmean`` yourself cost a collective on every call).
        every: inner steps between averages (H); ``every=1`` is synchronous data
            parallelism with the mean taken after the update instead of before it.
        axis_name: as for ``fddp.data_parallel``.
        group: as for ``fddp.data_parallel``.
        compile: as for ``fddp.data_parallel``.
        bucket_cap_mb: as for ``fddp.data_parallel``.
        donate_argnums: arguments of the call (1 is the parameters) whose storage the step
            may reuse.

    Returns:
        A :class:`LowCommStep`: ``state = lstep.init(params)``, then
        ``state, params, *outs = lstep(state, params, *args)``.

    >>> import fddp, torch
    >>> def step(w, x):
    ...     return (w - 0.1 * fddp.grad(lambda w: ((x @ w) ** 2).mean())(w),)
    >>> lstep = fddp.local_sgd(step, every=4)
    >>> state, w = lstep(lstep.init(torch.ones(2)), torch.ones(2), torch.ones(3, 2))
    >>> w
    tensor([0.6000, 0.6000])
    """
    _check_every("local_sgd", every)
    rule = _Rule("local_sgd", step_fn, every, 1, 0, 0.0, None, None)
    donate = _check_donate("local_sgd", donate_argnums)
    return LowCommStep(rule, _options(axis_name, donate, group, compile, bucket_cap_mb))


def diloco(
    step_fn: Callable[..., Any],
    *,
    every: int,
    outer: GradientTransformation | None = None,
    fragments: int = 1,
    delay: int = 0,
    mix: float = 0.0,
    comm_dtype: torch.dtype | None = None,
    axis_name: str = DEFAULT_AXIS,
    donate_argnums: int | Sequence[int] = (),
    group: dist.ProcessGroup | None = None,
    compile: bool | str = False,
    bucket_cap_mb: float | None = None,
) -> LowCommStep:
    """DiLoCo, and streaming DiLoCo with ``fragments``/``delay``: local inner steps, an outer
    optimizer on the averaged parameter change.

    Every ``every`` calls each rank's change since the last synchronization, ``outer -
    inner``, is averaged over the ranks (one all-reduce) and passed as the gradient to
    ``outer``; the updated outer parameters replace the inner ones on every rank (the inner
    optimizer state stays per-rank, as in the paper).

    With ``fragments=F`` the parameter leaves are split into F contiguous groups of about
    equal size, each synchronized every ``every`` calls on its own staggered cadence
    (fragment ``k`` after inner steps ``(k + 1) * every // F`` modulo ``every``), so each sync
    sends 1/F of the model. With ``delay=tau >= 1`` a fragment's outer gradient is taken
    ``tau`` inner steps before it is applied: its all-reduce is launched at the start of a call
    and overlaps that call's inner step (and, for ``tau >= 2``, is kept in the state until it
    is applied). ``delay=0`` takes it after the inner step and applies it at once.

    Args:
        step_fn: ``step(params, *args) -> (params, *outs)``, without ``pmean`` of the
            gradients.
        every: inner steps between a fragment's synchronizations (H), >= 1.
        outer: the outer optimizer (``fddp.optim``); default
            ``fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)``, the paper's.
        fragments: contiguous groups of leaves synchronized on staggered cadences, 1 to
            ``min(every, number of leaves)``.
        delay: inner steps between taking a fragment's outer gradient and applying it,
            ``0 <= delay < every``.
        mix: with a delay, the share of the local parameters kept when a fragment's outer
            step is applied (``mix * inner + (1 - mix) * outer``; the streaming paper's
            alpha, which found 0.5 good); 0 replaces them.
        comm_dtype: dtype the outer gradients are sent in (``torch.bfloat16``); None sends
            them in the parameters' dtype.
        axis_name: as for ``fddp.data_parallel``.
        group: as for ``fddp.data_parallel``.
        compile: as for ``fddp.data_parallel``.
        bucket_cap_mb: as for ``fddp.data_parallel``.
        donate_argnums: arguments of the call (1 is the parameters) whose storage the step
            may reuse.

    Returns:
        A :class:`LowCommStep`: ``state = dstep.init(params)``, then
        ``state, params, *outs = dstep(state, params, *args)``.

    >>> import fddp, torch
    >>> def step(w, x):
    ...     return (w - 0.1 * fddp.grad(lambda w: ((x @ w) ** 2).mean())(w),)
    >>> dstep = fddp.diloco(step, every=1, outer=fddp.optim.sgd(1.0))
    >>> state, w = dstep(dstep.init(torch.ones(2)), torch.ones(2), torch.ones(3, 2))
    >>> w
    tensor([0.6000, 0.6000])
    """
    _check_every("diloco", every)
    if not isinstance(fragments, int) or fragments < 1 or fragments > every:
        raise ValueError(
            f"diloco: fragments={fragments!r}; it must be an int from 1 to every={every} "
            "(each fragment needs its own sync point among the every inner steps)."
        )
    if not isinstance(delay, int) or not 0 <= delay < every:
        raise ValueError(
            f"diloco: delay={delay!r}; the outer gradient must be applied before the same "
            f"fragment is taken again: use an int with 0 <= delay < every={every}."
        )
    if not 0 <= mix < 1:
        raise ValueError(f"diloco: mix={mix!r} must be in [0, 1) (0 replaces the inner params).")
    if outer is None:
        outer = sgd(0.7, momentum=0.9, nesterov=True)
    if not (callable(getattr(outer, "init", None)) and callable(getattr(outer, "update", None))):
        raise TypeError(
            f"diloco: outer={outer!r} is not an optimizer; pass an fddp.optim "
            "transformation such as fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)."
        )
    if comm_dtype is not None and not (
        isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point
    ):
        raise TypeError(f"diloco: comm_dtype={comm_dtype!r}: use a floating dtype or None.")
    rule = _Rule("diloco", step_fn, every, fragments, delay, float(mix), comm_dtype, outer)
    donate = _check_donate("diloco", donate_argnums)
    return LowCommStep(rule, _options(axis_name, donate, group, compile, bucket_cap_mb))
