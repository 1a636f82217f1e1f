"""fddp.recoverable: a training step that survives a dead, stuck or slow rank without a restart."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from fddp._base._types import GradientTransformation
from fddp._func import _invariant
from fddp._recovery import _environment
from fddp._recovery._admission import Admissions
from fddp._recovery._checks import check_options, refuse_unrecoverable
from fddp._recovery._generations import Generations, Progress, Recovery, is_failure
from fddp._recovery._membership import Membership
from fddp._recovery._shares import member_step, micro_rows, share
from fddp._recovery._undo import UndoLog
from fddp._step import _options
from fddp._step._data_parallel import DataParallelStep
from fddp._step._options import StepOptions, as_line, by_name

__all__ = ["RecoverableStep", "Recovery", "recoverable"]


@dataclasses.dataclass(frozen=True)
class _Built:
    """How a recoverable step was built: the ``transform`` of its data-parallel steps'
    options, compared across ranks on every call."""

    LABEL: ClassVar[str] = "recoverable"

    loss_fn: Callable[..., Any] = dataclasses.field(metadata=by_name("recoverable loss_fn"))
    micro_batches: int
    donate: bool
    invariant: bool
    admit_every: int
    settle: float = dataclasses.field(metadata=as_line())
    optimizer: GradientTransformation
    min_world_size: int
    weighted: bool = False


class RecoverableStep:
    """A replicated step over the global batch that re-forms its group when a rank fails.

    Made by :func:`fddp.recoverable`; call it as ``params, opt_state, loss = rstep(params,
    opt_state, global_batch)``.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: GradientTransformation,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        micro_batches: int,
        timeout: float,
        settle: float,
        prefix: str,
        backend: str,
        donate: bool,
        bucket_cap_mb: float | None,
        first_bucket_cap_mb: float,
        compile: bool | str,
        join: bool = False,
        invariant: bool = False,
        admit_every: int = 8,
        min_world_size: int = 1,
        compile_timeout: float = 300.0,
    ) -> None:
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._micro_batches = micro_batches
        self._donate = donate
        self._invariant = invariant
        built = _Built(
            loss_fn,
            micro_batches,
            donate,
            invariant,
            admit_every,
            settle,
            optimizer,
            min_world_size,
        )
        self._step_options = StepOptions(
            transform=built,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            compile=_options.backend(compile),
            donate_argnums=(0, 1) if donate else (),
            cache_size=4,
        )
        self._steps: dict[tuple[bool, int], DataParallelStep] = {}
        self._undo = UndoLog(donate)
        self._progress = Progress()
        membership = Membership(
            store, prefix, rank, tuple(range(world_size)), settle=settle, timeout=timeout
        )
        self._group = Generations(
            membership,
            Admissions(store, prefix, admit_every, capacity=world_size),
            backend=backend,
            timeout=timeout,
            compile_timeout=max(compile_timeout, timeout),
            min_world_size=min_world_size,
            on_leave=self._steps.clear,  # the old group's steps, and through them its groups
        )
        # imported before the first group exists: its functions' default arguments hold the
        # default group of the moment they are defined, which would keep its links open
        import torch.distributed.nn.functional  # noqa: F401

        if join:
            self._group.take_admission(self._progress)
        self._pending: RuntimeError | None = None  # a failure while forming, recovered on call
        try:
            self._group.form(starting=not join)
        except RuntimeError as error:
            if not is_failure(error):
                raise
            self._pending = error

    @property
    def uid(self) -> int:
        """This member's id (``rank`` as given to :func:`recoverable`)."""
        return self._group.membership.uid

    @property
    def members(self) -> tuple[int, ...]:
        """The ids of the current members, in rank order."""
        return self._group.membership.members

    @property
    def generation(self) -> int:
        """0 at the start; +1 at each regroup (a recovery, an admission of replacements)."""
        return self._group.membership.generation

    @property
    def step(self) -> int:
        """The steps committed so far (a replacement starts at the members' count)."""
        return self._progress.step

    @property
    def recoveries(self) -> list[Recovery]:
        """One :class:`Recovery` per recovery, in order."""
        return self._group.recoveries

    @property
    def recovered_steps(self) -> tuple[int, ...]:
        """The steps whose first attempt failed and that were redone by the survivors."""
        return tuple(r.step for r in self.recoveries)

    def close(self) -> None:
        """Stop the heartbeat and destroy the group (the others then see this member as gone)."""
        self._group.membership.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, torch.Tensor]:
        refuse_unrecoverable(opt_state)
        if self._pending is not None:
            error, self._pending = self._pending, None
            params, opt_state = self._group.recover(error, self._progress, params, opt_state)[1:]
        params, opt_state = self._group.admit(self._progress, params, opt_state)
        while True:
            self._undo.keep(params, opt_state)
            try:
                out = self._attempt(params, opt_state, batch)
            except RuntimeError as error:
                if not is_failure(error):
                    raise
                self._undo.restore(params, opt_state)
                redo, params, opt_state = self._group.recover(
                    error, self._progress, params, opt_state
                )
                if redo:
                    continue
                assert self._progress.result is not None
                return self._progress.result
            self._progress.step += 1
            self._progress.loss = out[2]
            self._group.committed()
            return out

    def _attempt(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, torch.Tensor]:
        local, weights = share(batch, self._micro_batches, len(self.members))
        if self._invariant and weights is not None:  # a replacement's own options may allow it
            raise ValueError(
                f"recoverable(invariant=True): micro_batches={self._micro_batches} does not "
                f"split evenly over the {len(self.members)} members; the exact mean over the "
                "global batch cannot weigh padding."
            )
        pstep = self._pstep(weights is not None, micro_rows(batch, self._micro_batches))
        return pstep(params, opt_state, local if weights is None else (local, weights))

    def _pstep(self, weighted: bool, micro_rows: int) -> DataParallelStep:
        """The data-parallel step of this generation (built on its first use: a new group gets
        a new step, whose program cache, call check and replica guard start empty)."""
        if (weighted, micro_rows) not in self._steps:
            k = -(-self._micro_batches // len(self.members))
            step_fn = member_step(
                self._loss_fn, self._optimizer, k, self._micro_batches, weighted, self._invariant
            )
            options = dataclasses.replace(
                self._step_options,
                transform=dataclasses.replace(self._step_options.transform, weighted=weighted),
                invariant=_invariant.checked(micro_rows) if self._invariant else None,
            )
            self._steps[weighted, micro_rows] = DataParallelStep(step_fn, options)
        return self._steps[weighted, micro_rows]


def recoverable(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: GradientTransformation,
    *,
    micro_batches: int,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float = 60.0,
    settle: float = 2.0,
    prefix: str = _environment.PREFIX,
    backend: str = "gloo",
    donate: bool = False,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float = 1.0,
    compile: bool | str = False,
    join: bool | None = None,
    invariant: bool = False,
    admit_every: int = 8,
    min_world_size: int = 1,
    compile_timeout: float = 300.0,
) -> RecoverableStep:
    """A data-parallel training step that keeps training when a rank dies, hangs or straggles.

    Forms the default process group (collective: every rank calls it), and returns a step
    ``rstep(params, opt_state, global_batch) -> (params, opt_state, loss)`` that takes the
    *global* batch, identical on every rank. The batch is cut into ``micro_batches`` equal
    micro-batches and each member computes the gradients of its consecutive share; one
    all-reduce combines them and the optimizer updates the replicated state, so the update is
    that of the whole global batch.

    Launch the job with ``python -m fddp.run`` (torchrun's flags; it keeps the survivors
    running, hosts the store and starts replacements) and leave ``store``, ``rank``,
    ``world_size`` and ``join`` out: they come from the launcher. With plain ``python`` the
    step runs as a world of one. Under another launcher pass them; the store must outlive
    every rank (a ``TCPStore`` hosted by rank 0 dies with it). torchrun cannot host it: its
    agent stops every worker when one fails (a ``ValueError`` here).

    A step is a transaction: when a collective fails (a dead rank at once, a stuck or slow one
    after ``timeout``), each survivor destroys the group, puts back what the attempt changed
    (every random generator, and donated state), registers in the store, and after every
    member registered or stopped its heartbeat for ``settle`` seconds, the first proposed list
    of survivors is everyone's. A member that was still computing when a collective timed out
    on the others is a straggler: it is expelled unless it registers within ``settle`` of
    them, and gets a :class:`fddp.RankFailureError` saying so when it comes. The survivors
    form the next generation's group under a fresh prefix of the store, bring every member to
    the newest committed state (a broadcast, needed only when the failure came between one
    member's commit and another's), and run the step again over the same global batch, now in
    fewer, larger shares. A failure during that regroup regroups again. A replacement started
    with ``join=True`` is admitted at a step boundary and receives the state and the random
    generators by broadcast.

    The store is needed only when the members must agree (a failure, an admission): a job
    whose store's host died trains on, and ends with a ``RankFailureError`` that says the
    store was lost when a member fails next.

    Args:
        loss_fn: ``loss_fn(params, micro_batch) -> loss``, the mean over the micro-batch's rows.
        optimizer: a replicated ``fddp.optim`` transformation (``shard_state`` is refused:
            a dead rank's shard has no other copy).
        micro_batches: how many equal micro-batches the global batch is cut into; choose a
            multiple of the sizes the group may shrink to, or the short members pad (with a
            weight-0 micro-batch, wasted compute; refused in invariant mode).
        store: the store the groups are formed from; it must outlive every rank (default: the
            launcher's; a world of one without a launcher).
        rank: this process's id, fixed for the run (its rank in the first generation).
        world_size: the first generation's size, and the largest the group grows back to.
        timeout: seconds a collective waits for a peer before the peer counts as stuck (from
            the first committed step of each generation on; see ``compile_timeout``).
        settle: seconds without a heartbeat after which a member that has not registered
            counts as gone, and the grace a straggler has after the others timed out (each
            member beats every ``settle / 8`` seconds, from a thread).
        prefix: the store prefix of this job's keys (keep the default under ``fddp.run``).
        backend: the process group backend.
        donate: let the step reuse the argument storage for its outputs; the pre-step state
            is then copied aside on every step until it commits (one copy of the state).
        bucket_cap_mb: as :func:`fddp.data_parallel`.
        first_bucket_cap_mb: as :func:`fddp.data_parallel`.
        compile: as :func:`fddp.data_parallel`.
        join: start as a replacement in a running job (default: as the launcher says):
            register in ``store`` under the id ``rank`` (one no member has used) and wait until
            the members admit it at a step boundary. Its first call receives the members'
            parameters, optimizer state and random generators by broadcast in place of the
            ones it passes (pass trees of the same structure); start its loop at
            ``rstep.step``.
        invariant: run the step in ``data_parallel``'s invariant mode with one chunk per
            micro-batch: the gradient of the global batch is the same bits on any number of
            members, so a run with failures (and replacements) is bitwise the run without,
            dropout included. ``micro_batches`` must divide evenly over every world size from
            ``world_size`` down to ``min_world_size`` (a ``ValueError`` here otherwise).
        admit_every: how often (in steps) the members look in the store for replacements; a
            replacement joins within ``3 * admit_every`` steps of registering, once the group
            is smaller than ``world_size``.
        min_world_size: the fewest members the job goes on with: a failure that leaves fewer
            ends it with a ``RankFailureError`` on every survivor.
        compile_timeout: seconds a collective waits for a peer during the first step of each
            generation (the start, each regroup, each admission), which traces and compiles
            the step for the new group: a replacement compiles cold while the members compile
            warm, and they wait for it. A dead peer is still seen at once. At the start, also
            how long the first group waits for every process to arrive.

    Returns:
        A :class:`RecoverableStep`, with ``generation``, ``members``, ``step`` (committed
        steps), ``recoveries`` (:class:`Recovery` records) and ``recovered_steps``.

    >>> import fddp, torch, torch.distributed as dist
    >>> if dist.is_initialized():  # recoverable forms the group itself
    ...     dist.destroy_process_group()
    >>> loss_fn = lambda w, b: ((b["x"] @ w) ** 2).mean()
    >>> opt = fddp.optim.sgd(0.1)
    >>> rstep = fddp.recoverable(loss_fn, opt, micro_batches=2)  # python: a world of one
    >>> w = torch.ones(2)
    >>> w, s, loss = rstep(w, opt.init(w), {"x": torch.ones(4, 2)})
    >>> w
    tensor([0.6000, 0.6000])
    >>> rstep.close()
    >>> fddp.init()  # a world of one again, for what runs next in this process
    """
    if dist.is_initialized():
        raise ValueError(
            "recoverable forms the process group itself (from the store, under a prefix per "
            "generation), but one exists already: call it instead of fddp.init() or "
            "torch.distributed.init_process_group."
        )
    if store is None:
        if rank is not None or world_size is not None:
            raise ValueError(
                "recoverable: rank= and world_size= come with store=; leave all three out "
                "under python -m fddp.run (or with plain python, a world of one)."
            )
        launch = _environment.launched(timeout)
        if launch is not None and prefix != _environment.PREFIX:
            raise ValueError(
                f"recoverable: prefix={prefix!r} under python -m fddp.run, whose store belongs "
                "to this job only and which reads admissions under the default prefix: leave "
                "prefix= out."
            )
        if launch is None:
            store, rank, world_size, launched_join = dist.HashStore(), 0, 1, False
        else:
            store, rank, world_size, launched_join = (
                launch.store,
                launch.rank,
                launch.world_size,
                launch.join,
            )
        join = launched_join if join is None else join
    elif rank is None or world_size is None:
        raise ValueError("recoverable: store= needs rank= and world_size= (this member's id).")
    join = bool(join)
    if not join and not 0 <= rank < world_size:
        raise ValueError(f"recoverable: rank={rank} is not in range(world_size={world_size}).")
    check_options(
        optimizer,
        world_size=world_size,
        micro_batches=micro_batches,
        min_world_size=min_world_size,
        invariant=invariant,
        join=join,
        timeout=timeout,
        settle=settle,
        compile_timeout=compile_timeout,
        admit_every=admit_every,
    )
    if invariant:
        _invariant.check_backend(_options.backend(compile))
    return RecoverableStep(
        loss_fn,
        optimizer,
        store=store,
        rank=rank,
        world_size=world_size,
        micro_batches=micro_batches,
        timeout=timeout,
        settle=settle,
        prefix=prefix,
        backend=backend,
        donate=donate,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        compile=compile,
        join=join,
        invariant=invariant,
        admit_every=admit_every,
        min_world_size=min_world_size,
        compile_timeout=compile_timeout,
    )
