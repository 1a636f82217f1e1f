"""A compiled program as plain data, and back: what the persistent program cache writes."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import marshal
import operator
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fddp._compiler import _backend
from fddp._compiler._capture._trace import Captured
from fddp._compiler._passes import _cost, _gate
from fddp._compiler._program import Program

FORMAT = 2  # 2: keyed by the captured program, tensors bound from the capture


class NotStorable(Exception):
    """The program holds something this format does not write (it is compiled afresh then)."""


_PYTHON_TARGETS: dict[tuple[str, str], Callable[..., Any]] = {
    ("operator", "getitem"): operator.getitem,
    ("fddp._compiler._passes._gate", "signature_gate"): _gate.signature_gate,
}
_TARGET_NAMES = {id(fn): key for key, fn in _PYTHON_TARGETS.items()}
# The higher-order operators the compiler inserts itself (remat's generator-state replay).
_HIGHER_ORDER = ("run_and_save_rng_state", "run_with_rng_state")
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _encode_target(target: Any) -> tuple:
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    if _stored_higher_order(target):
        return ("higher_order", target.name())
    key = _TARGET_NAMES.get(id(target))
    if key is None:
        raise NotStorable(f"graph calls {target!r}")
    return ("python", *key)


def _stored_higher_order(value: Any) -> bool:
    """Whether ``value`` is one of :data:`_HIGHER_ORDER`, the instance torch registers."""
    if not isinstance(value, torch._ops.HigherOrderOperator) or value.name() not in _HIGHER_ORDER:
        return False
    return getattr(torch.ops.higher_order, value.name()) is value


def _higher_order(name: str) -> torch._ops.HigherOrderOperator:
    if name not in _HIGHER_ORDER:  # the store writes no other
        raise NotStorable(f"graph calls the higher-order operator {name!r}")
    return getattr(torch.ops.higher_order, name)


def _op_overload(encoded: tuple) -> torch._ops.OpOverload:
    namespace, name, overload = encoded
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _decode_target(encoded: tuple) -> Any:
    kind, *rest = encoded
    if kind == "op":
        return _op_overload(tuple(rest))
    if kind == "higher_order":
        return _higher_order(rest[0])
    return _PYTHON_TARGETS[tuple(rest)]


_PLAIN = {type(None), bool, int, float, str}


def _encode_arg(arg: Any) -> Any:
    kind = type(arg)
    if kind in _PLAIN:
        return arg
    if kind is fx.Node:
        return ("node", arg.name)
    if isinstance(arg, (list, tuple)):  # a foreach op's hundreds of nodes: the common ones inline
        items = [
            ("node", a.name) if type(a) is fx.Node else a if type(a) in _PLAIN else _encode_arg(a)
            for a in arg
        ]
        return ("list" if isinstance(arg, list) else "tuple", items)
    if isinstance(arg, dict):
        return ("dict", [(k, _encode_arg(v)) for k, v in arg.items()])
    if isinstance(arg, slice):
        return ("slice", [_encode_arg(x) for x in (arg.start, arg.stop, arg.step)])
    if isinstance(arg, torch.device):
        return ("device", str(arg))
    if isinstance(arg, _TORCH_VALUES):
        return ("torch", str(arg).removeprefix("torch."))
    if isinstance(arg, torch._ops.OpOverload):  # the op a higher-order operator runs
        return ("op", (arg.namespace, arg._opname, arg._overloadname))
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise NotStorable(f"graph argument {arg!r}")


def _decode_arg(arg: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(arg, tuple):
        return arg
    tag, value = arg
    if tag == "node":
        return nodes[value]
    if tag in ("list", "tuple"):
        items = [_decode_arg(a, nodes) for a in value]
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        return {k: _decode_arg(v, nodes) for k, v in value}
    if tag == "slice":
        return slice(*(_decode_arg(x, nodes) for x in value))
    if tag == "device":
        return torch.device(value)
    if tag == "op":
        return _op_overload(value)
    found = getattr(torch, value)
    assert isinstance(found, _TORCH_VALUES)
    return found


def encode_graph(gm: fx.GraphModule) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """The graph's nodes as plain tuples, and the tensors its ``get_attr`` nodes read."""
    nodes, constants = [], {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function":
            target = _encode_target(target)
        elif node.op == "get_attr":
            value = getattr(gm, target)
            if not isinstance(value, torch.Tensor):
                raise NotStorable(f"graph attribute {target} is a {type(value).__name__}")
            constants[target] = value
        elif node.op not in ("placeholder", "output"):
            raise NotStorable(f"graph node {node.format_node()}")
        args = _encode_arg(tuple(node.args))
        kwargs = _encode_arg(dict(node.kwargs))
        nodes.append((node.op, node.name, target, args, kwargs))
    return nodes, constants


def decode_graph(nodes: list[tuple], constants: dict[str, torch.Tensor]) -> fx.GraphModule:
    graph = fx.Graph()
    by_name: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in nodes:
        if op == "call_function":
            target = _decode_target(target)
        node = graph.create_node(
            op, target, _decode_arg(args, by_name), _decode_arg(kwargs, by_name), name=name
        )
        by_name[name] = node
    graph.lint()
    return fx.GraphModule(constants, graph)


@dataclasses.dataclass(frozen=True)
class Stored:
    """A scheduled program as plain data. Its tensors are not in it: the graph's attributes are
    the capture's (by name), its other inputs the capture's too."""

    nodes: bytes  # the graph's nodes (encode_graph), pickled: read only when it is asked for
    attributes: list[str]  # the graph's tensor attributes, found on the capture's graph
    code: bytes | None  # the fx backend's forward, marshalled (None for Inductor)
    meta: dict[str, Any]  # plan, sequence, the code's globals, and the rest


def capture_digest(captured: Captured) -> str:
    """A digest of a capture: every node of its graph with every argument, its tensor
    constants' dtypes and shapes (their values are bound, not compiled in), where its inputs
    come from and where the step's outputs go. Equal digests, equal scheduled programs.

    Raises:
        NotStorable: the graph holds what this format does not write.
    """
    assert captured.graph is not None  # a capture, before its passes
    nodes, constants = encode_graph(captured.graph)
    held = [
        ("argument", s) if isinstance(s, int) else ("tensor", str(s.dtype), tuple(s.shape))
        for s in captured.inputs
    ]
    parts = [
        nodes,
        [(name, str(t.dtype), tuple(t.shape), t.device.type) for name, t in constants.items()],
        held,
        repr(captured.outputs),
        str(captured.out_spec),
        captured.method,
    ]
    return hashlib.sha256(pickle.dumps(parts, protocol=4)).hexdigest()


def _encode_global(value: Any) -> tuple:
    if _stored_higher_order(value):
        return ("higher_order", value.name())
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, float):
        return ("float", repr(value))
    if value is None or value is type(None):
        return ("none", value is None)
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module is None or qualname is None or _resolve(module, qualname) is not value:
        raise NotStorable(f"the graph's code uses {value!r}")
    return ("object", module, qualname)


