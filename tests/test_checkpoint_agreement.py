"""Checkpoints agree across ranks: a sharded checkpoint is saved and loaded over the
group its shards were cut over, every rank loads the same save, a fully sharded ``like`` is
matched leaf by leaf with the saved full tree, a file of one rank's shards is not loaded on
another, and a ``rank0_only`` save of per-rank DiLoCo values is refused.

One spawn of 4 gloo ranks (hybrid sharding needs a 2 x 2 mesh) runs every check.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from _compare import assert_trees_equal
from _dist import run_checks

import fddp
import fddp.optim as optim
from fddp._base._errors import UsageValueError
from fddp._checkpoint import _manifest

MANIFEST = "fddp-sharded.json"
TINY = 200 / 2**20  # 200-byte buckets: several per tree, uneven over 2 ranks
READ_KEY = "test_checkpoint_agreement/manifest_read"


def _mesh():
    """This rank's pair ({0, 1} or {2, 3}: the shard group) and its peer in the other pair."""
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    peers = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return {"shard": pairs[rank // 2], "replicate": peers[rank % 2]}


def _full(seed: float) -> dict:
    return {"w": torch.arange(30.0).reshape(5, 6) + seed, "b": torch.arange(7.0) - seed}


def _hsdp_tree(seed: float, mesh: dict) -> dict:
    """Hybrid sharding's parameters and AdamW state after one update, sharded over the pair."""
    full = _full(seed)
    opt = optim.shard_state(
        optim.adam(0.1), axis_name="shard", replicate_axis="replicate", bucket_cap_mb=TINY
    )
    init = fddp.data_parallel(opt.init, trace=False, axes=mesh)
    update = fddp.data_parallel(lambda p, g, s: opt.update(g, s, p)[1], trace=False, axes=mesh)
    grads = {k: v * (1 + dist.get_rank()) for k, v in full.items()}
    state = update(full, grads, init(full))
    params = fddp.shard_params(full, "shard", bucket_cap_mb=TINY, group=mesh["shard"])
    return {"params": params, "opt": state}


def _sharded_tree(seed: float) -> dict:
    """Fully sharded parameters and AdamW shard_state state over the world, one update in."""
    full = _full(seed)
    opt = optim.shard_state(optim.adam(0.1), bucket_cap_mb=TINY)
    init = fddp.data_parallel(opt.init, trace=False)
    update = fddp.data_parallel(lambda p, g, s: opt.update(g, s, p)[1], trace=False)
    grads = {k: v * (1 + dist.get_rank()) for k, v in full.items()}
    state = update(full, grads, init(full))
    params = fddp.shard_params(full, bucket_cap_mb=TINY)
    return {"params": params, "opt": state, "step": int(seed)}


def check_hsdp_over_the_shard_group(tmp: str) -> dict:
    """Saved over the world (the default), HSDP state was written as wrong shards; now
    refused on every rank before anything is written, and a save and load over the shard group
    give the tree back exactly."""
    mesh = _mesh()
    tree = _hsdp_tree(1.0, mesh)
    wrong = os.path.join(tmp, "hsdp-world")
    with pytest.raises(UsageValueError) as saved:
        fddp.save_sharded(wrong, tree)
    out = {"save": str(saved.value), "written": os.path.exists(wrong)}
    path = os.path.join(tmp, f"hsdp-pair-{dist.get_rank() // 2}")  # one per replica group
    fddp.save_sharded(path, tree, group=mesh["shard"])
    like = _hsdp_tree(0.0, mesh)
    with pytest.raises(UsageValueError) as loaded:
        fddp.load_sharded(path, like)
    out["load"] = str(loaded.value)
    assert_trees_equal(fddp.load_sharded(path, like, group=mesh["shard"]), tree)
    return out


def _publish_as_another_job(source: str, path: str) -> None:
    """Publish the checkpoint at ``source`` at ``path`` as a save to ``path`` does: its data
    directory first, then the manifest with one ``os.replace``."""
    with open(os.path.join(source, MANIFEST)) as f:
        data = json.load(f)["data"]
    shutil.copytree(os.path.join(source, data), os.path.join(path, data))
    shutil.copy(os.path.join(source, MANIFEST), os.path.join(path, "manifest.new"))
    os.replace(os.path.join(path, "manifest.new"), os.path.join(path, MANIFEST))


def _load_while_another_job_publishes(tmp: str, name: str, remove_first: bool) -> dict:
    """Every rank loads checkpoint ``name`` (save 1); once rank 0 has read its manifest and
    before rank 1 enters load_sharded, another job publishes save 2 there (``remove_first``:
    and deletes save 1's data directory first, ignoring the readers' locks). What each rank
    loaded, or the error it raised."""
    rank = dist.get_rank()
    path, other = os.path.join(tmp, name), os.path.join(tmp, f"{name}-other")
    first, second, like = _sharded_tree(1.0), _sharded_tree(2.0), _sharded_tree(0.0)
    fddp.save_sharded(path, first)
    fddp.save_sharded(other, second)
    with open(os.path.join(path, MANIFEST)) as f:
        data = json.load(f)["data"]
    store = dist.distributed_c10d._get_default_store()
    key = f"{READ_KEY}/{name}"
    read = _manifest.read

    def read_then_tell(directory: str):
        body = read(directory)
        store.set(key, "1")
        return body

    if rank == 0:
        _manifest.read = read_then_tell
    try:
        if rank == 1:
            store.wait([key])
            if remove_first:
                shutil.rmtree(os.path.join(path, data))
            _publish_as_another_job(other, path)
        loaded = fddp.load_sharded(path, like)
    except ValueError as e:
        return {"error": str(e), "first": data}
    finally:
        _manifest.read = read
    return {"loaded": loaded, "first": first}


def check_one_save_for_every_rank(tmp: str) -> None:
    """Another job publishes save 2 at the path after rank 0 has read the manifest of
    save 1 and before rank 1 enters load_sharded. Before, rank 1 loaded save 2 (a mixed
    model); now every rank loads save 1, the one rank 0 opened."""
    out = _load_while_another_job_publishes(tmp, "published", remove_first=False)
    assert "error" not in out, out
    assert_trees_equal(out["loaded"], out["first"])


def check_one_save_or_an_error(tmp: str) -> dict:
    """Where the other job also deleted save 1 before rank 1 could open it: before,
    rank 1 loaded save 2 (a mixed model); now every rank raises, naming both saves."""
    out = _load_while_another_job_publishes(tmp, "deleted", remove_first=True)
    if "error" not in out:
        return {"loaded": out["loaded"]["step"]}
    with open(os.path.join(tmp, "deleted", MANIFEST)) as f:
        return {**out, "second": json.load(f)["data"]}


def check_fully_sharded_like_by_path(tmp: str) -> dict:
    """A fully sharded checkpoint loaded into a ``like`` whose full tree has a leaf
    transposed, renamed, split or two leaves swapped: before, loaded silently (the buckets
    are as long), values misplaced; now a UsageValueError naming the leaf, on every rank."""
    full = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4.0) + 10}
    path = os.path.join(tmp, "fully-sharded")
    fddp.save_sharded(path, {"params": fddp.shard_params(full)})
    back = fddp.load_sharded(
        path, {"params": fddp.shard_params({k: 0 * v for k, v in full.items()})}
    )
    assert_trees_equal(fddp.full_params(back["params"]), full)
    likes = {
        "transposed": {"a": torch.zeros(3, 2), "b": torch.zeros(4)},
        "renamed": {"c": torch.zeros(2, 3), "b": torch.zeros(4)},
        "split": {"a": torch.zeros(3), "a2": torch.zeros(3), "b": torch.zeros(4)},
        "swapped": {"a": torch.zeros(4), "b": torch.zeros(2, 3)},
    }
    out = {}
    for name, like in likes.items():
        with pytest.raises(UsageValueError) as e:
            fddp.load_sharded(path, {"params": fddp.shard_params(like)})
        out[name] = str(e.value)
    return out


