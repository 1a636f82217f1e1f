"""The invariant mode: gradients per fixed-size chunk of the batch, summed exactly in int64."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.fx import traceback as fx_traceback
from torch.overrides import TorchFunctionMode

from fddp._base import _invariant_marks
from fddp._base._annotations import EXACT_SUM
from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._base._tree import leaves_with_paths
from fddp._collectives._bucket_policy import pack
from fddp._collectives._ops import named_axis, psum
from fddp._func._loss import Loss, kind, mixed_kinds_error

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2**27: a 32-bit value times it stays inside int64
_GOLDEN = 0x9E3779B9


class Invariant(NamedTuple):
    """How :func:`fddp.data_parallel` and :func:`fddp.vmap` compute world-size-invariant steps.

    Inside a step built with ``invariant=...``, ``fddp.value_and_grad``/``fddp.grad`` split the
    batch argument of the differentiated function into chunks of ``chunk_size`` examples,
    compute each chunk's loss and gradient alone (same shapes on any number of ranks), with
    dropout drawn from a key of the step's seed and the chunk's global index, and sum them
    over every chunk of the global batch exactly: each value is rounded once to a fixed-point
    int64 on a scale all ranks agree on, the integers are summed (any order gives the same
    sum), and the sum is converted back once. A scalar loss is taken as a mean over the
    chunk's examples, so the chunks' sum is divided by their number; an ``fddp.Loss`` says
    otherwise: ``Loss.mean(total, weight)`` divides the summed totals by the summed weights
    (a mean over tokens), ``Loss.sum(total)`` divides by nothing. ``fddp.pmean`` of these
    results returns them as they are. So any number of ranks, ``fddp.vmap`` replicas and any
    bucket cap give bitwise the same parameters, with ``overlap_steps``, ``shard_params``,
    ``shard_state`` and ``axes`` too (a mean of the results over the step's axes, or
    ``shard_state``'s reduce-scatter, is the identity). ``compile=True`` is refused
    (docs/guides/determinism.md).

    Attributes:
        chunk_size: examples per chunk; every rank's batch must be a multiple of it.
        batch_argnum: which positional argument of the differentiated function is the batch
            (every tensor leaf has the examples along dim 0), or a tuple of them for a batch
            spread over several (``loss_fn(params, x, y)``: ``(1, 2)``); the others are taken
            whole. With one, another argument whose every leaf holds as many examples along
            dim 0 is refused: name it in the tuple, or pass ``(n,)`` to take it whole.
        fraction_bits: the fixed point's bits below each leaf's largest magnitude; at most
            ``2 ** (62 - fraction_bits)`` chunks per global batch.

    Example:
        >>> import fddp
        >>> fddp.Invariant(chunk_size=8)
        Invariant(chunk_size=8, batch_argnum=-1, fraction_bits=46)
    """

    chunk_size: int
    batch_argnum: int | tuple[int, ...] = -1
    fraction_bits: int = 46


def checked(invariant: Invariant | int | None) -> Invariant | None:
    """``invariant=`` as given to a transform, validated (an int is a chunk size)."""
    if invariant is None:
        return None
    if isinstance(invariant, int) and not isinstance(invariant, bool):
        invariant = Invariant(chunk_size=invariant)
    if not isinstance(invariant, Invariant):
        raise UsageTypeError(
            f"invariant={invariant!r}: pass a chunk size (int) or fddp.Invariant(chunk_size=...)."
        )
    size, bits = invariant.chunk_size, invariant.fraction_bits
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UsageValueError(f"invariant: chunk_size={size!r} must be a positive int.")
    if not isinstance(bits, int) or not 24 <= bits <= 60:
        raise UsageValueError(
            f"invariant: fraction_bits={bits!r} must be an int from 24 (fp32's precision) to 60."
        )
    nums = invariant.batch_argnum
    if not isinstance(nums, int) and not (
        isinstance(nums, tuple) and nums and all(isinstance(n, int) for n in nums)
    ):
        raise UsageTypeError(
            f"invariant: batch_argnum={nums!r} is not an int or a non-empty tuple of ints."
        )
    return invariant


def check_backend(backend: str) -> None:
    """Refuse a ``data_parallel`` backend the mode cannot vouch for (every rank alike, at build)."""
    if backend != "fx":
        raise UsageValueError(
            f"invariant= with compile=True ({backend!r}): Inductor fuses and generates kernels "
            "for the graph as a whole, and the graph holds as many chunks as this rank's "
            "batch, so its choices, and with them the bits of a chunk's gradient, may "
            "change with the world size. Use compile=False (the FX backend runs every chunk "
            "with the same kernels on any world size)."
        )


def within(
    invariant: Invariant | None,
    axis_name: str,
    sub_axes: tuple[str, ...],
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` as a step over ``axis_name`` (``sub_axes``: axes over subgroups
    of its group, such as ``data_parallel``'s ``axes``): in the invariant mode, or with None
    in the default mode, where an ``fddp.Loss`` is summed over the axis."""
    run = None if invariant is None else functools.partial(_run, invariant)
    with _invariant_marks.entered(_invariant_marks.Context(axis_name, run, sub_axes)):
        return fn(*args, **kwargs)


def wrapped(
    invariant: Invariant | None,
    axis_name: str,
    fn: Callable[..., Any],
    sub_axes: Sequence[str] = (),
) -> Callable[..., Any]:
    """``fn`` running as a step (:func:`within`); keeps ``fn``'s name for errors and reports."""
    step = functools.partial(within, invariant, axis_name, tuple(sub_axes), fn)
    functools.update_wrapper(step, fn)
    return step


class _Job:
    """One value_and_grad call in the mode: the function, its arguments as flat tensors, and
    the chunking of its batch."""

    def __init__(
        self,
        invariant: Invariant,
        f: Callable[..., Any],
        argnums: int | Sequence[int],
        has_aux: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        plain: Callable[..., Any],
    ) -> None:
        self.invariant, self.f, self.argnums, self.has_aux = invariant, f, argnums, has_aux
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        self.kwargs, self.plain = kwargs, plain
        given = invariant.batch_argnum
        batch = (given,) if isinstance(given, int) else given
        for n in batch:
            if not -len(args) <= n < len(args):
                raise UsageValueError(
                    f"invariant mode: batch_argnum={given}, but the differentiated function got "
                    f"{len(args)} positional arguments. Pass the batch as an argument (e.g. "
                    "loss_fn(params, buffers, batch)) and set fddp.Invariant(batch_argnum=...)."
                )
        self.batch_nums = sorted({n % len(args) for n in batch})
        differentiated = {m % len(args) for m in nums}
        if differentiated & set(self.batch_nums):
            raise UsageValueError(
                f"invariant mode: argument {min(differentiated & set(self.batch_nums))}, the "
                f"batch (batch_argnum={given}), is also differentiated (argnums). The batch must "
                "be an argument that is not differentiated: pass it last, or set "
                "fddp.Invariant(batch_argnum=...)."
            )
        self.rows = _rows_of(args, self.batch_nums)
        if isinstance(given, int):
            _refuse_unchunked(args, self.batch_nums[0], differentiated, self.rows)
        if self.rows % invariant.chunk_size:
            raise UsageValueError(
                f"invariant mode: this rank's batch has {self.rows} examples, not a multiple of "
                f"chunk_size={invariant.chunk_size}. Give every rank a multiple of the chunk "
                "size (the global batch then splits into the same chunks on any world size)."
            )
        self.chunks = self.rows // invariant.chunk_size
        self.arg_leaves, self.arg_spec = optree.tree_flatten(args)
        self.tensor_at = [i for i, x in enumerate(self.arg_leaves) if isinstance(x, torch.Tensor)]
        batch_leaves = optree.tree_leaves([args[n] for n in self.batch_nums])
        self.device = next(x.device for x in batch_leaves if isinstance(x, torch.Tensor))
        self.aux_box: list[Any] = []
        self.n_floats = 0
        self.kind = ""  # of the loss: "example" (a scalar), "mean" or "sum" (an fddp.Loss)
        self.aux_floats = 0  # floating tensors in the aux, after the value and before the grads

    def tensors(self) -> list[torch.Tensor]:
        return [self.arg_leaves[i] for i in self.tensor_at]

    def args_from(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        leaves = list(self.arg_leaves)
        for i, x in zip(self.tensor_at, tensors):
            leaves[i] = x
        return optree.tree_unflatten(self.arg_spec, leaves)

    def chunk_results(
        self, tensors: Sequence[torch.Tensor], first_chunk: torch.Tensor, seed: torch.Tensor
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per chunk of this replica's batch: (floating values, integer values), flat; the
        value first (an fddp.Loss's total), then the aux's tensor leaves, then the gradients,
        and last an fddp.Loss.mean's weight (as float64)."""
        args = self.args_from(tensors)
        size = self.invariant.chunk_size
        out = []
        vg = self.plain(self.f, self.argnums, self.has_aux)
        for i in range(self.chunks):
            chunk_args = list(args)
            for n in self.batch_nums:
                chunk_args[n] = optree.tree_map(
                    functools.partial(_rows, start=i * size, size=size), args[n]
                )
            key = _hash(seed + _hash(first_chunk + i))
            with _invariant_marks.entered(None), _KeyedRandomness(key):
                value, grads = vg(*chunk_args, **self.kwargs)
            aux = None
            if self.has_aux:
                value, aux = value
            normalised_as, value, weight = _parts(value)
            leaves, spec = optree.tree_flatten((value, aux, grads))
            self._check(normalised_as, value, aux, leaves, spec)
            floats = [x for x in leaves if _floating(x)]
            ints = [x for x in leaves if isinstance(x, torch.Tensor) and not _floating(x)]
            if weight is not None:  # reduced like the floats; exact for integer counts
                floats.append(weight.to(torch.float64))
            out.append((floats, ints))
        return out

    def _check(
        self, normalised_as: str, value: Any, aux: Any, leaves: list[Any], spec: optree.PyTreeSpec
    ) -> None:
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise UsageValueError(
                "invariant mode: the differentiated function must return a scalar tensor loss, "
                "taken as the mean over the batch's examples (the mode averages the chunks' "
                "values), or an fddp.Loss: fddp.Loss.mean(total, weight) for a mean over tokens "
                "or weighted examples, fddp.Loss.sum(total) for a sum."
            )
        plain = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        kinds = [
            ("f" if x.is_floating_point() else "i") if isinstance(x, torch.Tensor) else "-"
            for x in leaves
        ]
        if not self.aux_box:
            self.aux_box.append((spec, plain, kinds))
            self.kind = normalised_as
            self.aux_floats = sum(_floating(x) for x in optree.tree_leaves(aux))
        elif self.aux_box[0] != (spec, plain, kinds):
            raise UsageValueError(
                "invariant mode: the aux returned for two chunks differs in structure or in "
                "its non-tensor values; aux must look the same for every chunk."
            )
        elif normalised_as != self.kind:
            raise mixed_kinds_error("invariant mode", self.kind, normalised_as, "chunk")
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.is_complex():
                raise UsageTypeError(
                    "invariant mode: complex values cannot be reduced exactly; return real ones."
                )

    def result(self, floats: list[torch.Tensor], ints: list[torch.Tensor]) -> Any:
        """``(value[, aux]), grads`` from the reduced floating and integer leaves."""
        spec, plain, kinds = self.aux_box[0]
        fi, ii = iter(floats), iter(ints)
        leaves = [
            next(fi) if k == "f" else next(ii) if k == "i" else x for k, x in zip(kinds, plain)
        ]
        value, aux, grads = optree.tree_unflatten(spec, leaves)
        return ((value, aux) if self.has_aux else value), grads


def _rows_of(args: tuple[Any, ...], batch_nums: list[int]) -> int:
    """The number of examples along dim 0 of every tensor leaf of the batch arguments."""
    paths, leaves, _ = leaves_with_paths([args[n] for n in batch_nums])
    rows = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if not leaves or any(isinstance(x, torch.Tensor) and x.dim() == 0 for x in leaves):
        raise UsageValueError(
            f"invariant mode: arguments {batch_nums} are the batch, but they have "
            + ("no tensors" if not leaves else "0-d tensors")
            + ". Every tensor leaf of the batch needs the examples along dim 0."
        )
    if len(rows) != 1:
        found = {p: list(x.shape) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}
        raise UsageValueError(
            f"invariant mode: the batch's tensor leaves have different sizes along dim 0 "
            f"({found}); every leaf must hold the same examples along dim 0."
        )
    return rows.pop()


def _refuse_unchunked(
    args: tuple[Any, ...], batch: int, differentiated: set[int], rows: int
) -> None:
    """Refuse a second argument that looks like more of the batch: every leaf a tensor of
    ``rows`` examples along dim 0, neither differentiated nor chunked."""
    for n, arg in enumerate(args):
        leaves = optree.tree_leaves(arg)
        if n == batch or n in differentiated or not leaves:
            continue
        if all(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows for x in leaves):
            raise UsageValueError(
                f"invariant mode: argument {n} holds {rows} examples along dim 0, as the batch "
                f"(argument {batch}) does, but only the batch is cut into chunks: each chunk "
                f"would see all of argument {n}. For a batch spread over both, pass "
                f"fddp.Invariant(batch_argnum=({min(n, batch)}, {max(n, batch)})); to take "
                f"argument {n} whole, batch_argnum=({batch},)."
            )


def _rows(x: Any, start: int, size: int) -> Any:
    return x.narrow(0, start, size) if isinstance(x, torch.Tensor) else x


def _hash(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of an int64 tensor (values kept in [0, 2**32))."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    return x ^ (x >> 16)


_REFUSED = {
    torch.rand,
    torch.rand_like,
    torch.randn,
    torch.randn_like,
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.Tensor.bernoulli_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    F.rrelu,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
}


class _KeyedRandomness(TorchFunctionMode):
    """Dropout inside one chunk drawn from the chunk's key and the call's position: the same
    mask for the same global chunk on any world size, traced or not. Other draws from the
    global generator would not be keyed: refused."""

    def __init__(self, key: torch.Tensor) -> None:
        super().__init__()
        self.key, self.calls = key, 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            return self._dropout(*args, **kwargs)
        dropout_p = kwargs.get("dropout_p", 0.0)
        if func is F.scaled_dot_product_attention and len(args) > 4:
            dropout_p = args[4]
        if func is F.multi_head_attention_forward:
            training = kwargs.get("training", True)
            training = args[13] if len(args) > 13 else training
            dropout_p = kwargs.get("dropout_p", args[10] if len(args) > 10 else 0.0) * training
        if func in _REFUSED or dropout_p:
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise UsageValueError(
                f"invariant mode: {name} draws from the global random generator, which is not "
                "keyed by the chunk, so its draws would depend on the world size. Use dropout "
                "(torch.nn.Dropout / F.dropout, keyed per chunk here), and attention without "
                "dropout_p (apply F.dropout to the attention weights instead)."
            )
        return func(*args, **kwargs)

    def _dropout(
        self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p == 0:
            return input
        if p == 1:
            return input * 0
        self.calls += 1
        index = torch.arange(input.numel(), device=input.device).view(input.shape)
        salt = _hash(torch.tensor(self.calls * _GOLDEN, device=input.device))
        bits = _hash(self.key.to(input.device) ^ _hash(index + salt))
        keep = bits.to(torch.float64) * 2.0**-32 >= p
        out = input * keep.to(input.dtype) * (1.0 / (1.0 - p))
        return input.copy_(out) if inplace else out


# Below every magnitude of the dtype (the exponent of an all-zero leaf, so that it leaves the
# scale to the others): float64's least subnormal is 2**-1074, float32's (and so bfloat16's
# and float16's, reduced in float32) 2**-149.
_FLOOR_EXPONENT = {torch.float64: -1075}
_FLOOR_EXPONENT_32 = -150
# Where the first of the two powers of two a scale is split into is clamped, per reduced dtype:
# both stay normal, and the first leaves room for a divisor (a chunk count, a global weight).
_FIRST_POWER = {torch.float32: (-60, 125), torch.float64: (-960, 1000)}
_EXPONENT_GROUPS = 16  # about as many as a step's gradient buckets (the bucket rule's sixteenth)


def _parts(value: Any) -> tuple[str, Any, torch.Tensor | None]:
    """A chunk's loss as (kind, the value to reduce, the weight to reduce beside it)."""
    if isinstance(value, Loss):
        return kind(value), value.total, value.weight
    return kind(value), value, None


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _reduced_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf's largest magnitude and exponent are computed in (its own range)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``x`` in its reduced dtype, in one pass (NaN if any is NaN)."""
    dtype = _reduced_dtype(x.dtype)
    if x.numel() == 0:
        return torch.zeros((), dtype=dtype, device=x.device)
    low, high = torch.aminmax(x.detach())
    return torch.maximum(high, -low).to(dtype)


def _exponent(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[e, bad]`` (int64) of one leaf over its chunks: the power of two above every
    magnitude (below every magnitude of the dtype when all are zero), and whether any value
    is not finite."""
    big = torch.stack([_amax(x) for x in chunks]).amax()
    floor = _FLOOR_EXPONENT.get(chunks[0].dtype, _FLOOR_EXPONENT_32)
    finite = torch.isfinite(big)
    exponent = torch.where(finite & (big > 0), torch.frexp(big).exponent.to(torch.int64), floor)
    return torch.stack([exponent, (~finite).to(torch.int64)])


def _powers_of_two(
    exponent: torch.Tensor, dtype: torch.dtype, divisor: int | torch.Tensor = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two scalars of the leaf's reduced dtype whose product is ``2**exponent / divisor``:
    the exponent's range exceeds the dtype's (float32's reaches ``2**-149``, a fixed point
    ``2**bits`` above it), so it is split in two powers of two, each exact, and the division
    is rounded once into the first."""
    dtype = _reduced_dtype(dtype)
    low, high = _FIRST_POWER[dtype]
    first = exponent.clamp(low, high)
    return (
        (torch.exp2(first.to(torch.float64)) / divisor).to(dtype),
        torch.exp2((exponent - first).to(torch.float64)).to(dtype),
    )


def _fixed_sum(chunks: Sequence[torch.Tensor], exponent: torch.Tensor, bits: int) -> torch.Tensor:
    """The int64 sum over chunks of one leaf's fixed-point values ``trunc(x * 2**(bits - e))``:
    multiplying by a power of two that keeps the product below ``2**bits`` is exact (in the
    leaf's reduced dtype, by the two parts of the scale, so that neither overflows), so only
    the fraction below the grid is dropped."""
    dtype = _reduced_dtype(chunks[0].dtype)
    first, second = _powers_of_two(bits - exponent, dtype)
    total = None
    for x in chunks:
        fixed = (x.detach().to(dtype) * first * second).to(torch.int64)
        total = fixed if total is None else total + fixed
    assert total is not None
    return total


def _mean_of(
    total: torch.Tensor,
    shared: torch.Tensor,
    divisor: int | torch.Tensor,
    dtype: torch.dtype,
    bits: int,
) -> torch.Tensor:
    """An int64 sum of fixed-point values (``shared``: its ``[e, bad]``) as ``dtype``, divided
    by ``divisor``: scaled by ``2**(e - bits) / divisor`` in the reduced dtype, NaN where a
    value was not finite."""
    first, second = _powers_of_two(shared[0] - bits, dtype, divisor)
    first = torch.where(shared[1] > 0, torch.nan, first)
    return (total.to(first.dtype) * first * second).to(dtype)


def _reduce(
    job: _Job,
    chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    count: int,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    summed: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """The floating leaves of ``chunks`` (this replica's) reduced over all ``count`` chunks of
    the global batch: per leaf, its exponent (``agree``: the maximum over the replicas), its
    exact sum (``summed``: over the replicas), divided as the loss's kind says."""
    bits = job.invariant.fraction_bits
    leaves = list(zip(*(floats for floats, _ in chunks)))
    shared: list[Any] = [None] * len(leaves)
    sums: list[Any] = [None] * len(leaves)
    for group in _exponent_groups(leaves):
        # run where the group's last chunk is ready (the compiler hoists these nodes), so that
        # its sums' all-reduces overlap the rest of the last chunk's backward pass
        with fx_traceback.annotate({EXACT_SUM: True}):
            exponents = torch.stack([_exponent(leaves[j]) for j in group])
            exponents = exponents if agree is None else agree(exponents)
            for j, exponent in zip(group, exponents.unbind()):
                shared[j] = exponent
                sums[j] = _fixed_sum(leaves[j], exponent[0], bits)
    if summed is not None:
        sums = summed(sums)
    divisor: int | torch.Tensor = {"example": count, "sum": 1}.get(job.kind, count)
    if job.kind == "mean":
        divisor = _mean_of(sums.pop(), shared.pop(), 1, torch.float64, bits)
    out = []
    for j, (total, exponent) in enumerate(zip(sums, shared)):
        aux = 1 <= j <= job.aux_floats  # after the value: the aux's mean over chunks
        out.append(_mean_of(total, exponent, count if aux else divisor, leaves[j][0].dtype, bits))
    return out


def _exponent_groups(leaves: list[tuple[torch.Tensor, ...]]) -> list[list[int]]:
    """The leaves whose exponents one all-reduce agrees on: in reverse order (a backward pass
    produces the last parameters' gradients first), packed as gradient buckets are, a
    sixteenth of the bytes each after a smaller first group, so that a group is ready early
    and the exponents cost about sixteen small all-reduces, not one per leaf."""
    nbytes = [x[0].numel() * x[0].element_size() for x in reversed(leaves)]
    cap = max(sum(nbytes) // _EXPONENT_GROUPS, 1)
    groups = pack(nbytes, [None] * len(nbytes), cap, first_cap=max(cap // 4, 1))
    return [[len(leaves) - 1 - i for i in group] for group in groups]


def _int_maxes(chunks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(leaf_chunks).amax(0) for leaf_chunks in zip(*chunks)]


def _run(
    invariant: Invariant,
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    plain: Callable[..., Any],
) -> Any:
    """One value_and_grad call in the mode: ``((value[, aux]), grads)`` summed exactly over
    every chunk of the global batch and divided as the loss's kind says, the same on every
    replica."""
    context = _invariant_marks.active()
    assert context is not None
    job = _Job(invariant, f, argnums, has_aux, args, kwargs, plain)
    axis = named_axis(context.axis_name)
    replica_index = getattr(axis, "replica_index", None)  # fddp.vmap's axis
    if replica_index is not None:
        outs = _OverReplicas.apply(job, replica_index, *job.tensors())
        floats, ints = list(outs[: job.n_floats]), list(outs[job.n_floats :])
    else:
        floats, ints = _over_ranks(job, axis)
    out = job.result(floats, ints)
    context.mark(out)
    return out


def _count_checked(invariant: Invariant, total_chunks: int) -> None:
    if total_chunks > 2 ** (62 - invariant.fraction_bits):
        raise UsageValueError(
            f"invariant mode: {total_chunks} chunks per global batch, more than the "
            f"2**{62 - invariant.fraction_bits} that int64 sums of fraction_bits="
            f"{invariant.fraction_bits} hold. Use larger chunks or fewer fraction_bits."
        )


def _seed(job: _Job) -> torch.Tensor:
    """The step's dropout seed: one draw from the global generator, the same on every replica
    as long as their generators are (as for any randomness in a replicated step)."""
    return torch.randint(0, 2**31, (), dtype=torch.int64, device=job.device)


def _over_ranks(job: _Job, axis: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    size = axis.size()
    total = size * job.chunks
    _count_checked(job.invariant, total)
    index = axis.index() if size > 1 else torch.tensor(0)  # one rank: nothing per rank
    first = index.to(job.device) * job.chunks
    chunks = job.chunk_results(job.tensors(), first, _seed(job))
    int_max = _int_maxes([ints for _, ints in chunks])
    if size == 1:
        return _reduce(job, chunks, total), int_max

    def agree(x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "max", axis.group_name))

    floats = _reduce(job, chunks, total, agree, lambda sums: psum(sums, axis.name))
    if not int_max:
        return floats, []
    flat = agree(torch.cat([x.reshape(-1).to(torch.int64) for x in int_max]))
    return floats, _unpack_ints(flat, int_max)


def _unpack_ints(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for x in like:
        out.append(flat[at : at + x.numel()].view(x.shape).to(x.dtype))
        at += x.numel()
    return out


class _OverReplicas(torch.autograd.Function):
    """The job run once per ``fddp.vmap`` replica on its own slices, unbatched (the same
    kernels a rank runs), the chunks of all replicas reduced together."""

    @staticmethod
    def forward(job: _Job, index: torch.Tensor, *tensors: torch.Tensor) -> Any:
        raise AssertionError("_OverReplicas runs only through its vmap rule")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], job: _Job, index: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        _, index_dim, *dims = in_dims
        if index_dim is None:
            raise UsageValueError(
                "invariant mode under fddp.vmap supports one mapped level: the replica axis. "
                "Another vmap batches the step's arguments here; run it outside the step."
            )
        replicas = info.batch_size
        total = replicas * job.chunks
        _count_checked(job.invariant, total)
        seed = _seed(job)
        per_replica = []
        for r in range(replicas):
            mine = [x if d is None else x.select(d, r) for x, d in zip(tensors, dims)]
            first = torch.tensor(r * job.chunks, device=job.device)
            per_replica.append(job.chunk_results(mine, first, seed))
        chunks = [c for replica in per_replica for c in replica]
        means = _reduce(job, chunks, total)
        int_out = _int_maxes([ints for _, ints in chunks])
        job.n_floats = len(means)
        out = (*means, *int_out)
        return out, (None,) * len(out)
