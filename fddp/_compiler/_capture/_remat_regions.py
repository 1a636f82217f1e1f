"""torch.utils.checkpoint in a captured step: a fddp.remat region, or an error that names it."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.fx import traceback as fx_traceback

from fddp._base._errors import UsageValueError
from fddp._compiler._capture import _user_frames
from fddp._func import _remat

try:  # the higher-order op Dynamo makes of a torch.utils.checkpoint call
    from torch._higher_order_ops import wrap as _hop_wrap_module

    _hop_wrap: Any = _hop_wrap_module
except ImportError:  # pragma: no cover - a torch without it
    _hop_wrap = None

# torch.utils.checkpoint's own keywords, not the function's
_TORCH_OPTIONS = frozenset(
    ("use_reentrant", "context_fn", "determinism_check", "debug", "early_stop")
) | {"preserve_rng_state"}


@contextlib.contextmanager
def intercepted() -> Iterator[None]:
    """While capturing, each ``torch.utils.checkpoint`` call is a ``fddp.remat`` region with
    the full policy (``nothing_saveable``), or raises an error naming ``fddp.remat`` when its
    ``context_fn`` asks for a selective policy fddp cannot read.

    ``checkpoint`` looks up the implementations behind it (``CheckpointFunction`` for
    ``use_reentrant=True``, ``_checkpoint_without_reentrant_generator`` otherwise) by name when
    called, and so does Dynamo's ``tag_activation_checkpoint`` when it is lowered; replacing
    those names covers ``checkpoint`` bound before fddp was imported (``from
    torch.utils.checkpoint import checkpoint``, as Hugging Face models do),
    ``checkpoint_sequential`` and ``checkpoint_wrapper``.
    """
    patches: list[tuple[Any, str, Any]] = [
        (torch_checkpoint, "CheckpointFunction", _Reentrant),
        (torch_checkpoint, "_checkpoint_without_reentrant_generator", _non_reentrant),
    ]
    if hasattr(torch_checkpoint, "_checkpoint_without_reentrant_generator_impl"):  # torch 2.15
        patches.append(
            (torch_checkpoint, "_checkpoint_without_reentrant_generator_impl", _non_reentrant_impl)
        )
    if _hop_wrap is not None and hasattr(_hop_wrap, "tag_activation_checkpoint_impl"):
        patches.append((_hop_wrap, "tag_activation_checkpoint_impl", _from_dynamo))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class _Reentrant:
    """Stands in for ``CheckpointFunction`` (``use_reentrant=True``)."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return _remat.remat(function, policy=_remat.nothing_saveable)(*args)


def _non_reentrant(
    function: Callable[..., Any],
    preserve_rng_state: bool,
    context_fn: Callable[[], Any],
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    *args: Any,
    **kwargs: Any,
) -> Iterator[None]:
    """Stands in for ``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``):
    ``checkpoint`` calls the function between its two steps, inside the region."""
    yield from _non_reentrant_impl(function, args, kwargs, context_fn=context_fn)


def _non_reentrant_impl(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    context_fn: Callable[[], Any],
    **options: Any,
) -> Iterator[None]:
    """Stands in for ``_checkpoint_without_reentrant_generator_impl``, which ``checkpoint``
    calls instead of ``_checkpoint_without_reentrant_generator`` from torch 2.15 on."""
    policy = _policy_of(context_fn, _user_frame)
    with _region(policy):
        yield


def _from_dynamo(gmod: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Stands in for ``tag_activation_checkpoint_impl``: Dynamo's graph of a
    ``torch.utils.checkpoint`` call, lowered to aten, its body a region."""
    context_fn = gmod.meta.get("_checkpoint_context_fn", torch_checkpoint.noop_context_fn)
    policy = _policy_of(context_fn, _node_frame)
    body_kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS}
    # The interpreter replaces the annotations of the moment by each body node's own
    # (fx_traceback.set_current_meta), so the region goes on the body's nodes.
    region = _remat.region_annotation(dataclasses.astuple(policy))
    nodes = list(gmod.graph.nodes)
    saved = [node.meta.get("custom") for node in nodes]
    for node in nodes:
        node.meta["custom"] = {**(node.meta.get("custom") or {}), **region}
    try:
        return torch.fx.Interpreter(gmod).run(*args, **body_kwargs)
    finally:
        for node, custom in zip(nodes, saved):
            if custom is None:
                node.meta.pop("custom", None)
            else:
                node.meta["custom"] = custom


@contextlib.contextmanager
def _region(policy: _remat.Policy) -> Iterator[None]:
    """What ``fddp.remat(fn, policy=policy)`` puts around ``fn``."""
    with fx_traceback.annotate(_remat.region_annotation(dataclasses.astuple(policy))):
        yield


def _policy_of(
    context_fn: Callable[[], Any], where: Callable[[], traceback.FrameSummary | None]
) -> _remat.Policy:
    """The policy ``context_fn`` asks for: ``nothing_saveable`` for torch's default, none
    otherwise (an error): a selective context is code fddp cannot read."""
    if context_fn is torch_checkpoint.noop_context_fn:
        return _remat.nothing_saveable
    raise UsageValueError(
        "torch.utils.checkpoint with a context_fn (selective activation checkpointing) inside "
        f"a fddp.data_parallel step{_user_frames.where(where())}\nfddp recomputes such "
        "regions itself and cannot read which values that context saves. Write the region as "
        "fddp.remat(fn, policy=...) with a policy of fddp.remat_policies (dots_saveable, "
        "save_only_these_names(...), memory_budget(...)), or pass data_parallel(step, "
        "remat=policy) for the model's repeated blocks; trace=False runs torch.utils.checkpoint "
        "eagerly."
    )


def _node_frame() -> traceback.FrameSummary | None:
    """The user frame of the Dynamo graph node being lowered, from its recorded stack."""
    text = fx_traceback.get_current_meta().get("stack_trace") or ""
    found = re.finditer(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', text)
    return _user_frames.user_frame(
        [
            traceback.FrameSummary(m.group(1), int(m.group(2)), m.group(3), line=m.group(4))
            for m in found
        ]
    )


def _user_frame() -> traceback.FrameSummary | None:
    return _user_frames.user_frame(traceback.extract_stack())
