"""Activation rematerialisation: regions to recompute in the backward, named values, policies."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.fx import traceback as fx_traceback

from fddp._base._annotations import REMAT_NAME, REMAT_REGION
from fddp._base._errors import UsageTypeError, UsageValueError

_F = TypeVar("_F", bound=Callable[..., Any])
_CALLS = itertools.count()  # one token per call of a region (the plan numbers regions in order)
# the thread where fddp's capture traces a repeated block once to replay it for every call
_TEMPLATE_THREAD = "fddp-block-template"


class _PerCall(Exception):
    """Raised while a repeated block is traced for replay: its replays would carry this
    call's region and names, so such a block is traced call by call instead."""


def _refuse_replay() -> None:
    if torch.compiler.is_compiling():  # a Dynamo capture, which replays no block
        return
    if threading.current_thread().name == _TEMPLATE_THREAD:
        raise _PerCall("a remat region or name inside a repeated block")


POLICY_NAMES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_only_these_names",
    "save_any_names_but_these",
    "memory_budget",
)


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a remat region keeps for the backward pass; made by ``fddp.remat_policies``.

    ``kind`` is the policy's name; ``names`` the value names of the name policies; ``fraction``
    and ``budget_bytes`` the budget of ``memory_budget``.
    """

    kind: str
    names: tuple[str, ...] = ()
    fraction: float | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POLICY_NAMES:
            raise UsageValueError(
                f"Policy({self.kind!r}): not a remat policy; use fddp.remat_policies: "
                + ", ".join(POLICY_NAMES)
                + "."
            )

    def __repr__(self) -> str:
        if self.kind in ("save_only_these_names", "save_any_names_but_these"):
            return f"{self.kind}({', '.join(map(repr, self.names))})"
        if self.kind == "memory_budget":
            what = (
                f"fraction={self.fraction!r}"
                if self.fraction is not None
                else f"bytes={self.budget_bytes!r}"
            )
            return f"memory_budget({what})"
        return self.kind


nothing_saveable = Policy("nothing_saveable")
everything_saveable = Policy("everything_saveable")
dots_saveable = Policy("dots_saveable")
dots_with_no_batch_dims_saveable = Policy("dots_with_no_batch_dims_saveable")


def save_only_these_names(*names: str) -> Policy:
    """Keep the values named (``fddp.remat_name``) with one of ``names``; recompute the rest.

    >>> import fddp
    >>> fddp.remat_policies.save_only_these_names("attn_out")
    save_only_these_names('attn_out')
    """
    return Policy("save_only_these_names", _checked_names(names, "save_only_these_names"))


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every named value except those named with one of ``names``; recompute the rest.

    >>> import fddp
    >>> fddp.remat_policies.save_any_names_but_these("mlp_hidden")
    save_any_names_but_these('mlp_hidden')
    """
    return Policy("save_any_names_but_these", _checked_names(names, "save_any_names_but_these"))


def memory_budget(fraction: float | None = None, bytes: int | None = None) -> Policy:
    """Keep what fits a budget of saved-for-backward bytes; recompute the cheapest rest.

    The budget is ``fraction`` of what the step saves for its backward without remat, or
    ``bytes``. The values recomputed are chosen by the cost model, cheapest recompute per byte
    freed first, until the step's saved bytes fit the budget.

    >>> import fddp
    >>> fddp.remat_policies.memory_budget(fraction=0.25)
    memory_budget(fraction=0.25)
    """
    if (fraction is None) == (bytes is None):
        raise UsageValueError(
            "memory_budget: pass exactly one of fraction= (of the saved-for-backward bytes "
            "without remat, in [0, 1]) or bytes= (an absolute budget)."
        )
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
        raise UsageValueError(f"memory_budget(fraction={fraction!r}): use a number in [0, 1].")
    if bytes is not None and not (isinstance(bytes, int) and bytes >= 0):
        raise UsageValueError(f"memory_budget(bytes={bytes!r}): use a non-negative int.")
    return Policy(
        "memory_budget", fraction=None if fraction is None else float(fraction), budget_bytes=bytes
    )