def _resolve(module: str, qualname: str) -> Any:
    found: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def _decode_global(encoded: tuple) -> Any:
    kind, *rest = encoded
    if kind == "module":
        return sys.modules.get(rest[0]) or importlib.import_module(rest[0])
    if kind == "float":
        return float(rest[0])
    if kind == "higher_order":
        return _higher_order(rest[0])
    if kind == "none":
        return None if rest[0] else type(None)
    return _resolve(*rest)


def encode(program: Program) -> Stored:
    """``program`` (after its first run) as plain data.

    Raises:
        NotStorable: it holds a graph node, argument or merged program this format does not
            write.
    """
    if program.across_steps is not None:
        raise NotStorable("programs merged across steps (overlap_steps=True)")
    nodes, constants = encode_graph(program.graph)
    generated = program.generated
    meta = {
        "plan": program.schedule,
        "sequence": program.sequence,
        "output_dependencies": program.output_dependencies,
        "rank_bit": program.rank_bit,
        "cap": program.cap,
        "gated": program.gated,
        "graph_digest": program.graph_digest(),
    }
    if generated is not None:
        meta["globals"] = {k: _encode_global(v) for k, v in generated.fx_globals.items()}
        meta["operators"] = generated.operators
        meta["source"] = generated.source
    code = marshal.dumps(generated.code) if generated is not None else None
    return Stored(pickle.dumps(nodes, protocol=4), list(constants), code, meta)


def decode(stored: Stored, captured: Captured, backend: str, profile: _cost.Profile) -> Program:
    """The program ``stored`` holds, on ``captured``'s tensors (the capture its key was
    computed from), its runner built for ``backend`` (the fx backend runs the stored code; its
    graph is built only when asked for); ``profile`` is the one stored beside it.

    Raises:
        NotStorable: the data does not fit this fddp (another version wrote it).
    """
    meta = stored.meta
    assert captured.graph is not None  # the capture, before any pass
    try:
        graph_constants = {name: getattr(captured.graph, name) for name in stored.attributes}
    except AttributeError as e:
        raise NotStorable(f"a graph attribute the capture lacks: {e}") from None

    def graph() -> fx.GraphModule:
        return decode_graph(pickle.loads(stored.nodes), graph_constants)

    try:
        generated = None
        if stored.code is None:
            gm = graph()
            run, _ = _backend.build(gm, backend)
            graph_of: Callable[[], fx.GraphModule] = lambda: gm
        else:
            fx_globals = {k: _decode_global(v) for k, v in meta["globals"].items()}
            code = marshal.loads(stored.code)
            generated = _backend.Generated(code, fx_globals, meta["operators"], meta["source"])
            holder = types.SimpleNamespace(**graph_constants)
            run, graph_of = _backend.as_runner(generated.forward(holder)), graph
    except Exception as e:
        raise NotStorable(f"{type(e).__name__}: {e}") from None
    plan = dataclasses.replace(meta["plan"], captured_with=f"{captured.method}, loaded from cache")
    return Program(
        graph_of,
        plan,
        meta["sequence"],
        run,
        meta["output_dependencies"],
        meta["rank_bit"],
        profile,
        meta["cap"],
        None,
        meta["gated"],
        generated,
        meta.get("graph_digest"),
    )
