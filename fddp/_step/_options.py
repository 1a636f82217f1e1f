"""A step's options: one frozen value, checked where it is made, described for ranks to compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from fddp._base._axes import DEFAULT_AXIS
from fddp._base._names import qualified_name
from fddp._collectives._bucket_policy import MIB, CapPolicy
from fddp._compiler._backend import BACKENDS
from fddp._compiler._options import CompileOptions
from fddp._func import _invariant
from fddp._func._invariant import Invariant
from fddp._func._remat import Policy, checked_policy
from fddp._ranks import _mesh, _runtime
from fddp._ranks._agree import Line
from fddp._ranks._described import describe

_TEXT = "text"  # field metadata: the function that writes the field's value as one line
_LABEL = "label"  # field metadata: the field's label where it is not "<LABEL> <name>"
_NESTED = "nested"  # field metadata: a frozen part, described field by field
_COMPARED = "compared"  # field metadata: False for a field the ranks do not compare


def as_line(text: Callable[[Any], str] = repr, label: str | None = None) -> dict[str, Any]:
    """Field metadata: the field is described as one line, ``text(value)`` (without it, as the
    lines :func:`fddp._ranks._described.describe` writes: every value it holds)."""
    return {_TEXT: text, _LABEL: label}


def by_name(label: str) -> dict[str, Any]:
    """Field metadata: a function described by its qualified name alone (what it closes over
    may legitimately differ per rank, such as a data loader)."""
    return as_line(qualified_name, label)


NESTED = {_NESTED: True}
NOT_COMPARED = {_COMPARED: False}


def option_lines(options: Any) -> list[Line]:
    """The fields of ``options`` (a frozen dataclass with a ``LABEL``) as labelled lines, in
    field order: ``"<LABEL> <name>"`` (or the label its metadata gives) and the value's text; a
    nested part's own lines in its place; fields marked :data:`NOT_COMPARED` left out."""
    lines: list[Line] = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if not field.metadata.get(_COMPARED, True):
            continue
        if field.metadata.get(_NESTED):
            lines += [] if value is None else option_lines(value)
            continue
        label = field.metadata.get(_LABEL) or f"{options.LABEL} {field.name}"
        text = field.metadata.get(_TEXT)
        lines += [(label, text(value))] if text else describe(value, label)
    return lines


def backend(compile: bool | str) -> str:
    """``compile=`` decoded: ``"fx"`` (False, or ``"fx"``) or ``"inductor"`` (True)."""
    chosen = "inductor" if compile is True else "fx" if compile is False else compile
    if chosen not in BACKENDS:
        raise ValueError(
            f"compile={compile!r}: use False (run the scheduled FX graph) or True (compile it "
            "with Inductor; 'inductor' and 'fx' name the two as well)."
        )
    return chosen


def argnums(given: int | Sequence[int]) -> tuple[int, ...]:
    """``donate_argnums=`` as a tuple."""
    return (given,) if isinstance(given, int) else tuple(given)


def replicated(check_replicas: bool | Sequence[int]) -> tuple[int, ...]:
    """``check_replicas=`` as the argument positions it names (True: the parameters, 0)."""
    return (0,) if check_replicas is True else tuple(check_replicas or ())


def _axis_sizes(axes: Mapping[str, dist.ProcessGroup]) -> str:
    return repr({name: dist.get_world_size(group) for name, group in axes.items()})


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a data-parallel step is built: ``fddp.data_parallel``'s options in the form they
    are used (``compile`` as the backend's name, argument positions as tuples), and the options
    of a transform built on it (``transform``). Every field but ``group`` enters the agreement
    on every call (:meth:`lines`).

    Checked when made: ``data_parallel`` makes one, a transform derives its own with
    ``dataclasses.replace``. With ``axes``, making one is a collective over ``group``.
    """

    LABEL: ClassVar[str] = "option"

    transform: Any = dataclasses.field(default=None, metadata=NESTED)  # a frozen part, or None
    axis_name: str = DEFAULT_AXIS
    bucket_cap_mb: float | None = dataclasses.field(default=None, metadata=as_line())
    first_bucket_cap_mb: float = dataclasses.field(default=1.0, metadata=as_line())
    compile: str = "fx"  # one of BACKENDS (see backend())
    donate_argnums: tuple[int, ...] = dataclasses.field(default=(), metadata=as_line())
    comm_dtype: torch.dtype | None = None
    # the agreement runs over it: a rank in another group would not take part
    group: dist.ProcessGroup | None = dataclasses.field(default=None, metadata=NOT_COMPARED)
    axes: Mapping[str, dist.ProcessGroup] = dataclasses.field(
        default_factory=dict, metadata=as_line(_axis_sizes)
    )
    trace: bool = True
    check_replicas: tuple[int, ...] = dataclasses.field(default=(0,), metadata=as_line())
    cache_size: int = 16
    overlap_steps: bool = False
    remat: Policy | None = dataclasses.field(default=None, metadata=as_line())
    invariant: Invariant | None = dataclasses.field(default=None, metadata=as_line())

    def __post_init__(self) -> None:
        if (
            self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0
        ) or self.first_bucket_cap_mb <= 0:
            raise ValueError("bucket_cap_mb and first_bucket_cap_mb must be positive (MiB).")
        if self.cache_size < 1:
            raise ValueError(f"cache_size={self.cache_size}: keep at least one compiled program.")
        assert self.compile in BACKENDS, self.compile  # made by backend(compile)
        if self.overlap_steps and self.compile != "fx":
            raise ValueError(
                "overlap_steps runs the scheduled graph without Inductor: use compile=False."
            )
        checked_policy(self.remat, "data_parallel(remat=...)")
        _check_axes(self.axes, self.axis_name, self.group)
        if self.invariant is not None:
            _invariant.checked(self.invariant)
            if self.comm_dtype is not None:
                raise ValueError(
                    "invariant mode reduces gradients as exact int64 sums; comm_dtype would cast "
                    "them. Use one or the other."
                )
            _invariant.check_backend(self.compile)

    def lines(self) -> list[Line]:
        """The options as the labelled lines the ranks compare on every call: a transform's
        first, then ``option <name>`` for each of data_parallel's."""
        return option_lines(self)

    @property
    def for_compiler(self) -> CompileOptions:
        """The part the compiler reads: the caps in bytes, the wire dtype, backend, overlap,
        remat."""
        fixed = None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * MIB)
        cap = CapPolicy(fixed=fixed, first=int(self.first_bucket_cap_mb * MIB))
        return CompileOptions(cap, self.comm_dtype, self.compile, self.overlap_steps, self.remat)


def _check_axes(
    axes: Mapping[str, dist.ProcessGroup], axis_name: str, group: dist.ProcessGroup | None
) -> None:
    """``data_parallel``'s ``axes``, each a process group of ranks of ``group`` (a collective
    where there are any: every rank's groups, one verdict everywhere)."""
    if not axes:
        return
    _runtime.ensure_group()
    _mesh.check_axes(axes, group)
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
