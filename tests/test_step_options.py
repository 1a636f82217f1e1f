"""Every option of a data-parallel step enters the per-call agreement: a rank built with another
value of any field of ``StepOptions`` (a transform's own options included) is refused on every
rank, naming the option, before the step runs. The table of values covers every field, so a
field added later fails here until it is given one. 2 gloo ranks, one spawn."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from _dist import raised, run_checks

import fddp
from fddp._step._data_parallel import DataParallelStep
from fddp._step._options import StepOptions

# the agreement runs over the step's group: a rank in another group would not take part in it
NOT_COMPARED = {"group"}


@dataclasses.dataclass(frozen=True)
class _Part:
    """A transform's own options, as local_sgd, diloco and recoverable add theirs."""

    LABEL: ClassVar[str] = "part"

    size: int


# field -> (rank 0's value, rank 1's value, what the error names); "axes" holds groups, made on
# the ranks (``_axes``); meshes whose names differ are refused as the step is built
OTHER = {
    "transform": (_Part(1), _Part(2), "ranks built the step differently: part size is 2"),
    "axis_name": ("data", "replica", "ranks built the step differently: option axis_name"),
    "bucket_cap_mb": (None, 5.0, "ranks built the step differently: option bucket_cap_mb"),
    "first_bucket_cap_mb": (1.0, 2.0, "built the step differently: option first_bucket_cap_mb"),
    "compile": ("fx", "inductor", "ranks built the step differently: option compile"),
    "donate_argnums": ((), (0,), "ranks built the step differently: option donate_argnums"),
    "comm_dtype": (None, torch.bfloat16, "ranks built the step differently: option comm_dtype"),
    "axes": ("pair", "twin", "names the axes [\"axes['twin']\"], but rank 0 names"),
    "trace": (True, False, "ranks built the step differently: option trace"),
    "check_replicas": ((0,), (), "ranks built the step differently: option check_replicas"),
    "cache_size": (16, 3, "ranks built the step differently: option cache_size"),
    "overlap_steps": (False, True, "ranks built the step differently: option overlap_steps"),
    "remat": (
        None,
        fddp.remat_policies.nothing_saveable,
        "ranks built the step differently: option remat",
    ),
    "invariant": (None, fddp.Invariant(2), "ranks built the step differently: option invariant"),
}


def _step(w, x):
    g = fddp.grad(lambda w: ((x @ w) ** 2).mean())(w)
    return w - 0.1 * fddp.pmean(g)


def _axes(name: str) -> dict[str, dist.ProcessGroup]:
    return {name: dist.new_group(list(range(dist.get_world_size())))}


def check_option_differs(field: str) -> tuple[str, str]:
    value = OTHER[field][fddp.rank()]
    if field == "axes":
        return raised(lambda: StepOptions(axes=_axes(value)))
    pstep = DataParallelStep(_step, StepOptions(**{field: value}))
    return raised(lambda: pstep(torch.ones(2), torch.ones(4, 2)))


CHECKS = {field: functools.partial(check_option_differs, field) for field in OTHER}


@pytest.fixture(scope="module")
def runs():
    return run_checks(CHECKS, timeout=240)


def test_every_field_of_the_options_is_in_the_table():
    fields = {f.name for f in dataclasses.fields(StepOptions)}
    assert set(OTHER) == fields - NOT_COMPARED


@pytest.mark.parametrize("field", sorted(set(OTHER) - {"axes"}))
def test_another_value_of_a_field_changes_the_lines_labelled_with_it(field):
    ours, theirs = (StepOptions(**{field: value}).lines() for value in OTHER[field][:2])
    differing = {label for (label, a), (_, b) in zip(ours, theirs, strict=True) if a != b}
    label = "part size" if field == "transform" else f"option {field}"
    assert differing == {label}


@pytest.mark.parametrize("field", sorted(OTHER))
def test_a_rank_built_with_another_value_of_any_option_is_refused_naming_it(runs, field):
    for error, message in runs[field]:
        assert error == "ScheduleMismatchError", message
        assert OTHER[field][2] in message, message
