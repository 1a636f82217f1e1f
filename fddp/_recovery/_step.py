"""fddp.recoverable: a training step that survives a dead or stuck rank without a restart."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

import optree
import torch
import torch.distributed as dist

from fddp._base._errors import RankFailureError
from fddp._base._types import GradientTransformation
from fddp._collectives._ops import pmean, psum
from fddp._func import _invariant
from fddp._func._grad import value_and_grad
from fddp._lowcomm._low_comm import LowCommState
from fddp._optim._update import apply_updates
from fddp._ranks import _runtime
from fddp._sharding import ShardedState
from fddp._step import _options
from fddp._step._data_parallel import DataParallelStep
from fddp._step._options import StepOptions, as_line, by_name

_POLL_S = 0.005


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
    weighted: bool = False


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery: the step that was redone, the members before and after, and its cost.

    Attributes:
        step: the step (0-based count of committed steps) whose first attempt failed.
        generation: the generation of the group formed by this recovery.
        members: the members (ids given as ``rank`` to :func:`recoverable`) after it.
        lost: the members left out (dead, stuck, or too late to register).
        seconds: from catching the failure to the new group holding the agreed state.
        cause: the first line of the error that started it.
    """

    step: int
    generation: int
    members: tuple[int, ...]
    lost: tuple[int, ...]
    seconds: float
    cause: str


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
    ) -> None:
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._store = store
        self._micro_batches = micro_batches
        self._timeout = timeout
        self._settle = settle
        self._prefix = prefix
        self._backend = backend
        self._donate = donate
        self._invariant = invariant
        self._admit_every = admit_every
        built = _Built(loss_fn, micro_batches, donate, invariant, admit_every, settle, optimizer)
        self._step_options = StepOptions(
            transform=built,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            compile=_options.backend(compile),
            donate_argnums=(0, 1) if donate else (),
            cache_size=4,
        )
        self.uid = rank
        self.members: tuple[int, ...] = tuple(range(world_size))
        self.generation = 0
        self.step = 0
        self.recoveries: list[Recovery] = []
        self._last_loss: torch.Tensor | None = None
        self._last_state: tuple[Any, Any, torch.Tensor] | None = None
        self._steps: dict[tuple[bool, int], DataParallelStep] = {}
        self._backup: list[torch.Tensor] | None = None
        self._admitted = 0  # replacements admitted so far (the same count on every member)
        self._admit_at: tuple[int, tuple[int, ...]] | None = None  # (step, ids) once agreed
        self._receive = join  # a replacement takes the state by broadcast on its first call
        self._beating = threading.Event()
        self._beat = threading.Thread(
            target=_heartbeat,
            args=(_own_client(store), f"{prefix}/alive/{rank}", settle / 8, self._beating),
            name="fddp-recoverable-heartbeat",
            daemon=True,
        )
        self._beat.start()
        # imported before the first group exists: its functions' default arguments hold the
        # default group of the moment they are defined, which would keep its links open
        import torch.distributed.nn.functional  # noqa: F401

        if join:
            self._wait_for_admission()
        self._form_group()

    def close(self) -> None:
        """Stop the heartbeat and destroy the group (the others then see this member as gone)."""
        self._beating.set()
        self._beat.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def recovered_steps(self) -> tuple[int, ...]:
        """The steps whose first attempt failed and that were redone by the survivors."""
        return tuple(r.step for r in self.recoveries)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, torch.Tensor]:
        _refuse_unrecoverable(opt_state)
        if self._admit_replacements() or self._receive:
            params, opt_state = _runtime.replicate((params, opt_state), src=0)
            self._receive = False
        while True:
            try:
                out = self._attempt(params, opt_state, batch)
            except RuntimeError as error:
                if not (isinstance(error, RankFailureError) or _runtime.is_peer_failure(error)):
                    raise
                if self._donate:
                    self._restore(params, opt_state)
                if self._recover(error, params, opt_state):
                    continue
                assert self._last_state is not None
                return self._last_state
            self.step += 1
            self._last_loss = out[2]
            return out

    def _admit_replacements(self) -> bool:
        """At a step boundary (every ``admit_every`` steps): the first member schedules the
        replacements that registered for ``2 * admit_every`` steps later (by then every member
        has read the schedule at a boundary before it); at that step every member forms the
        next generation with them. Returns whether the group was re-formed here."""
        if self._admit_at is None and self.step % self._admit_every:
            return False  # the store is read every admit_every steps only
        base = f"{self._prefix}/g{self.generation}"
        if self._admit_at is None and self.uid == self.members[0]:
            registered = self._store.add(f"{self._prefix}/joins", 0)
            if registered > self._admitted:
                ids = [
                    int(self._store.get(f"{self._prefix}/join/{i}").decode())
                    for i in range(self._admitted + 1, registered + 1)
                ]
                plan = f"{self.step + 2 * self._admit_every}:{','.join(map(str, ids))}"
                self._store.compare_set(f"{base}/admit", "", plan)
        if self._admit_at is None and self._store.check([f"{base}/admit"]):
            at, listed = self._store.get(f"{base}/admit").decode().split(":")
            self._admit_at = (int(at), tuple(int(u) for u in listed.split(",")))
        if self._admit_at is None or self._admit_at[0] != self.step:
            return False
        joining = self._admit_at[1]
        self._admit_at = None
        self._admitted += len(joining)
        self.members = (*self.members, *joining)
        self.generation += 1
        if self.uid == self.members[0]:
            admission = f"{self.generation}:{self.step}:{','.join(map(str, self.members))}"
            for u in joining:
                self._store.set(f"{self._prefix}/admitted/{u}", admission)
        self._steps = {}
        _abandon_groups()
        self._form_group()
        return True

    def _wait_for_admission(self) -> None:
        """A replacement: register, and wait until the members admit it at a step boundary."""
        index = self._store.add(f"{self._prefix}/joins", 1)
        self._store.set(f"{self._prefix}/join/{index}", str(self.uid))
        key = f"{self._prefix}/admitted/{self.uid}"
        self._store.wait([key])
        generation, step, members = self._store.get(key).decode().split(":")
        self.generation, self.step = int(generation), int(step)
        self.members = tuple(int(u) for u in members.split(","))
        self._admitted = index

    def _attempt(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, torch.Tensor]:
        n, r = len(self.members), self.members.index(self.uid)
        local, weights = _local_chunks(batch, self._micro_batches, n, r)
        if self._donate:
            self._keep(params, opt_state)
        if self._invariant and weights is not None:
            raise ValueError(
                f"recoverable(invariant=True): micro_batches={self._micro_batches} does not "
                f"split evenly over the {n} members left; the exact mean over the global batch "
                "cannot weigh padding. Choose micro_batches divisible by every world size the "
                "job may shrink to (12 covers 4, 3, 2 and 1)."
            )
        rows = optree.tree_leaves(local)[0].shape[0] // -(-self._micro_batches // n)
        pstep = self._pstep(weights is not None, rows)
        if weights is None:
            return pstep(params, opt_state, local)
        return pstep(params, opt_state, local, weights)

    def _pstep(self, weighted: bool, micro_rows: int) -> DataParallelStep:
        """The data-parallel step of this generation (built on its first use: a new group gets
        a new step, whose program cache, call check and replica guard start empty)."""
        if (weighted, micro_rows) not in self._steps:
            k = -(-self._micro_batches // len(self.members))
            step_fn = _accumulating_step(
                self._loss_fn, self._optimizer, k, self._micro_batches, weighted, self._invariant
            )
            options = dataclasses.replace(
                self._step_options,
                transform=dataclasses.replace(self._step_options.transform, weighted=weighted),
                invariant=_invariant.checked(micro_rows) if self._invariant else None,
            )
            self._steps[weighted, micro_rows] = DataParallelStep(step_fn, options)
        return self._steps[weighted, micro_rows]

    def _keep(self, params: Any, opt_state: Any) -> None:
        """Copy the donated state aside until the step commits (the transaction's undo log)."""
        leaves = [x for x in optree.tree_leaves((params, opt_state)) if isinstance(x, torch.Tensor)]
        if self._backup is None or len(self._backup) != len(leaves):
            self._backup = [torch.empty_like(x) for x in leaves]
        torch._foreach_copy_(self._backup, leaves)

    def _restore(self, params: Any, opt_state: Any) -> None:
        leaves = [x for x in optree.tree_leaves((params, opt_state)) if isinstance(x, torch.Tensor)]
        assert self._backup is not None
        torch._foreach_copy_(leaves, self._backup)

    def _form_group(self) -> None:
        """Join this generation's group, under its own prefix of the store."""
        store = dist.PrefixStore(f"{self._prefix}/g{self.generation}/pg", self._store)
        dist.init_process_group(
            self._backend,
            store=store,
            rank=self.members.index(self.uid),
            world_size=len(self.members),
            timeout=datetime.timedelta(seconds=self._timeout),
        )
        _runtime.ensure_group()
        self._steps = {}

    def _recover(self, error: BaseException, params: Any, opt_state: Any) -> bool:
        """Agree on the survivors, form the next generation's group and bring every member to
        the latest committed state. Returns whether this call's step is still to be run (False:
        another member had committed it; its result was broadcast into ``self._last``)."""
        start = time.monotonic()
        failed = self.generation
        self._steps = {}  # the old group's steps, and through them its groups
        for e in (error, error.__cause__, error.__context__):
            if e is not None and e.__traceback__ is not None:
                traceback.clear_frames(e.__traceback__)
        _abandon_groups()
        roster = self._agree(failed)
        if self.uid not in roster:
            raise RankFailureError(
                f"recoverable: this member ({self.uid}) registered after the others had "
                f"re-formed the group without it (generation {failed + 1}); it was stuck or "
                "slow for longer than the settle window. Start it again as a replacement, "
                "or raise settle=."
            ) from error
        lost = tuple(u for u in self.members if u not in roster)
        if not lost:
            raise RankFailureError(
                f"recoverable: a collective failed in generation {failed} but every member "
                "registered as alive: no rank died, one was slower than timeout= "
                f"({self._timeout:g} s) between two collectives. Raise timeout=."
            ) from error
        self.members = tuple(roster)
        self.generation = failed + 1
        self._admit_at = None  # a replacement scheduled in the failed generation is planned again
        self._form_group()
        newest = max(roster.values())
        src = self.members.index(next(u for u in self.members if roster[u] == newest))
        behind = {roster[u] for u in self.members} != {newest}
        redo = True
        if behind:
            if self.step < newest:
                redo = False
            like_loss = [self._last_loss]
            dist.broadcast_object_list(like_loss, group_src=src)
            state = _runtime.replicate((params, opt_state), src=src)
            self._last_state = (*state, like_loss[0])
            self.step = newest
        self.recoveries.append(
            Recovery(
                step=self.step,
                generation=self.generation,
                members=self.members,
                lost=lost,
                seconds=time.monotonic() - start,
                cause=(str(error).strip().splitlines() or [type(error).__name__])[0],
            )
        )
        _runtime.log_rank0(
            "recoverable: generation %d without %s, step %d redone on %d members (%.2f s)",
            self.generation,
            lost,
            self.step,
            len(self.members),
            time.monotonic() - start,
        )
        return redo

    def _agree(self, failed: int) -> dict[int, int]:
        """The survivors of generation ``failed`` and their committed step counts: each
        registers in the store and waits until every member registered or stopped beating
        (no heartbeat for ``settle`` seconds; at most ``timeout``), then proposes what it
        sees; the first proposal stored is everyone's."""
        base = f"{self._prefix}/g{failed}"
        self._store.set(f"{base}/in/{self.uid}", str(self.step))
        roster_key = f"{base}/roster"
        beats = {u: (-1, time.monotonic()) for u in self.members}
        deadline = time.monotonic() + self._timeout
        while not self._store.check([roster_key]) and time.monotonic() < deadline:
            waiting = False
            for u in self.members:
                if self._store.check([f"{base}/in/{u}"]):
                    continue
                beat, since = beats[u]
                now = self._store.add(f"{self._prefix}/alive/{u}", 0)
                if now != beat:
                    beats[u] = (now, time.monotonic())
                    waiting = True
                elif time.monotonic() - since < self._settle:
                    waiting = True
            if not waiting:
                break
            time.sleep(_POLL_S)
        seen = [u for u in self.members if self._store.check([f"{base}/in/{u}"])]
        proposal = ",".join(f"{u}:{self._store.get(f'{base}/in/{u}').decode()}" for u in seen)
        agreed = self._store.compare_set(roster_key, "", proposal).decode()
        return {int(u): int(c) for u, c in (item.split(":") for item in agreed.split(","))}


def _abandon_groups() -> None:
    """Abort every process group of this process and forget them: their links close, so a
    peer still waiting in a collective on one of them fails at once instead of at its timeout
    (``destroy_process_group`` alone leaves the links open while anything, such as the default
    arguments of ``torch.distributed.nn.functional``, still holds the group)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        dist.destroy_process_group()
    else:
        abort()
    gc.collect()  # the last reference to a gloo group closes its links


def _own_client(store: dist.Store) -> dist.Store:
    """A client of ``store`` for another thread (its own connection to a ``TCPStore``)."""
    return store.clone()  # type: ignore[attr-defined]


def _heartbeat(store: dist.Store, key: str, interval: float, stop: threading.Event) -> None:
    """Count up ``key`` every ``interval`` seconds until ``stop`` is set (a member that stops
    counting, killed or stopped, is taken for gone by the survivors)."""
    while not stop.wait(interval):
        try:
            store.add(key, 1)
        except RuntimeError:  # the store is gone: the survivors cannot agree without it anyway
            return


def _refuse_unrecoverable(opt_state: Any) -> None:
    """State that lives on one rank only cannot be recovered from the survivors."""
    kinds = (ShardedState, LowCommState)
    nodes = optree.tree_flatten(opt_state, is_leaf=lambda x: isinstance(x, kinds))[0]
    for node in [opt_state, *nodes]:
        if isinstance(node, ShardedState):
            raise ValueError(
                "recoverable: the optimizer state is sharded (fddp.optim.shard_state): each "
                "rank holds the only copy of its 1/N of the moments, which dies with the rank. "
                "Use a replicated optimizer (e.g. fddp.optim.adamw) with recoverable, or keep "
                "shard_state and restart from fddp.save_sharded checkpoints (docs/guides/"
                "restarts-deep-models.md)."
            )
        if isinstance(node, LowCommState):
            raise ValueError(
                "recoverable: the state is a low-communication step's (fddp.diloco / "
                "fddp.local_sgd): between outer syncs each rank's parameters and inner "
                "optimizer state are its own and die with it, and recoverable re-slices one "
                "global batch per synchronous step. Restart DiLoCo from a checkpoint taken "
                "after an outer sync instead."
            )


def _local_chunks(
    batch: Any, micro_batches: int, n: int, r: int
) -> tuple[Any, torch.Tensor | None]:
    """Rank ``r`` of ``n``'s micro-batches of the global ``batch`` (consecutive rows), and
    their weights when the ranks hold different counts (None when equal): the short ranks
    repeat their first micro-batch with weight 0, so every rank runs the same program."""
    leaves, spec = optree.tree_flatten(batch)
    rows = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(rows) != 1:
        raise ValueError(
            "recoverable: every tensor of the global batch needs the same leading (row) "
            f"dimension to be cut into micro-batches; found {sorted(rows) or 'none'}."
        )
    (total,) = rows
    if total % micro_batches:
        raise ValueError(
            f"recoverable: the global batch has {total} rows, which do not split into "
            f"micro_batches={micro_batches} equal micro-batches; use a global batch that is a "
            "multiple of micro_batches."
        )
    micro = total // micro_batches
    counts = [len(c) for c in torch.tensor_split(torch.empty(micro_batches, 0), n)]
    first, mine, k = sum(counts[:r]), counts[r], max(counts)
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        part = leaf[first * micro : (first + mine) * micro]
        if mine < k:
            part = torch.cat([part, *[part[:micro]] * (k - mine)])
        out.append(part)
    local = optree.tree_unflatten(spec, out)
    if min(counts) == k:
        return local, None
    weights = torch.zeros(k)
    weights[:mine] = 1.0
    return local, weights


def _accumulating_step(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: GradientTransformation,
    k: int,
    micro_batches: int,
    weighted: bool,
    invariant: bool = False,
) -> Callable[..., Any]:
    """The step a member runs: the summed loss and gradients of its ``k`` micro-batches
    (weighted when some are padding), summed over the members and divided by the global
    micro-batch count, then the optimizer's update."""
    vg = value_and_grad(loss_fn)

    def step(params: Any, opt_state: Any, batch: Any, weights: Any = None) -> Any:
        if invariant:  # data_parallel(invariant=) takes the exact mean per micro-batch
            loss, grads = pmean(vg(params, batch))
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return apply_updates(params, updates), opt_state, loss
        leaves, spec = optree.tree_flatten(batch)
        parts = [
            torch.tensor_split(x, k) if isinstance(x, torch.Tensor) else [x] * k for x in leaves
        ]
        total: Any = None
        for i in range(k):
            out = vg(params, optree.tree_unflatten(spec, [p[i] for p in parts]))
            if weighted:
                out = optree.tree_map(lambda t, i=i: t * weights[i], out)
            total = out if total is None else optree.tree_map(torch.add, total, out)
        if weighted:
            loss, grads = optree.tree_map(lambda t: t / micro_batches, psum(total))
        else:  # k micro-batches on each of micro_batches / k members: the plain step's pmean
            loss, grads = pmean(total) if k == 1 else optree.tree_map(lambda t: t / k, pmean(total))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss

    step.__qualname__ = "recoverable_step" if not weighted else "recoverable_weighted_step"
    return functools.wraps(loss_fn, assigned=("__module__",))(step)


def recoverable(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: GradientTransformation,
    *,
    store: dist.Store,
    rank: int,
    world_size: int,
    micro_batches: int,
    timeout: float = 60.0,
    settle: float = 2.0,
    prefix: str = "fddp-recoverable",
    backend: str = "gloo",
    donate: bool = False,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float = 1.0,
    compile: bool | str = False,
    join: bool = False,
    invariant: bool = False,
    admit_every: int = 8,
) -> RecoverableStep:
    """A data-parallel training step that keeps training when a rank dies or hangs.

    Forms the default process group from ``store`` (collective: every rank calls it), and
    returns a step ``rstep(params, opt_state, global_batch) -> (params, opt_state, loss)``
    that takes the *global* batch, identical on every rank. The batch is cut into
    ``micro_batches`` equal micro-batches and each member computes the summed gradients of its
    consecutive share; one all-reduce sums them and the optimizer updates the replicated
    state, so the update is that of the whole global batch.

    A step is a transaction: when a collective fails (a dead rank at once, a stuck one after
    ``timeout``), each survivor destroys the group, registers in ``store``, and after every
    member registered or stopped its heartbeat for ``settle`` seconds, the first proposed list
    of survivors is everyone's.
    They form the next generation's group under a fresh prefix of ``store``, bring every
    member to the newest committed state (a broadcast, needed only when the failure came
    between one member's commit and another's), and run the step again over the same global
    batch, now in fewer, larger shares. A member that registers after the list was fixed gets
    a :class:`fddp.RankFailureError`. A replacement started later with ``join=True`` is
    admitted at a step boundary: the group is formed again with it and it receives the state
    by broadcast. The store must outlive every rank (torchrun's agent
    store, or a ``TCPStore`` hosted by the launcher); ``TCPStore`` hosted by rank 0 dies
    with it.

    Args:
        loss_fn: ``loss_fn(params, micro_batch) -> loss``, the mean over the micro-batch's rows.
        optimizer: a replicated ``fddp.optim`` transformation (``shard_state`` is refused:
            a dead rank's shard has no other copy).
        store: the store the groups are formed from; it must outlive every rank.
        rank: this process's id, fixed for the run (its rank in the first generation).
        world_size: the first generation's size.
        micro_batches: how many equal micro-batches the global batch is cut into; choose a
            multiple of the sizes the group may shrink to, or the short members pad (with a
            weight-0 micro-batch, wasted compute).
        timeout: seconds a collective waits for a peer before the peer counts as stuck.
        settle: seconds without a heartbeat after which a member that has not registered
            counts as gone (each member beats every ``settle / 8`` seconds, from a thread).
        prefix: the store prefix of this job's keys.
        backend: the process group backend.
        donate: let the step reuse the argument storage for its outputs; the pre-step state
            is then copied aside on every step until it commits (one copy of the state).
        bucket_cap_mb: as :func:`fddp.data_parallel`.
        first_bucket_cap_mb: as :func:`fddp.data_parallel`.
        compile: as :func:`fddp.data_parallel`.
        join: start as a replacement in a running job: register in ``store`` under the id
            ``rank`` (one no member has used) and wait until the members admit it at a step
            boundary (``world_size`` is then ignored). Its first call receives the members'
            parameters and optimizer state by broadcast in place of the ones it passes (pass
            trees of the same structure); start its loop at ``rstep.step``.
        invariant: run the step in ``data_parallel``'s invariant mode with one chunk per
            micro-batch: the gradient of the global batch is the same bits on any number of
            members, so a run with failures (and replacements) is bitwise the run without.
            ``micro_batches`` must then divide evenly over every world size the job shrinks
            to (a ``ValueError`` otherwise).
        admit_every: how often (in steps) the members look in the store for replacements; a
            replacement joins within ``3 * admit_every`` steps of registering.

    Returns:
        A :class:`RecoverableStep`, with ``generation``, ``members``, ``step`` (committed
        steps), ``recoveries`` (:class:`Recovery` records) and ``recovered_steps``.

    >>> import fddp, torch, torch.distributed as dist
    >>> if dist.is_initialized():  # recoverable forms the group itself
    ...     dist.destroy_process_group()
    >>> store = dist.HashStore()
    >>> loss_fn = lambda w, b: ((b["x"] @ w) ** 2).mean()
    >>> opt = fddp.optim.sgd(0.1)
    >>> rstep = fddp.recoverable(loss_fn, opt, store=store, rank=0, world_size=1,
    ...                          micro_batches=2)
    >>> w = torch.ones(2)
    >>> w, s, loss = rstep(w, opt.init(w), {"x": torch.ones(4, 2)})
    >>> w
    tensor([0.6000, 0.6000])
    >>> rstep.close()
    >>> fddp.init()  # a world of one again, for what runs next in this process
    """
    if dist.is_initialized():
        raise ValueError(
            "recoverable forms the process group itself (from store=, under a prefix per "
            "generation), but one exists already: call it instead of fddp.init() or "
            "torch.distributed.init_process_group."
        )
    if not isinstance(micro_batches, int) or (micro_batches < world_size and not join):
        raise ValueError(
            f"recoverable: micro_batches={micro_batches!r} must be an int >= world_size "
            f"({world_size}): every member needs at least one micro-batch."
        )
    if not join and not 0 <= rank < world_size:
        raise ValueError(f"recoverable: rank={rank} is not in range(world_size={world_size}).")
    if not isinstance(admit_every, int) or admit_every < 1:
        raise ValueError(f"recoverable: admit_every={admit_every!r} must be an int >= 1.")
    if timeout <= 0 or settle <= 0:
        raise ValueError("recoverable: timeout and settle must be positive (seconds).")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"recoverable: optimizer is a {type(optimizer).__name__}; pass an fddp.optim "
            "transformation (e.g. fddp.optim.adamw(1e-3))."
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
    )
