"""psum, pmean, all_gather, broadcast, axis_index, axis_size: a world of one, and 2 and 3 ranks."""

import collections

import optree
import pytest
import torch
from _compare import assert_trees_close, assert_trees_equal
from _dist import run_checks

import fddp
from fddp._collectives import _ops

Pair = collections.namedtuple("Pair", ["w", "b"])


def _inputs(r: int) -> dict:
    """Rank ``r``'s tree: several dtypes and shapes, a 0-d leaf, a non-contiguous leaf, a None."""
    g = torch.Generator().manual_seed(r)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f64": [
            torch.randn(5, generator=g, dtype=torch.float64),
            torch.randn(2, 3, 4, generator=g, dtype=torch.float64).transpose(0, 2),
        ],
        "i64": torch.randint(-50, 50, (2, 3), generator=g),
        "nt": Pair(w=torch.randn((), generator=g), b=torch.randn(1, 6, generator=g)),
        "none": None,
    }


def _float_part(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "i64"}


def _reference(fn, trees: list):
    return optree.tree_map(lambda *xs: fn(list(xs)), *trees)


# --- a world of one --------------------------------------------------------------------------


def test_world_of_one_collectives_are_the_identity():
    tree = _inputs(0)
    before = optree.tree_map(torch.clone, tree)
    assert_trees_equal(fddp.psum(tree), tree)
    assert_trees_equal(fddp.pmean(_float_part(tree)), _float_part(tree))
    assert_trees_equal(fddp.broadcast(tree), tree)
    assert_trees_equal(fddp.all_gather(tree), optree.tree_map(lambda x: x[None], tree))
    tiled = {"f32": tree["f32"], "i64": tree["i64"]}
    assert_trees_equal(fddp.all_gather(tiled, tiled=True), tiled)
    assert fddp.axis_size() == 1
    index = fddp.axis_index()
    assert index.dtype == torch.int64 and index.shape == () and index.item() == 0
    assert_trees_equal(tree, before)


def test_world_of_one_psum_is_differentiable():
    w = torch.tensor([1.0, -2.0, 3.0])
    torch.testing.assert_close(fddp.grad(lambda w: fddp.psum(w * w).sum())(w), 2 * w)
    torch.testing.assert_close(fddp.grad(lambda w: fddp.pmean({"a": w})["a"].sum())(w), w**0)


@pytest.mark.parametrize(
    "call",
    [
        lambda ax: fddp.psum(torch.ones(2), axis_name=ax),
        lambda ax: fddp.pmean(torch.ones(2), axis_name=ax),
        lambda ax: fddp.all_gather(torch.ones(2), axis_name=ax),
        lambda ax: fddp.broadcast(torch.ones(2), axis_name=ax),
        lambda ax: fddp.axis_index(axis_name=ax),
        lambda ax: fddp.axis_size(axis_name=ax),
    ],
    ids=["psum", "pmean", "all_gather", "broadcast", "axis_index", "axis_size"],
)
def test_unknown_axis_name_is_value_error_naming_it(call):
    with pytest.raises(ValueError, match="'model_parallel'"):
        call("model_parallel")


def test_broadcast_src_out_of_range_is_value_error():
    with pytest.raises(ValueError, match="src=1"):
        fddp.broadcast(torch.ones(2), src=1)


def test_non_tensor_leaf_is_type_error_naming_its_path():
    with pytest.raises(TypeError, match=r"\['stats'\]\['count'\]"):
        fddp.psum({"stats": {"count": 3, "sum": torch.ones(1)}})


def test_eager_buckets_group_consecutive_same_dtype_leaves_under_the_cap(monkeypatch):
    monkeypatch.setattr(_ops, "EAGER_BUCKET_BYTES", 64)
    leaves = [
        torch.ones(4),  # 16 B
        torch.ones(8),  # 32 B  -> 48 B, same bucket
        torch.ones(8),  # 32 B  -> would be 80 B: new bucket
        torch.ones(2, dtype=torch.float64),  # other dtype: new bucket
        torch.ones(100),  # larger than the cap: a bucket of its own
        torch.ones(1),
    ]
    assert _ops._eager_buckets(leaves) == [[0, 1], [2], [3], [4], [5]]


# --- N ranks ---------------------------------------------------------------------------------


