"""fddp.init / rank / world_size / replicate / shard: a world of one, and 2 and 3 gloo ranks."""

import collections

import pytest
import torch
import torch.distributed as dist
from _compare import assert_trees_equal
from _dist import run_checks

import fddp

Pair = collections.namedtuple("Pair", ["w", "b"])


# --- a world of one (plain `python`, no launcher) --------------------------------------------


def test_init_is_idempotent_and_makes_a_world_of_one():
    fddp.init()
    world = dist.group.WORLD
    fddp.init()
    fddp.init(timeout=5.0)
    assert dist.is_initialized()
    assert dist.group.WORLD is world
    assert fddp.rank() == 0
    assert fddp.world_size() == 1


def test_replicate_world_of_one_returns_the_tree():
    tree = {"w": torch.randn(3), "n": 4, "nt": Pair(torch.arange(2), None)}
    out = fddp.replicate(tree)
    assert out["n"] == 4 and out["nt"].b is None
    torch.testing.assert_close(out["w"], tree["w"], rtol=0, atol=0)
    torch.testing.assert_close(out["nt"].w, tree["nt"].w, rtol=0, atol=0)


def test_shard_world_of_one_is_the_whole_batch():
    batch = {"x": torch.randn(5, 2), "y": torch.arange(5), "tag": "train"}
    out = fddp.shard(batch)
    assert out["tag"] == "train"
    torch.testing.assert_close(out["x"], batch["x"], rtol=0, atol=0)
    torch.testing.assert_close(out["y"], batch["y"], rtol=0, atol=0)


def test_shard_zero_dim_leaf_is_value_error():
    with pytest.raises(ValueError, match=r"\['scale'\].*0-d"):
        fddp.shard({"x": torch.ones(2), "scale": torch.tensor(1.0)})


# --- N ranks ---------------------------------------------------------------------------------


def _rank_tree(r: int) -> dict:
    """A tree whose values depend on the rank: mixed dtypes, odd byte sizes, non-tensor leaves."""
    g = torch.Generator().manual_seed(100 + r)
    return {
        # Packed in key order: 6 bytes of float16 put the float64 leaf at an unaligned offset.
        "a_half": torch.randn(3, generator=g).half(),
        "b_double": torch.randn(7, generator=g, dtype=torch.float64),
        "w": torch.randn(3, 5, generator=g),
        "ids": torch.randint(0, 1000, (2, 3), generator=g),
        "flag": torch.tensor([r % 2 == 0, True]),
        "scalar": torch.tensor(float(r) + 0.5),
        "t": (torch.full((1,), r, dtype=torch.int32), None),
        "nt": Pair(w=torch.randn(2, 2, generator=g).t(), b=torch.randn(1, generator=g)),
        "step": 10 * r,
        "name": f"rank{r}",
    }


def _expect_value_error_on_every_rank(tree, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fddp.replicate(tree)


def _replicate_checks() -> list[str]:
    r, n = fddp.rank(), fddp.world_size()
    mine = _rank_tree(r)
    before = _rank_tree(r)
    for src in range(n):
        out = fddp.replicate(mine, src=src)
        assert_trees_equal(out, _rank_tree(src))
    assert_trees_equal(mine, before)  # the input is not modified
    assert fddp.replicate(mine)["name"] == "rank0"

    # One coalesced broadcast for all tensor leaves, whatever their dtypes.
    calls = []
    broadcast = dist.broadcast
    dist.broadcast = lambda *a, **k: calls.append(a) or broadcast(*a, **k)
    try:
        fddp.replicate(mine, src=n - 1)
    finally:
        dist.broadcast = broadcast
    assert len(calls) == 1

    # Mismatches raise a ValueError on every rank (and nobody hangs).
    t = torch.ones(3)
    extra = {"w": t, **({"extra": t} if r == 1 else {})}
    _expect_value_error_on_every_rank(extra, "differs")
    shape = {"w": torch.ones(3 + (r == n - 1))}
    _expect_value_error_on_every_rank(shape, "differs")
    dtype = {"w": torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32)}
    _expect_value_error_on_every_rank(dtype, "differs")
    kind = {"w": 1.0 if r == 1 else torch.ones(1)}
    _expect_value_error_on_every_rank(kind, "differs")
    container = [t] if r == 1 else (t,)  # same leaf paths, different node types
    _expect_value_error_on_every_rank(container, "differs")

    # Still in step after the errors.
    out = fddp.replicate({"x": torch.tensor([float(r)])}, src=n - 1)
    assert out["x"].item() == n - 1
    return ["ok"]


def _rows_of(r: int, n: int, total: int) -> tuple[int, int]:
    """Reference for uneven shards: the first ``total % n`` ranks get one row more."""
    base, extra = divmod(total, n)
    start = r * base + min(r, extra)
    return start, start + base + (r < extra)


def _shard_checks() -> dict:
    r, n = fddp.rank(), fddp.world_size()
    x = torch.arange(4 * n * 3, dtype=torch.float32).reshape(4 * n, 3)
    even = {"x": x, "y": [torch.arange(4 * n) * 10], "tag": "train", "none": None}
    out = fddp.shard(even)
    assert out["tag"] == "train" and out["none"] is None
    assert torch.equal(out["x"], x[4 * r : 4 * r + 4])
    assert torch.equal(out["y"][0], torch.arange(4 * r, 4 * r + 4) * 10)

    total = 4 * n + 1
    uneven = {"x": torch.arange(total * 2).reshape(total, 2), "y": torch.arange(total)}
    with pytest.raises(ValueError, match=r"\['x'\].*does not split evenly"):
        fddp.shard(uneven)
    with pytest.raises(ValueError, match=r"\['y'\].*does not split evenly"):
        fddp.shard({"x": torch.ones(4 * n), "y": torch.ones(total)})
    got = fddp.shard(uneven, uneven=True)
    lo, hi = _rows_of(r, n, total)
    assert torch.equal(got["x"], uneven["x"][lo:hi])
    assert torch.equal(got["y"], uneven["y"][lo:hi])
    return {"even": out["x"], "uneven": got["x"]}


def _init_checks() -> dict:
    r, n = fddp.rank(), fddp.world_size()
    fddp.init()  # idempotent under a launcher too
    assert (fddp.rank(), fddp.world_size()) == (r, n)
    assert 0 <= r < n
    return {"rank": r, "world_size": n}


CHECKS = {"init": _init_checks, "replicate": _replicate_checks, "shard": _shard_checks}


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def runs(request):
    return request.param, run_checks(CHECKS, request.param)


def test_init_and_rank_on_n_ranks(runs):
    world_size, results = runs
    assert [res["rank"] for res in results["init"]] == list(range(world_size))
    assert {res["world_size"] for res in results["init"]} == {world_size}


def test_replicate_on_n_ranks(runs):
    world_size, results = runs
    assert results["replicate"] == [["ok"]] * world_size


def test_shard_on_n_ranks(runs):
    n, results = runs
    whole = torch.arange(4 * n * 3, dtype=torch.float32).reshape(4 * n, 3)
    assert_trees_equal(torch.cat([res["even"] for res in results["shard"]]), whole)
    total = 4 * n + 1
    uneven = torch.cat([res["uneven"] for res in results["shard"]])
    assert_trees_equal(uneven, torch.arange(total * 2).reshape(total, 2))
