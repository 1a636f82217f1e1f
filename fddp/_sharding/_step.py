"""A step on sharded parameters: gathered into the full tree inside, cut back into shards out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fddp._base._errors import UsageValueError
from fddp._sharding import _gathered
from fddp._sharding._full import full_params, full_state_dict
from fddp._sharding._gather import skeleton, unpacked
from fddp._sharding._layout import own_shard
from fddp._sharding._params import Layout, ShardedParams, check_group, check_replicas
from fddp._sharding._state import check_state_group
from fddp._sharding._trees import sharded_positions, states

# The functions that take sharded parameters themselves: fddp.vmap does not gather for them.
TAKES_SHARDS = frozenset({full_params, full_state_dict})


def gathering(
    step_fn: Callable[..., Any], args: tuple, where: str, one_at_a_time: bool = False
) -> Any:
    """``step_fn`` as a step on ``args``' sharded parameters: each :class:`ShardedParams`
    argument gathered into its full tree over the axis it is sharded over, the output in its
    position cut back into shards (``step_fn`` itself where no argument is sharded). Sharded
    parameters and ``shard_state`` states bound to another group than they were cut over are
    refused first, before any capture.

    Inside, the compiler (``_compiler._passes._param_gathers``) places each gather just ahead of the
    parameters' first use and gathers again where they are used after other buckets (the
    backward pass). Where the output is ``apply_updates(params, updates)`` of ``shard_state``
    updates, each shard is this replica's parameter shard plus its update shard, and the
    updates are never gathered (``fddp._sharding._gathered`` recognises that case).

    ``one_at_a_time``: the step runs as fddp schedules it, whose parameter gathers never
    overlap (``_compiler._passes._param_gathers``), so they may use gloo's own all-gather. Not under
    Inductor, which moves waits and would let two run at once: that corrupts gloo's heap."""
    for state in states(args):  # before tracing, on every capture path
        check_state_group(state, f"{where}, shard_state's state")
    positions = sharded_positions(args)
    if not positions:
        return step_fn
    layouts = {n: args[n].layout for n in positions}
    skeletons = {n: skeleton(layout) for n, layout in layouts.items()}
    for n in positions:  # before tracing: every rank raises it alike
        check_replicas(args[n], layouts[n].axis_name, f"{where}, argument {n}")
        check_group(layouts[n], layouts[n].axis_name, f"{where}, argument {n}")

    def sharded_step(*call_args: Any) -> Any:
        with _gathered.recording():
            full = list(call_args)
            for n in positions:
                full[n] = unpacked(
                    call_args[n], layouts[n].axis_name, str(n), skeletons[n], one_at_a_time
                )
            out = step_fn(*full)
            single = not isinstance(out, tuple)
            outs = [out] if single else list(out)
            for n in positions:
                if n >= len(outs):
                    raise UsageValueError(
                        f"{where} takes sharded parameters as argument {n}, so the step must "
                        f"return the new parameters at position {n}; it returned "
                        f"{len(outs)} value{'s' * (len(outs) != 1)}."
                    )
                outs[n] = _resharded(outs[n], layouts[n], skeletons[n], where)
            if single:
                return outs[0]
            return tuple(outs) if type(out) is tuple else type(out)(*outs)

    return sharded_step


def _resharded(tree: Any, layout: Layout, indices: Any, where: str) -> ShardedParams:
    leaves, spec = optree.tree_flatten(tree)
    if spec != optree.tree_structure(indices) or any(
        not isinstance(x, torch.Tensor) or tuple(x.shape) != s or x.dtype != d
        for x, s, d in zip(leaves, layout.shapes, layout.dtypes)
    ):
        raise UsageValueError(
            f"{where} takes sharded parameters, so the step's output in the same position must "
            "be the new parameters, with the same tree, shapes and dtypes (they are cut back "
            f"into shards); it returned {_short(tree)}. Return the parameters at the position "
            "of the argument they came in, or pass the full tree (not fddp.shard_params)."
        )
    shards = []
    for b, bucket in enumerate(layout.buckets):
        members = [leaves[i] for i in bucket.leaves]
        piece = _gathered.bucket_of(members, "params")
        if piece is not None and piece.layout is layout and piece.bucket == b:
            shards.append(piece.shard)
        else:
            shards.append(own_shard(leaves, bucket, layout.replicas, layout.axis_name))
    return ShardedParams(tuple(shards), layout)


def _short(tree: Any) -> str:
    leaves, spec = optree.tree_flatten(tree)
    return f"a tree of {len(leaves)} leaves {spec}"
