"""fddp.vmap: collectives over a mapped dimension against the explicit stacked computation."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_trees_close

import fddp
from fddp import vmap

N = 4


def _tree(n: int = N) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(n, 3, 2, generator=g),
        "f64": [torch.randn(n, 5, generator=g, dtype=torch.float64)],
        "i32": torch.randint(-5, 5, (n, 2), generator=g, dtype=torch.int32),
        "scalar": torch.randn(n, generator=g),
    }


def _map(fn: Any, tree: dict[str, Any]) -> dict[str, Any]:
    return {
        "f32": fn(tree["f32"]),
        "f64": [fn(tree["f64"][0])],
        "i32": fn(tree["i32"]),
        "scalar": fn(tree["scalar"]),
    }


def test_psum_pmean_of_a_tree() -> None:
    tree = _tree()
    out = vmap(lambda t: fddp.psum(t))(tree)
    assert_trees_close(out, _map(lambda x: x.sum(0, dtype=x.dtype).expand_as(x), tree))
    floats = {k: tree[k] for k in ("f32", "f64", "scalar")}
    mean = vmap(lambda t: fddp.pmean(t))(floats)
    torch.testing.assert_close(mean["f32"], tree["f32"].mean(0).expand(N, 3, 2))
    torch.testing.assert_close(mean["f64"][0], tree["f64"][0].mean(0).expand(N, 5))


def test_results_are_replicated_so_out_dims_none_works() -> None:
    x = torch.randn(N, 3)
    out = vmap(lambda x: (fddp.psum(x), x), out_dims=(None, 0))(x)
    torch.testing.assert_close(out[0], x.sum(0))
    torch.testing.assert_close(out[1], x)


def test_all_gather_stacked_and_tiled() -> None:
    tree = _tree()
    stacked = vmap(lambda t: fddp.all_gather(t), out_dims=None)(tree)
    assert_trees_close(stacked, tree)
    nonscalar = {k: tree[k] for k in ("f32", "f64", "i32")}
    tiled = vmap(lambda t: fddp.all_gather(t, tiled=True), out_dims=None)(nonscalar)
    assert tiled["f32"].shape == (N * 3, 2)
    torch.testing.assert_close(tiled["f32"], tree["f32"].flatten(0, 1))
    torch.testing.assert_close(tiled["i32"], tree["i32"].flatten(0, 1))


def test_broadcast() -> None:
    tree = _tree()
    out = vmap(lambda t: fddp.broadcast(t, src=2))(tree)
    assert_trees_close(out, _map(lambda x: x[2].expand_as(x), tree))
    with pytest.raises(ValueError, match="src=4"):
        vmap(lambda t: fddp.broadcast(t, src=4))(tree)


def test_unmapped_values_count_once_per_replica() -> None:
    x, c = torch.randn(N, 3), torch.randn(3)

    def f(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fddp.psum(c), fddp.all_gather(c), fddp.broadcast(c, src=1), fddp.pmean(x + c)

    s, g, b, m = vmap(f, in_dims=(0, None), out_dims=None)(x, c)
    torch.testing.assert_close(s, N * c)
    torch.testing.assert_close(g, c.expand(N, 3))
    torch.testing.assert_close(b, c)
    torch.testing.assert_close(m, x.mean(0) + c)


def test_axis_index_and_size() -> None:
    x = torch.zeros(N, 2)
    idx, size = vmap(lambda x: (fddp.axis_index(), fddp.axis_size()), out_dims=(0, None))(x)
    assert idx.dtype == torch.int64
    assert idx.tolist() == list(range(N))
    assert size == N
    # in_dims other than 0: the replica count comes from the mapped dim
    assert vmap(lambda x: fddp.axis_size(), in_dims=1, out_dims=None)(torch.zeros(2, 5)) == 5


def test_nested_axes() -> None:
    x = torch.randn(3, N, 2)

    def inner(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            fddp.psum(x, axis_name="outer"),
            fddp.psum(x, axis_name="inner"),
            fddp.all_gather(x, axis_name="outer"),
            fddp.axis_index("outer") * 10 + fddp.axis_index("inner"),
        )

    outer = vmap(vmap(inner, axis_name="inner"), axis_name="outer")
    po, pi, go, idx = outer(x)
    torch.testing.assert_close(po, x.sum(0, keepdim=True).expand_as(x))
    torch.testing.assert_close(pi, x.sum(1, keepdim=True).expand_as(x))
    torch.testing.assert_close(go, x.expand(3, 3, N, 2).permute(0, 2, 1, 3))
    assert idx.tolist() == [[10 * o + i for i in range(N)] for o in range(3)]


def test_collective_inside_an_inner_torch_vmap() -> None:
    x = torch.randn(N, 5, 3)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.vmap(lambda e: (fddp.psum(e), fddp.all_gather(e)))(x)

    s, g = vmap(f)(x)
    torch.testing.assert_close(s, x.sum(0, keepdim=True).expand_as(x))
    torch.testing.assert_close(g, x.transpose(0, 1).expand(N, 5, N, 3))


def test_unbound_axis_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="'model'"):
        vmap(lambda x: fddp.psum(x, axis_name="model"))(torch.ones(N))
    with pytest.raises(ValueError, match="'model'"):
        vmap(lambda x: fddp.axis_index("model"), axis_name="data")(torch.ones(N))


def test_input_errors() -> None:
    with pytest.raises(ValueError, match="different sizes"):
        vmap(lambda a, b: a + b)(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="no tensor input is mapped"):
        vmap(lambda a: a, in_dims=None)(torch.ones(3))
    with pytest.raises(ValueError, match=r"argument 1 leaf \['k'\] is a int"):
        vmap(lambda a, b: a)(torch.ones(3), {"k": 1})
    with pytest.raises(ValueError, match="one entry per positional argument"):
        vmap(lambda a, b: a, in_dims=(0,))(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="only 1 dims"):
        vmap(lambda a: a, in_dims=1)(torch.ones(3))
    with pytest.raises(ValueError, match="tiled=False"):
        vmap(lambda a: fddp.all_gather(a, tiled=True))(torch.ones(3))


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor | None


def test_pytree_in_dims_out_dims_and_kwargs() -> None:
    p = Pair(torch.randn(N, 2), None)
    c = torch.randn(2, N)

    def f(p: Pair, c: torch.Tensor, *, scale: float) -> dict[str, Any]:
        return {"sum": fddp.psum(p.a), "local": Pair(p.a * scale, c), "idx": fddp.axis_index()}

    out = vmap(f, in_dims=(Pair(0, None), 1), out_dims={"sum": None, "local": 1, "idx": 0})(
        p, c, scale=2.0
    )
    torch.testing.assert_close(out["sum"], p.a.sum(0))
    assert isinstance(out["local"], Pair)
    torch.testing.assert_close(out["local"].a, 2.0 * p.a.T)
    torch.testing.assert_close(out["local"].b, c)
    assert out["idx"].tolist() == list(range(N))


def test_randomness_is_passed_through() -> None:
    x = torch.zeros(N)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(lambda x: x + torch.rand(()))(x)
    out = vmap(lambda x: x + torch.rand(()), randomness="different")(x)
    assert len(set(out.tolist())) == N
    same = vmap(lambda x: x + torch.rand(()), randomness="same")(x)
    assert len(set(same.tolist())) == 1


@pytest.mark.parametrize("which", ["psum", "pmean", "all_gather", "tiled", "broadcast"])
def test_vjp_of_each_collective(which: str) -> None:
    """fddp.grad inside vmap == grad of the sum of all replicas' losses on the stacked inputs."""
    x = torch.randn(N, 3, 2, dtype=torch.float64)
    collective = {
        "psum": fddp.psum,
        "pmean": fddp.pmean,
        "all_gather": fddp.all_gather,
        "tiled": lambda v: fddp.all_gather(v, tiled=True),
        "broadcast": lambda v: fddp.broadcast(v, src=1),
    }[which]
    stacked = {
        "psum": lambda xs: xs.sum(0).expand_as(xs),
        "pmean": lambda xs: xs.mean(0).expand_as(xs),
        "all_gather": lambda xs: xs.expand(N, *xs.shape),
        "tiled": lambda xs: xs.flatten(0, 1).expand(N, N * 3, 2),
        "broadcast": lambda xs: xs[1].expand_as(xs),
    }[which]
    out_shape = stacked(x).shape
    w = torch.randn(out_shape, dtype=torch.float64)

    def local_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w * collective(x).sin()).sum() + (x**2).sum()

    got = vmap(fddp.grad(local_loss))(x, w)

    def total_loss(xs: torch.Tensor) -> torch.Tensor:
        return (w * stacked(xs).sin()).sum() + (xs**2).sum()

    torch.testing.assert_close(got, torch.func.grad(total_loss)(x))