def check_per_rank_file_on_another_rank(tmp: str) -> str | None:
    """Each rank saves its shards with fddp.save(rank0_only=False); every rank then
    loads ckpt-0. Before, ranks 1-3 took rank 0's shards; now they raise, and each rank's
    own file loads exactly."""
    rank = dist.get_rank()
    tree = _sharded_tree(3.0)
    fddp.save(os.path.join(tmp, f"ckpt-{rank}"), tree, rank0_only=False)
    dist.barrier()
    like = _sharded_tree(0.0)
    assert_trees_equal(fddp.load(os.path.join(tmp, f"ckpt-{rank}"), like), tree)
    try:
        assert_trees_equal(fddp.load(os.path.join(tmp, "ckpt-0"), like), tree)
    except UsageValueError as e:
        return str(e)
    return None


def _inner_step(params, opt_state, x):
    loss, grads = fddp.value_and_grad(lambda p: ((x @ p["w"] - 1.0) ** 2).mean())(params)
    updates, opt_state = optim.sgd(0.1).update(grads, opt_state, params)
    return optim.apply_updates(params, updates), opt_state, loss


def check_diloco_rank0_only_mid_way(tmp: str) -> str:
    """DiLoCo saved with fddp.save (rank0_only=True, the default) one call into H=4:
    before, rank 0's inner parameters were written and every rank resumed from them; now
    refused on every rank, nothing written. The LowCommState alone is refused too: it cannot
    resume without the inner parameters it was returned with."""
    rank = dist.get_rank()
    lstep = fddp.diloco(_inner_step, every=4)
    params = {"w": torch.ones(3, 2)}
    state, opt_state = lstep.init(params), optim.sgd(0.1).init(params)
    x = torch.arange(12.0).reshape(4, 3) * (rank + 1)
    state, params, opt_state, _ = lstep(state, params, opt_state, x)
    path = os.path.join(tmp, "diloco.pt")
    with pytest.raises(UsageValueError) as e:
        fddp.save(path, {"state": state, "params": params, "opt": opt_state})
    assert not os.path.exists(path)
    with pytest.raises(UsageValueError, match="but not the inner parameters"):
        fddp.save(path, {"state": state})
    assert not os.path.exists(path)
    return str(e.value)


