"""The foreach kernels the transformations run on, and per-leaf ops under torch.func transforms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fddp._base._types import Params, TensorTree


def flatten(tree: TensorTree) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    return optree.tree_flatten(tree, none_is_leaf=False)


def params_like(params: Params | None, spec: optree.PyTreeSpec, who: str) -> list[torch.Tensor]:
    if params is None:
        raise ValueError(f"{who} needs the parameters: call update(updates, state, params).")
    leaves, params_spec = flatten(params)
    if params_spec != spec:
        raise ValueError(
            f"{who}: params and updates have different tree structures ({params_spec} vs {spec}); "
            "pass params with the same structure as the gradients."
        )
    return leaves


# The foreach kernels have no vmap batching rules, so leaves wrapped by a torch.func transform
# (vmap, grad, jvp) take the per-leaf op instead; plain and traced leaves keep the foreach kernel.
_PER_LEAF: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    torch._foreach_add: torch.add,
    torch._foreach_addcmul: torch.addcmul,
    torch._foreach_div: torch.div,
    torch._foreach_lerp: torch.lerp,
    torch._foreach_mul: torch.mul,
    torch._foreach_norm: torch.linalg.vector_norm,
    torch._foreach_sqrt: torch.sqrt,
}


def _transformed(args: tuple[Any, ...]) -> bool:
    """Whether a tensor in ``args`` (or in a list there) is wrapped by a ``torch.func`` transform.

    Dynamo traces only the batched-tensor test, so under ``torch.compile`` that is the test.
    """
    if torch.compiler.is_compiling():
        wrapped = torch._C._functorch.is_batchedtensor
    elif torch._C._functorch.peek_interpreter_stack() is None:
        return False
    else:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for arg in args:
        for x in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(x, torch.Tensor) and wrapped(x):
                return True
    return False


def foreach(op: Callable[..., Any], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``op(*args, **kwargs)`` for a ``torch._foreach_*`` op, or its per-leaf op under a transform.

    List (or tuple) arguments are taken leaf by leaf; others are passed to every leaf's op.
    """
    if not _transformed(args):
        return op(*args, **kwargs)
    per_leaf = _PER_LEAF[op]
    lists = [isinstance(a, (list, tuple)) for a in args]
    n = len(args[lists.index(True)])
    return [
        per_leaf(*(a[i] if is_list else a for a, is_list in zip(args, lists)), **kwargs)
        for i in range(n)
    ]


def with_scalar(
    op: Callable[..., Any], leaves: list[torch.Tensor], scalar: Any
) -> list[torch.Tensor]:
    """``op(leaves, scalar)``, where a tensor scalar acts as a Python float would.

    A Python float scalar is used at the precision the kernel computes in (float32 for 16-bit
    leaves) and never changes the result's dtype; a 0-d tensor scalar is cast to match that,
    one dtype and device group at a time, and 0-d leaves, which would promote, are cast back.
    """
    if not isinstance(scalar, torch.Tensor):
        return foreach(op, leaves, scalar)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.device, leaf.dtype), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for (device, dtype), index in groups.items():
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        group, factor = [leaves[i] for i in index], scalar.to(device, compute)
        if _transformed((group, factor)):
            # a batched scalar is no longer a scalar to the kernel: compute in its dtype here
            results = [_PER_LEAF[op](x.to(compute), factor).to(dtype) for x in group]
        else:
            results = op(group, factor)
            if compute != dtype:
                results = [r.to(dtype) for r in results]
        for i, r in zip(index, results, strict=True):
            out[i] = r
    return out


def zero_count(leaves: list[torch.Tensor]) -> torch.Tensor:
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)