def _checked_names(names: tuple[Any, ...], what: str) -> tuple[str, ...]:
    if not names or not all(isinstance(n, str) for n in names):
        raise UsageTypeError(
            f"{what} takes the names as strings, e.g. {what}('attn_out'); got {names!r}."
        )
    return tuple(names)


def checked_policy(policy: Any, where: str) -> Policy | None:
    """``policy`` if it is one (or None); else the error that names the policies."""
    if policy is None or isinstance(policy, Policy):
        return policy
    factories = {save_only_these_names, save_any_names_but_these, memory_budget}
    if policy in factories:
        name = policy.__name__
        raise UsageTypeError(
            f"{where}: fddp.remat_policies.{name} makes a policy: call it, e.g. "
            f"{name}({'fraction=0.5' if name == 'memory_budget' else repr('attn_out')})."
        )
    raise UsageTypeError(
        f"{where}: {policy!r} is not a remat policy. Pass one of fddp.remat_policies: "
        + ", ".join(POLICY_NAMES)
        + " (JAX's names; the last three are called with their arguments)."
    )


def remat(fn: _F, *, policy: Policy | None = None) -> _F:
    """Mark ``fn`` as a region whose forward is recomputed in the backward pass.

    Inside a traced ``fddp.data_parallel`` step, the values the region computes that its
    backward needs are not kept from the forward pass (unless ``policy`` saves them): the
    backward recomputes them from the region's inputs, trading compute for activation memory.
    ``policy`` (``fddp.remat_policies``) says what is kept; None takes the step's
    (``data_parallel(remat=...)``), and without one, ``nothing_saveable``. Gradients are bitwise
    those without remat (random ops such as dropout replay the generator state the region used).

    Outside a traced step (``trace=False``, ``fddp.vmap``, a plain call) it just calls ``fn``:
    the same numbers, no recomputation.

    Like ``jax.checkpoint``.

    >>> import fddp, torch
    >>> layer = fddp.remat(lambda x: torch.tanh(x) * 2)
    >>> layer(torch.zeros(2))
    tensor([0., 0.])
    """
    checked = checked_policy(policy, "fddp.remat")
    if not callable(fn):
        raise UsageTypeError(f"fddp.remat wraps a function; got {type(fn).__name__}.")

    # plain values: Dynamo's capture cannot put a dataclass into a node's annotations
    fields = None if checked is None else dataclasses.astuple(checked)

    @functools.wraps(fn)
    def region(*args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate(region_annotation(fields)):
            return fn(*args, **kwargs)

    return region  # type: ignore[return-value]


def region_annotation(fields: tuple[Any, ...] | None) -> dict[str, Any]:
    """The annotation of one call of a region's nodes: a token per call and the policy's fields
    (``dataclasses.astuple`` of it, or None for the step's); refused inside a repeated block
    traced for replay."""
    _refuse_replay()
    return {REMAT_REGION: (next(_CALLS), fields)}


def remat_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``x`` for the name policies (``save_only_these_names``, ``save_any_names_but_these``).

    Returns ``x``. In a traced step the name marks the value that computed ``x``; the marker
    leaves no node in the scheduled graph. Like ``jax.ad_checkpoint.checkpoint_name``.

    >>> import fddp, torch
    >>> fddp.remat_name(torch.ones(2), "hidden")
    tensor([1., 1.])
    """
    if not isinstance(name, str):
        raise UsageTypeError(f"fddp.remat_name: the name must be a str; got {name!r}.")
    if not isinstance(x, torch.Tensor):
        raise UsageTypeError(f"fddp.remat_name names a tensor; got {type(x).__name__}.")
    if not fx_traceback.has_preserved_node_meta():  # not traced: nothing to mark
        return x
    _refuse_replay()
    with fx_traceback.annotate({REMAT_NAME: name}):
        return torch.ops.aten.alias.default(x)