CHECKS = {
    "hsdp": check_hsdp_over_the_shard_group,
    "one_save": check_one_save_for_every_rank,
    "one_save_or_an_error": check_one_save_or_an_error,
    "fully_sharded_like": check_fully_sharded_like_by_path,
    "per_rank_file": check_per_rank_file_on_another_rank,
    "diloco": check_diloco_rank0_only_mid_way,
}


def _in_step(check, tmp: str):
    """``check(tmp)``, then wait for every rank, so that the next check starts together."""
    try:
        return check(tmp)
    finally:
        dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    tmp = str(tmp_path_factory.mktemp("agreement"))
    checks = {name: functools.partial(_in_step, c, tmp) for name, c in CHECKS.items()}
    return run_checks(checks, 4, timeout=240)


def test_hsdp_saved_over_the_world_is_refused_and_loads_over_its_group(runs) -> None:
    for rank, out in enumerate(runs["hsdp"]):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert not out["written"]
        for where in ("save", "load"):
            assert f"cut over ranks {pair}" in out[where], out[where]
            assert "group of ranks [0, 1, 2, 3] (the default: the world)" in out[where]
            assert "Pass group=" in out[where]


def test_every_rank_loads_the_save_rank_0_opened(runs) -> None:
    assert runs["one_save"] == [None] * 4


def test_a_save_gone_before_a_rank_opened_it_is_an_error_naming_both(runs) -> None:
    outcomes = runs["one_save_or_an_error"]
    for out in outcomes:
        assert "error" in out, out
        assert (
            f"rank 0 loads the save in {out['first']}, which this rank cannot open"
            in (out["error"])
        )
        assert f"names {out['second']}" in out["error"]
        assert out["first"] != out["second"]


def test_fully_sharded_like_is_matched_by_path(runs) -> None:
    for out in runs["fully_sharded_like"]:
        assert (
            "['params']['a']: shape (2, 3) in the checkpoint, (3, 2) in like" in out["transposed"]
        )
        assert "in `like` but not in the checkpoint: ['params']['c']" in out["renamed"]
        assert "in the checkpoint but not in `like`: ['params']['a']" in out["renamed"]
        assert "in `like` but not in the checkpoint: ['params']['a2']" in out["split"]
        assert "['params']['a']: shape (2, 3) in the checkpoint, (4,) in like" in out["swapped"]
        assert "['params']['b']: shape (4,) in the checkpoint, (2, 3) in like" in out["swapped"]


def test_a_file_of_shards_loads_on_its_rank_only(runs) -> None:
    outcomes = runs["per_rank_file"]
    assert outcomes[0] is None
    for rank, message in enumerate(outcomes[1:], start=1):
        assert "holds the shards of rank 0 of 4" in message, message
        assert f"this is rank {rank} of 4" in message
        assert "fddp.save_sharded" in message


def test_diloco_rank0_only_save_mid_way_is_refused(runs) -> None:
    for message in runs["diloco"]:
        assert "leaf ['params']['w']" in message, message
        assert "LowCommState" in message
        assert "rank0_only=False" in message
        assert "Nothing was written" in message