def _check_values() -> None:
    r, n = fddp.rank(), fddp.world_size()
    trees = [_inputs(k) for k in range(n)]
    mine = _inputs(r)
    before = optree.tree_map(torch.clone, mine)

    assert_trees_close(fddp.psum(mine), _reference(sum, trees))
    floats = [_float_part(t) for t in trees]
    assert_trees_close(fddp.pmean(_float_part(mine)), _reference(lambda xs: sum(xs) / n, floats))
    assert_trees_equal(fddp.all_gather(mine), _reference(torch.stack, trees))
    no_scalar = [{"f32": t["f32"], "i64": t["i64"], "f64": t["f64"]} for t in trees]
    assert_trees_equal(fddp.all_gather(no_scalar[r], tiled=True), _reference(torch.cat, no_scalar))
    for src in {0, 1, n - 1}:
        assert_trees_equal(fddp.broadcast(mine, src=src), trees[src])
    with pytest.raises(ValueError, match=f"src={n}"):
        fddp.broadcast(mine, src=n)

    index = fddp.axis_index()
    assert index.dtype == torch.int64 and index.shape == () and index.item() == r
    assert fddp.axis_size() == n
    assert_trees_equal(mine, before)  # no collective mutates its input


def _check_several_buckets() -> None:
    r, n = fddp.rank(), fddp.world_size()

    def tree(k: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + k)
        dtypes = [torch.float32, torch.float32, torch.float64, torch.int64]
        out = [
            (torch.randn(i % 13 + 1, generator=g) * 100).to(dtypes[i % len(dtypes)])
            for i in range(40)
        ]
        return [*out, torch.randn(100, generator=g), torch.randn(3, 3, generator=g)]

    calls = []
    summed = _ops._summed
    _ops._summed = lambda *a, **k: calls.append(a) or summed(*a, **k)
    try:
        # One all_reduce for the whole tree while it fits in a bucket of one dtype...
        assert_trees_close(
            fddp.psum(tree(r)[-2:]), _reference(sum, [tree(k)[-2:] for k in range(n)])
        )
        assert len(calls) == 1
        calls.clear()
        # ...and one per bucket when the cap is small.
        saved = _ops.EAGER_BUCKET_BYTES
        _ops.EAGER_BUCKET_BYTES = 64
        try:
            buckets = _ops._eager_buckets(tree(r))
            assert len(buckets) >= 20
            assert_trees_close(fddp.psum(tree(r)), _reference(sum, [tree(k) for k in range(n)]))
            assert len(calls) == len(buckets)
        finally:
            _ops.EAGER_BUCKET_BYTES = saved
    finally:
        _ops._summed = summed


def _w_x(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + k)
    return torch.randn(4, generator=g), torch.randn(4, generator=g)


def _check_gradients() -> None:
    r, n = fddp.rank(), fddp.world_size()
    w, x = _w_x(r)
    s = sum(wk * xk for wk, xk in (_w_x(k) for k in range(n)))

    # L_r = |psum(w_r x_r)|^2: the gradient of psum is psum of the cotangent, 2 n s x_r.
    def loss(w):
        return fddp.psum(w * x).square().sum()

    torch.testing.assert_close(fddp.grad(loss)(w), 2 * n * s * x)
    w_leaf = w.clone().requires_grad_()
    loss(w_leaf).backward()  # plain autograd, outside any transform
    torch.testing.assert_close(w_leaf.grad, 2 * n * s * x)

    # Several leaves in one bucket: L_r = |u|^2 + sum(v), u = psum(w x), v = psum(2 w).
    def tree_loss(w):
        out = fddp.psum({"u": w * x, "v": 2 * w})
        return out["u"].square().sum() + out["v"].sum()

    torch.testing.assert_close(fddp.grad(tree_loss)(w), 2 * n * s * x + 2 * n)

    # L_r = |pmean(w x)|^2 with m = s / n: gradient 2 m x_r.
    pmean_grad = fddp.grad(lambda w: fddp.pmean(w * x).square().sum())(w)
    torch.testing.assert_close(pmean_grad, 2 * (s / n) * x)

    # L_r = <all_gather(w), c>: every rank's loss sees w_r, so the gradient is n c[r].
    c = torch.arange(n * 4, dtype=torch.float32)
    tiled = fddp.grad(lambda w: (fddp.all_gather(w, tiled=True) * c).sum())(w)
    torch.testing.assert_close(tiled, n * c[4 * r : 4 * r + 4])
    stacked = fddp.grad(lambda w: (fddp.all_gather(w) * c.view(n, 4)).sum())(w)
    torch.testing.assert_close(stacked, n * c.view(n, 4)[r])


CHECKS = {
    "values": _check_values,
    "several_buckets": _check_several_buckets,
    "gradients": _check_gradients,
}


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def runs(request):
    """The checks' outcomes on 2 and on 3 ranks (each asserts on every rank)."""
    return request.param, run_checks(CHECKS, request.param)


@pytest.mark.parametrize("check", list(CHECKS))
def test_collectives_on_n_ranks(runs, check):
    world_size, results = runs
    assert results[check] == [None] * world_size