@pytest.mark.parametrize("which", ["psum", "all_gather", "broadcast"])
def test_jvp_of_each_collective(which: str) -> None:
    x, t = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    collective, stacked = {
        "psum": (fddp.psum, lambda xs: xs.sum(0).expand(N, 3)),
        "all_gather": (
            lambda v: fddp.all_gather(v, tiled=True),
            lambda xs: xs.flatten().expand(N, N * 3),
        ),
        "broadcast": (lambda v: fddp.broadcast(v, src=2), lambda xs: xs[2].expand(N, 3)),
    }[which]

    def local_jvp(v: torch.Tensor, tv: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(lambda u: collective(u).sin(), (v,), (tv,))[1]

    want = torch.func.jvp(lambda xs: stacked(xs).sin(), (x,), (t,))[1]
    torch.testing.assert_close(vmap(local_jvp)(x, t), want)


def test_grad_of_a_vmapped_function() -> None:
    x = torch.randn(N, 3, dtype=torch.float64)
    got = torch.func.grad(lambda x: vmap(lambda v: fddp.psum(v) * v.cos())(x).sum())(x)
    want = torch.func.grad(lambda x: (x.sum(0) * x.cos()).sum())(x)
    torch.testing.assert_close(got, want)


def _bn_mlp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, sync: bool):
    """Linear -> batch norm (statistics over the global batch when ``sync``) -> linear -> CE."""
    h = x @ params["w1"]
    if sync:
        count = fddp.psum(torch.tensor(float(x.shape[0])))
        mean = fddp.psum(h.sum(0)) / count
        var = fddp.psum(((h - mean) ** 2).sum(0)) / count
    else:
        mean, var = h.mean(0), h.var(0, unbiased=False)
    h = torch.tanh((h - mean) / torch.sqrt(var + 1e-5) * params["gamma"])
    return F.cross_entropy(h @ params["w2"], y)


