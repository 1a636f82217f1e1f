"""fddp.grad / fddp.value_and_grad on pytrees, against torch.autograd.grad."""

import collections

import optree
import optree.dataclasses
import pytest
import torch
from _compare import assert_trees_close
from optree.registry import __GLOBAL_NAMESPACE as GLOBAL_NAMESPACE

import fddp

Pair = collections.namedtuple("Pair", ["w", "b"])


@optree.dataclasses.dataclass(namespace="")
class Linear:
    """A dataclass registered with optree: tensor fields are children."""

    w: torch.Tensor
    b: torch.Tensor


class Scaled:
    """A custom node registered with optree by hand: ``scale`` is a child, ``name`` is metadata."""

    def __init__(self, scale: torch.Tensor, name: str) -> None:
        self.scale, self.name = scale, name


optree.register_pytree_node(
    Scaled,
    lambda s: ((s.scale,), s.name, ("scale",)),
    lambda name, children: Scaled(children[0], name),
    namespace=GLOBAL_NAMESPACE,  # fddp flattens with optree's default (global) registry
)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _ref_grads(f, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Value and gradients by plain autograd on leaf copies that require grad."""
    xs = [x.detach().clone().requires_grad_() for x in leaves]
    value = f(*xs)
    return value.detach(), list(torch.autograd.grad(value, xs))


TOL = {"rtol": 1e-12, "atol": 1e-12}


def test_value_and_grad_dict_matches_autograd():
    torch.manual_seed(0)
    params = {"w1": _rand(4, 3), "b1": _rand(3), "w2": _rand(3)}
    x = _rand(5, 4)

    def f(p):
        return (torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]).square().sum()

    value, grads = fddp.value_and_grad(f)(params)
    ref_value, ref = _ref_grads(
        lambda w1, b1, w2: f({"w1": w1, "b1": b1, "w2": w2}), [*params.values()]
    )
    assert_trees_close(value, ref_value, **TOL)
    assert list(grads) == ["w1", "b1", "w2"]
    assert_trees_close(grads, dict(zip(grads, ref, strict=True)), **TOL, what="gradients")
    assert fddp.grad(f)(params).keys() == grads.keys()
    for k in grads:
        assert_trees_close(fddp.grad(f)(params)[k], grads[k], **TOL)


def test_grad_does_not_modify_inputs_and_returns_plain_tensors():
    params = {"w": _rand(3)}
    before = params["w"].clone()
    grads = fddp.grad(lambda p: (p["w"] ** 3).sum())(params)
    assert torch.equal(params["w"], before)
    assert not params["w"].requires_grad
    assert_trees_close(grads["w"], 3 * before**2, **TOL)
    assert grads["w"].grad_fn is None


def test_argnums_int_tuple_and_negative():
    a, b, c = _rand(3), _rand(3), _rand(3)

    def f(a, b, c):
        return (a * b * c.exp()).sum()

    _, (ga, gb, gc) = _ref_grads(f, [a, b, c])
    assert_trees_close(fddp.grad(f, argnums=1)(a, b, c), gb, **TOL)
    g = fddp.grad(f, argnums=(0, 2))(a, b, c)
    assert isinstance(g, tuple) and len(g) == 2
    assert_trees_close(g[0], ga, **TOL)
    assert_trees_close(g[1], gc, **TOL)
    (g1,) = fddp.grad(f, argnums=(1,))(a, b, c)  # a one-element sequence still gives a tuple
    assert_trees_close(g1, gb, **TOL)
    assert_trees_close(fddp.grad(f, argnums=-1)(a, b, c), gc, **TOL)


def test_argnums_out_of_range_is_value_error():
    with pytest.raises(ValueError, match="argnums"):
        fddp.grad(lambda a: a.sum(), argnums=1)(_rand(2))


def test_kwargs_and_non_differentiated_args_pass_through():
    def f(p, meta, *, scale):
        assert meta == {"step": 3, "name": "x"}
        return (p["w"] * scale * meta["step"]).sum()

    g = fddp.grad(f)({"w": _rand(4)}, {"step": 3, "name": "x"}, scale=2.0)
    assert_trees_close(g["w"], torch.full((4,), 6.0, dtype=torch.float64), **TOL)


def test_has_aux_with_non_tensor_aux():
    w = _rand(3)

    def f(w):
        loss = (w**2).sum()
        return loss, {"loss": loss, "label": "train", "count": 3, "none": None, "t": w * 2}

    (value, aux), g = fddp.value_and_grad(f, has_aux=True)(w)
    assert_trees_close(value, (w**2).sum(), **TOL)
    assert_trees_close(g, 2 * w, **TOL)
    assert aux["label"] == "train" and aux["count"] == 3 and aux["none"] is None
    assert_trees_close(aux["loss"], value, **TOL)
    assert_trees_close(aux["t"], w * 2, **TOL)
    assert not aux["t"].requires_grad

    g2, aux2 = fddp.grad(f, has_aux=True)(w)
    assert_trees_close(g2, 2 * w, **TOL)
    assert aux2["label"] == "train"


def test_has_aux_requires_a_pair():
    with pytest.raises(TypeError, match="pair"):
        fddp.grad(lambda w: (w**2).sum(), has_aux=True)(_rand(2))


def test_pytree_kinds_namedtuple_list_tuple_none_dataclass_custom_node():
    torch.manual_seed(1)
    tree = {
        "pair": Pair(w=_rand(2, 3), b=_rand(3)),
        "list": [_rand(3), (_rand(1), None)],
        "lin": Linear(w=_rand(3, 3), b=_rand(3)),
        "scaled": Scaled(_rand(()), "s"),
        "nothing": None,
    }
    x = _rand(4, 2)

    def f(t):
        h = x @ t["pair"].w + t["pair"].b
        h = torch.sin(h) * t["list"][0] + t["list"][1][0]
        h = h @ t["lin"].w + t["lin"].b
        assert t["nothing"] is None and t["list"][1][1] is None
        assert t["scaled"].name == "s"
        return (h * t["scaled"].scale).square().sum()

    grads = fddp.grad(f)(tree)
    assert optree.tree_structure(grads) == optree.tree_structure(tree)
    assert isinstance(grads["pair"], Pair)
    assert isinstance(grads["lin"], Linear)
    assert isinstance(grads["scaled"], Scaled) and grads["scaled"].name == "s"
    assert grads["nothing"] is None and grads["list"][1][1] is None

    leaves, spec = optree.tree_flatten(tree)
    _, ref = _ref_grads(lambda *ls: f(optree.tree_unflatten(spec, list(ls))), leaves)
    assert_trees_close(grads, optree.tree_unflatten(spec, list(ref)), **TOL, what="gradients")


def test_second_derivative_by_nesting():
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    g = fddp.grad(lambda x: (x**3).sum())
    gg = fddp.grad(lambda x: g(x).sum())(x)
    assert_trees_close(gg, 6 * x, **TOL)


def test_int_leaf_is_type_error_naming_its_path():
    params = {"layers": [{"w": _rand(2)}, {"w": _rand(2), "step": 3}]}
    with pytest.raises(TypeError) as info:
        fddp.grad(lambda p: p["layers"][0]["w"].sum())(params)
    msg = str(info.value)
    assert "['layers'][1]['step']" in msg
    assert "int" in msg


def test_integer_tensor_leaf_is_type_error_naming_its_path():
    params = {"w": _rand(2), "ids": torch.arange(3)}
    with pytest.raises(TypeError) as info:
        fddp.value_and_grad(lambda p: p["w"].sum())(params)
    msg = str(info.value)
    assert "['ids']" in msg
    assert "torch.int64" in msg


def test_bad_leaf_in_second_argnum_names_argument():
    with pytest.raises(TypeError, match=r"argument 1 leaf \['lr'\]"):
        fddp.grad(lambda a, b: a.sum(), argnums=(0, 1))(_rand(2), {"lr": 0.1})


def test_float32_leaves_keep_dtype():
    p = {"w": torch.randn(3), "h": torch.randn(3, dtype=torch.float64)}
    g = fddp.grad(lambda p: (p["w"].double() * p["h"]).sum())(p)
    assert g["w"].dtype == torch.float32 and g["h"].dtype == torch.float64
    torch.testing.assert_close(g["w"], p["h"].float())


# --- empty containers in arguments, aux and outputs, eagerly and on both capture paths --------

EMPTIES = {
    "dict": {},
    "list": [],
    "tuple": (),
    "none": None,
    "ordered_dict": collections.OrderedDict(),
    "defaultdict": collections.defaultdict(list),
    "nested": {"a": {}, "b": [(), None], "c": {"d": [{}]}},
}


def _branch_make_fx_cannot_trace(x: torch.Tensor) -> None:
    """Branch on a tensor value unless Dynamo traces, as Hugging Face's mask code does: make_fx
    stops on it, so the step is captured with Dynamo."""
    if not torch.compiler.is_compiling() and bool(x.sum() > 1e9):
        raise AssertionError("unreachable")


def _step_with_empties(empty, path: str):
    def step(w, arg, x):
        if path == "dynamo":
            _branch_make_fx_cannot_trace(x)

        def loss_fn(w):
            loss = ((x @ w) ** 2).mean()
            return loss, (empty, {"empty": arg, "loss": loss, "none": None})

        (loss, aux), g = fddp.value_and_grad(loss_fn, has_aux=True)(w)
        kept = optree.tree_map(lambda t: t * 2, arg)
        return w - 0.1 * fddp.pmean(g), fddp.pmean(arg), kept, aux, empty, fddp.pmean(loss)

    return step


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (major, minor)


@pytest.mark.parametrize("path", ["make_fx", "dynamo"])
@pytest.mark.parametrize("name", list(EMPTIES))
def test_empty_containers_in_arguments_aux_and_outputs(name, path):
    """Dynamo cannot flatten a dict of constants with optree >= 0.20 unless fddp's capture lets
    it (a model without buffers gives ``functional(..., return_buffers=True)`` an empty aux)."""
    if name == "defaultdict" and path == "dynamo" and _torch_at_least(2, 15):
        pytest.xfail(
            "torch 2.15's Dynamo rebuilds the user's optree.tree_map over an empty defaultdict "
            "as a dict (fddp's own collectives return such trees as they are)"
        )
    empty = EMPTIES[name]
    step = _step_with_empties(empty, path)
    w, x = _rand(3), _rand(4, 3)
    expected = fddp.data_parallel(step, trace=False)(w, empty, x)
    traced = fddp.data_parallel(step)
    for _ in range(2):  # the first call of a Dynamo capture runs through Dynamo, later ones not
        out = traced(w, empty, x)
        assert optree.tree_structure(out) == optree.tree_structure(expected)
        assert type(out[4]) is type(empty) and type(out[3][1]["empty"]) is type(empty)
        assert_trees_close(out, expected, what="traced vs trace=False")
    assert traced.schedule(w, empty, x).captured_with == path
    assert traced.retraces == 0
