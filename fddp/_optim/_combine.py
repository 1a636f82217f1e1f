"""Combining transformations: one after the other (chain), or on some leaves only (masked)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import optree

from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._base._types import GradientTransformation, OptState, Params, TensorTree, Updates
from fddp._optim._kernels import flatten, params_like
from fddp._sharding._shard_axes import call_update, takes_shard_axes


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies transformations one after the other; the state is the tuple of their states.

    Example:
        >>> import torch
        >>> from fddp.optim import chain, clip_by_global_norm, scale
        >>> opt = chain(clip_by_global_norm(1.0), scale(-0.1))
        >>> opt.update([torch.tensor([3.0, 4.0])], opt.init(None))[0]
        [tensor([-0.0600, -0.0800])]
    """
    for t in transforms:
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise TypeError(
                f"chain() takes GradientTransformations, got {type(t).__name__}; "
                "call the factory, e.g. chain(clip_by_global_norm(1.0), sgd(0.1))."
            )

    takes = [takes_shard_axes(t) for t in transforms]

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state of {len(state)}; "
                "pass the state returned by this chain's init or update."
            )
        new_state = []
        for t, t_takes, s in zip(transforms, takes, state, strict=True):
            updates, s = call_update(t, t_takes, updates, s, params, shard_axes)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


class MaskedState(NamedTuple):
    """The state of :func:`masked`: ``inner``'s state over the masked-in leaves (a list)."""

    inner_state: OptState


_SHARDED_MASK_FIX = (
    "inside fddp.optim.shard_state the parameters are flat shards of many leaves, which a mask "
    "by leaf cannot select: mask outside the sharded part instead, e.g. for a masked AdamW "
    "chain(shard_state(scale_by_adam()), masked(add_decayed_weights(wd), mask), "
    "scale_by_learning_rate(lr))"
)


def _mask_leaves(mask: Any, tree: TensorTree, spec: optree.PyTreeSpec, who: str) -> list[bool]:
    """The mask's bools, one per leaf of ``tree`` (whose structure is ``spec``)."""
    mask_tree = mask(tree) if callable(mask) else mask
    flags, mask_spec = optree.tree_flatten(mask_tree, none_is_leaf=False)
    if mask_spec != spec:
        raise UsageValueError(
            f"{who}: the mask's tree structure {mask_spec} is not the parameters' {spec}; pass "
            "a pytree of bools with the parameters' structure, or a function params -> that "
            f"pytree ({_SHARDED_MASK_FIX})."
        )
    if not all(isinstance(f, bool) for f in flags):
        bad = next(type(f).__name__ for f in flags if not isinstance(f, bool))
        raise UsageTypeError(
            f"{who}: mask leaves must be Python bools (the selection is fixed when the step is "
            f"traced); got a {bad}. Build the mask from names or shapes, e.g. "
            "{name: p.ndim > 1 for name, p in params.items()}."
        )
    return flags


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Applies ``inner`` to the masked-in leaves only; the others' updates pass through unchanged.

    As optax's ``masked``: ``inner`` sees (and its state holds) only the leaves whose mask is
    True, as a list in the parameters' leaf order. The usual use is a weight decay that skips
    biases and norm weights (``adamw(..., mask=...)``).

    Inside ``fddp.optim.shard_state`` the parameters ``inner`` sees are flat shards of many
    leaves, so a mask by leaf cannot apply there: ``update`` raises. Keep the mask outside
    the sharded part: ``chain(shard_state(scale_by_adam()), masked(add_decayed_weights(wd),
    mask), scale_by_learning_rate(lr))`` is a sharded masked AdamW (the decay and the learning
    rate keep no per-parameter state).

    Args:
        inner: the transformation for the masked-in leaves.
        mask: a pytree of Python bools with the parameters' structure, or a function
            ``params -> that pytree`` (called with the params in ``init`` and in ``update``,
            with the updates where no params are given).

    Returns:
        A ``GradientTransformation`` whose state is a :class:`MaskedState`.

    Example:
        >>> import torch
        >>> from fddp.optim import masked, scale
        >>> opt = masked(scale(-1.0), {"w": True, "b": False})
        >>> params = {"w": torch.tensor(1.0), "b": torch.tensor(1.0)}
        >>> opt.update({"w": torch.tensor(2.0), "b": torch.tensor(2.0)}, opt.init(params))[0]
        {'w': tensor(-2.), 'b': tensor(2.)}
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise UsageTypeError(
            f"masked() takes a GradientTransformation, got {type(inner).__name__}; "
            "call the factory, e.g. masked(add_decayed_weights(0.01), mask)."
        )
    takes = takes_shard_axes(inner)

    def init(params: Params) -> MaskedState:
        leaves, spec = flatten(params)
        flags = _mask_leaves(mask, params, spec, "masked")
        return MaskedState(inner.init([x for x, f in zip(leaves, flags, strict=True) if f]))

    def update(
        updates: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        shard_axes: Sequence[str] = (),
    ) -> tuple[Updates, OptState]:
        if shard_axes:
            raise UsageValueError(f"masked: {_SHARDED_MASK_FIX}.")
        leaves, spec = flatten(updates)
        flags = _mask_leaves(mask, updates if params is None else params, spec, "masked")
        chosen = [i for i, f in enumerate(flags) if f]
        inner_params = None
        if params is not None:
            param_leaves = params_like(params, spec, "masked")
            inner_params = [param_leaves[i] for i in chosen]
        inner_updates, inner_state = call_update(
            inner, takes, [leaves[i] for i in chosen], state.inner_state, inner_params, ()
        )
        out = list(leaves)
        for i, u in zip(chosen, flatten(inner_updates)[0], strict=True):
            out[i] = u
        return optree.tree_unflatten(spec, out), MaskedState(inner_state)

    return GradientTransformation(init, update)