def _init(d_in: int = 6, d_hidden: int = 8, classes: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w1": torch.randn(d_in, d_hidden, generator=g) / math.sqrt(d_in),
        "gamma": torch.ones(d_hidden) + 0.1 * torch.randn(d_hidden, generator=g),
        "w2": torch.randn(d_hidden, classes, generator=g) / math.sqrt(d_hidden),
    }


def _data(seed: int, n: int = N, b: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, b, 6, generator=g), torch.randint(0, 3, (n, b), generator=g)


def test_grad_through_cross_replica_batch_norm() -> None:
    params, (x, y) = _init(), _data(2)

    def replica(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return fddp.pmean(fddp.grad(_bn_mlp_loss)(params, x, y, sync=True))

    got = vmap(replica, in_dims=(None, 0, 0), out_dims=None)(params, x, y)
    want = fddp.grad(_bn_mlp_loss)(params, x.flatten(0, 1), y.flatten(0, 1), sync=False)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_data_parallel_sgd_matches_global_batch() -> None:
    lr = 0.5

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return F.cross_entropy(torch.tanh(x @ params["w1"]) @ params["w2"], y)

    def step(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        grads = fddp.pmean(grads)
        params = {k: p - lr * grads[k] for k, p in params.items()}
        return params, fddp.pmean(loss)

    sim = vmap(step)
    params = _init()
    replicated = {k: v.expand(N, *v.shape).clone() for k, v in params.items()}
    for s in range(5):
        x, y = _data(10 + s)
        replicated, loss = sim(replicated, x, y)
        want_loss, grads = fddp.value_and_grad(loss_fn)(params, x.flatten(0, 1), y.flatten(0, 1))
        params = {k: p - lr * grads[k] for k, p in params.items()}
        torch.testing.assert_close(loss, want_loss.expand(N), rtol=0, atol=1e-6)
        for k in params:
            torch.testing.assert_close(
                replicated[k], params[k].expand(N, *params[k].shape), rtol=0, atol=1e-6
            )


def test_per_example_clipping_inside_vmap() -> None:
    params, (x, y) = _init(), _data(3)
    clip = 0.3

    def loss_one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return F.cross_entropy(torch.tanh(x @ params["w1"]) @ params["w2"], y)

    def clipped_mean_grad(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        per_example = torch.func.vmap(fddp.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in per_example.values()))
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)
        return {
            k: (g * scale.view(-1, *[1] * (g.dim() - 1))).mean(0) for k, g in per_example.items()
        }

    got = vmap(
        lambda p, x, y: fddp.pmean(clipped_mean_grad(p, x, y)),
        in_dims=(None, 0, 0),
        out_dims=None,
    )(params, x, y)
    per_replica = [clipped_mean_grad(params, x[r], y[r]) for r in range(N)]
    for k in params:
        want = torch.stack([g[k] for g in per_replica]).mean(0)
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-7)
