"""Record ops whose output layout is known without running them straight into make_fx's graph."""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.proxy import _COPY_META_FIELDS
from torch.utils._python_dispatch import TorchDispatchMode

from fddp._compiler._capture._opcode_trace import Unfollowed

try:  # make_fx's and FakeTensorMode's internals: without them every op takes make_fx's path
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    from torch.fx.experimental.proxy_tensor import _ProxyTensor, get_proxy_mode, set_proxy_slot

    _AVAILABLE = True
except ImportError:  # pragma: no cover - a torch that moved them
    _AVAILABLE = False

_LIKE_INPUT = "like input"  # same shape, strides and dtype as the (contiguous) tensor arguments
_CONTIGUOUS = "contiguous"  # same shape and dtype, contiguous
_SCALAR = "0-d"  # a 0-d tensor of the input's dtype
_VIEW = "view"  # a view of the first argument, as the op's meta kernel lays it out


def _overloads(namespace: Any, names: Iterable[str], layout: str) -> dict[Any, str]:
    rules = {}
    for name in names:
        packet = getattr(namespace, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if not op._schema.is_mutable:
                rules[op] = layout
    return rules


_FOREACH = (
    "_foreach_add",
    "_foreach_sub",
    "_foreach_mul",
    "_foreach_div",
    "_foreach_lerp",
    "_foreach_addcmul",
    "_foreach_addcdiv",
    "_foreach_sqrt",
    "_foreach_neg",
    "_foreach_maximum",
    "_foreach_minimum",
)
_POINTWISE = ("add", "sub", "mul", "div", "neg", "sqrt", "lerp", "addcmul", "addcdiv")
_RULES: dict[Any, str] = {
    **_overloads(torch.ops.aten, _FOREACH, _LIKE_INPUT),
    **_overloads(torch.ops.aten, ("_foreach_norm",), _SCALAR),
    **{
        op: layout
        for op, layout in _overloads(torch.ops.aten, _POINTWISE, _LIKE_INPUT).items()
        if op._overloadname in ("Tensor", "Scalar", "default")
    },
    **{
        getattr(torch.ops.aten, name).default: _VIEW
        for name in ("t", "view", "permute", "unsqueeze", "expand", "alias")
    },
    torch.ops.aten.transpose.int: _VIEW,
    torch.ops.aten.slice.Tensor: _VIEW,
    torch.ops.aten.select.int: _VIEW,
    torch.ops.aten.squeeze.dim: _VIEW,
    torch.ops.aten.as_strided.default: _VIEW,
    torch.ops.aten.split_with_sizes.default: _VIEW,
    torch.ops._c10d_functional.all_reduce.default: _CONTIGUOUS,
    torch.ops._c10d_functional.wait_tensor.default: _LIKE_INPUT,
}
# the namespaces of torch's own ops, whose kernels (fake, meta) run none of the step's Python
_TORCH_OPS = frozenset({"aten", "prims", "_c10d_functional", "_c10d_functional_autograd"})
# arguments that are not tensors but keep these ops' results laid out like their inputs
_QUIET_KWARGS = {"alpha", "value", "weight", "ord", "dtype"}


class QuickRecord(TorchDispatchMode):
    """Within the block (inside make_fx's trace), the ops in ``_RULES`` are recorded directly
    where their arguments allow it; every other call goes on to make_fx as it is."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if getattr(func, "namespace", None) not in _TORCH_OPS:  # a custom op: its Python is yours
            return self._dispatch(func, args, kwargs or {})
        with Unfollowed():  # torch's own op runs none of the step's Python
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        layout = _RULES.get(func)
        if layout is not None and _AVAILABLE:
            out = _record(func, layout, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _columns(func: Any, args: tuple, kwargs: dict) -> list[list[torch.Tensor]] | None:
    """The tensor arguments of each result (one column per element of a foreach op), or None
    when an argument is not one the rules cover."""
    foreach = func.__name__.startswith("_foreach_")
    lists: list[list[torch.Tensor]] = []
    scalars: list[torch.Tensor] = []
    for name, arg in [*enumerate(args), *kwargs.items()]:
        if isinstance(arg, torch.Tensor) and foreach:
            scalars.append(arg)  # the 0-d scalar of a Tensor overload
        elif isinstance(arg, torch.Tensor):
            lists.append([arg])
        elif isinstance(arg, (list, tuple)) and foreach and arg:
            if all(isinstance(x, torch.Tensor) for x in arg):
                lists.append(list(arg))
            elif not all(type(x) in (int, float, bool) for x in arg):
                return None
        elif isinstance(arg, str) and not foreach:
            continue  # an all-reduce's operator and group name
        elif type(arg) not in (int, float, bool) and not (arg is None and name in _QUIET_KWARGS):
            return None
    if not lists or any(len(column) != len(lists[0]) for column in lists):
        return None
    columns = [list(column) for column in zip(*lists)]
    for column in columns:
        column.extend(scalars)
    return columns


def _plain(x: torch.Tensor, first: torch.Tensor) -> bool:
    """``x`` is a fake tensor itself (no subclass, no wrapper) of ``first``'s mode and device."""
    return (
        type(x) is FakeTensor
        and isinstance(first, FakeTensor)
        and x.fake_mode is first.fake_mode
        and x.device == first.device
    )


def _laid_out_alike(column: list[torch.Tensor], layout: str) -> bool:
    first = column[0]
    if not (
        _plain(first, first)
        and first.is_floating_point()
        and all(type(s) is int for s in (*first.shape, *first.stride()))
        and first.is_contiguous()
    ):
        return False
    for x in column[1:]:
        if not (_plain(x, first) and x.dtype == first.dtype):
            return False
        same = x.shape == first.shape and x.stride() == first.stride()
        # a trailing 0-d scalar (a foreach Tensor overload's) broadcasts without changing layout
        if not (same or (x.dim() == 0 and x is column[-1])):
            return False
    return True


def _fresh(first: torch.Tensor, layout: str) -> torch.Tensor:
    """The meta tensor of a fresh result laid out by ``layout`` from ``first``."""
    if layout == _SCALAR:
        return torch.empty((), dtype=first.dtype, device="meta")
    if layout == _CONTIGUOUS:
        return torch.empty(first.shape, dtype=first.dtype, device="meta")
    return torch.empty_strided(first.shape, first.stride(), dtype=first.dtype, device="meta")


def _faked(meta: torch.Tensor, like: torch.Tensor) -> tuple[FakeTensor, FakeTensor]:
    """The result as a fake tensor on ``like``'s device, and the snapshot make_fx keeps as its
    value (the same storage and layout, another tensor). Called with Python dispatch off: the
    snapshot is a view of a plain meta tensor, which no mode may see."""
    fake_mode = like.fake_mode  # type: ignore[attr-defined]
    snapshot = meta.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    return FakeTensor(fake_mode, meta, like.device), FakeTensor(fake_mode, snapshot, like.device)


def _plain_arguments(values: Iterable[Any]) -> bool:
    """Sizes, dims and flags only: the arguments of a view besides its input."""
    for v in values:
        items = v if isinstance(v, (list, tuple)) else (v,)
        if not all(x is None or type(x) in (int, bool) for x in items):
            return False
    return True


def _view_metas(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The meta tensors of view ``func``'s results on its input's own storage, as
    FakeTensorMode computes them (the op's meta kernel); None unless ``func`` is a view in
    ``_RULES`` and its input a plain fake tensor of static size."""
    x = args[0] if args else None
    if not (
        _AVAILABLE
        and _RULES.get(func) == _VIEW
        and isinstance(x, torch.Tensor)
        and _plain(x, x)
        and x.constant is None  # type: ignore[attr-defined]
        and all(type(s) is int for s in x.shape)
        and _plain_arguments([*args[1:], *kwargs.values()])
    ):
        return None
    return kernel_results(func, args, kwargs, x.fake_mode)  # type: ignore[attr-defined]


def kernel_results(func: Any, args: tuple, kwargs: dict, fake_mode: Any) -> list[torch.Tensor]:
    """The meta tensors ``func``'s meta kernel makes of fake arguments (a view's share its
    input's storage), as FakeTensorMode runs it."""
    with in_kernel_invocation_manager(fake_mode):
        out = func(*args, **kwargs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def view_value(func: Any, args: tuple, kwargs: dict) -> Any:
    """The fake value of view ``func(*args, **kwargs)`` (a list for a split), computed as
    :class:`QuickRecord` computes it, or None where it does not apply."""
    metas = _view_metas(func, args, kwargs)
    if metas is None:
        return None
    with torch._C._DisableTorchDispatch():
        values = [FakeTensor(args[0].fake_mode, m, args[0].device) for m in metas]
    return values if func is torch.ops.aten.split_with_sizes.default else values[0]


def _results(
    func: Any, layout: str, args: tuple, kwargs: dict
) -> list[tuple[FakeTensor, FakeTensor]] | None:
    """Each result and its snapshot, or None when make_fx must record the call itself."""
    if layout == _VIEW:
        metas = _view_metas(func, args, kwargs)
        if metas is None:
            return None
        with torch._C._DisableTorchDispatch():
            return [_faked(meta, args[0]) for meta in metas]
    columns = _columns(func, args, kwargs)
    if columns is None or not all(_laid_out_alike(column, layout) for column in columns):
        return None
    with torch._C._DisableTorchDispatch():
        return [_faked(_fresh(column[0], layout), column[0]) for column in columns]


def _returns_list(func: Any) -> bool:
    return func.__name__.startswith("_foreach_") or func is torch.ops.aten.split_with_sizes.default


def shared_meta() -> dict[str, Any]:
    """The annotations make_fx copies onto each node it records now (``custom``, the module
    stack): what a node written directly into its graph carries too."""
    if not fx_traceback.has_preserved_node_meta():
        return {}
    current = fx_traceback.get_current_meta()
    return {k: copy.copy(current[k]) for k in _COPY_META_FIELDS if current.get(k) is not None}


def _record(func: Any, layout: str, args: tuple, kwargs: dict) -> Any:
    proxy_mode = get_proxy_mode()
    if proxy_mode is None:
        return None
    tracer = proxy_mode.tracer
    tracked = tracer.tensor_tracker

    def proxy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found = tracked.get(x)
            if found is None or found.constant is not None:
                raise LookupError
            return found.proxy.node
        if isinstance(x, (list, tuple)):
            return type(x)(proxy(y) for y in x)
        return x

    try:
        node_args = proxy(args)
        node_kwargs = {k: proxy(v) for k, v in kwargs.items()}
    except LookupError:  # a tensor make_fx does not track, or one it folds as a constant
        return None
    results = _results(func, layout, args, kwargs)
    if results is None:
        return None
    shared = shared_meta()
    node = tracer.graph.create_node(
        "call_function", func, node_args, node_kwargs, name=func.overloadpacket.__name__
    )
    node.meta.update(shared)
    if not _returns_list(func):
        out, node.meta["val"] = results[0]
        set_proxy_slot(out, tracer, _ProxyTensor(fx.Proxy(node, tracer), None))
        return out
    outs = []
    for i, (out, snapshot) in enumerate(results):
        item = tracer.graph.create_node("call_function", operator.getitem, (node, i), {})
        item.meta.update(shared)
        item.meta["val"] = snapshot
        set_proxy_slot(out, tracer, _ProxyTensor(fx.Proxy(item, tracer), None))
        outs.append(out)
    node.meta["val"] = [snapshot for _, snapshot in results]
    return outs
