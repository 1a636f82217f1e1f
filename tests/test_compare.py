"""The tree comparisons of tests/_compare.py fail on every kind of difference, naming the leaf."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from _compare import assert_ranks_equal, assert_trees_close, assert_trees_equal, leaf_paths


class Moments(NamedTuple):
    mu: dict
    nu: dict


def _tree() -> dict:
    w = torch.arange(6.0).reshape(2, 3)
    return {
        "params": {"w": w, "b": torch.zeros(3)},
        "opt": [Moments({"w": w * 0.5}, {"w": w * 0.25}), None],
        "step": 7,
        "lr": 0.1,
        "name": "run",
    }


def test_leaf_paths_index_like_python():
    assert leaf_paths(_tree()) == [
        "['lr']",
        "['name']",
        "['opt'][0].mu['w']",
        "['opt'][0].nu['w']",
        "['params']['b']",
        "['params']['w']",
        "['step']",
    ]


def test_equal_trees_pass_both_helpers():
    assert_trees_equal(_tree(), _tree())
    assert_trees_close(_tree(), _tree(), rtol=0, atol=0)
    nan = {"x": torch.tensor([1.0, math.nan]), "loss": math.nan}
    assert_trees_equal(nan, {"x": torch.tensor([1.0, math.nan]), "loss": math.nan})


@pytest.mark.parametrize("assert_fn", [assert_trees_equal, assert_trees_close])
def test_a_missing_leaf_is_named(assert_fn):
    wrong = _tree()
    del wrong["params"]["b"]
    with pytest.raises(
        AssertionError, match=r"missing \(in expected, not in actual\): \['params'\]\['b'\]"
    ):
        assert_fn(wrong, _tree())


@pytest.mark.parametrize("assert_fn", [assert_trees_equal, assert_trees_close])
def test_an_extra_leaf_is_named(assert_fn):
    wrong = _tree()
    wrong["opt"][0].mu["v"] = torch.ones(1)
    with pytest.raises(
        AssertionError, match=r"extra \(in actual, not in expected\): \['opt'\]\[0\]\.mu\['v'\]"
    ):
        assert_fn(wrong, _tree())


def test_a_perturbed_leaf_is_named_with_the_difference():
    wrong = _tree()
    wrong["opt"][0].nu["w"][1, 2] += 1e-3
    with pytest.raises(AssertionError, match=r"leaf \['opt'\]\[0\]\.nu\['w'\] differs \(1 of 7"):
        assert_trees_equal(wrong, _tree())
    with pytest.raises(
        AssertionError, match=r"(?s)nu\['w'\] differs.*Greatest absolute difference"
    ):
        assert_trees_close(wrong, _tree(), rtol=1e-6, atol=1e-6)
    assert_trees_close(wrong, _tree(), rtol=0, atol=2e-3)  # within the tolerance


def test_the_first_differing_leaf_is_named_and_the_others_counted():
    wrong = _tree()
    wrong["params"]["b"] = wrong["params"]["b"] + 1
    wrong["params"]["w"] = wrong["params"]["w"] + 1
    with pytest.raises(
        AssertionError,
        match=r"leaf \['params'\]\['b'\] differs \(2 of 7.*the others: \['params'\]\['w'\]",
    ):
        assert_trees_equal(wrong, _tree())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t["params"].update(w=t["params"]["w"].double()),
            "dtype torch.float64 in actual",
        ),
        (
            lambda t: t["params"].update(w=t["params"]["w"].t()),
            r"shape \(3, 2\) in actual, \(2, 3\)",
        ),
        (lambda t: t.update(step=7.0), "float 7.0 in actual, int 7 in expected"),
        (lambda t: t.update(step=torch.tensor(7)), "a Tensor in actual, a int in expected"),
        (lambda t: t.update(name="other"), "'other' in actual, 'run' in expected"),
        (lambda t: t.update(lr=0.2), r"leaf \['lr'\] differs"),
    ],
)
def test_kind_type_shape_dtype_and_plain_values_are_compared(change, message):
    wrong = _tree()
    change(wrong)
    for assert_fn in (assert_trees_equal, assert_trees_close):
        with pytest.raises(AssertionError, match=message):
            assert_fn(wrong, _tree())


def test_containers_that_differ_with_the_same_paths_fail():
    with pytest.raises(AssertionError, match="different containers"):
        assert_trees_equal((torch.ones(1), torch.ones(1)), [torch.ones(1), torch.ones(1)])
    with pytest.raises(AssertionError, match="different containers"):
        assert_trees_equal({"a": None, "b": torch.ones(1)}, {"b": torch.ones(1)})


def test_a_nan_is_not_close_to_a_number():
    with pytest.raises(AssertionError, match=r"leaf \['x'\] differs"):
        assert_trees_close({"x": torch.tensor([math.nan])}, {"x": torch.tensor([1.0])})


def test_ranks_equal_names_the_rank_that_differs():
    same = [_tree(), _tree(), _tree()]
    assert_ranks_equal(same, "params")
    same[2]["params"]["w"][0, 0] = -1.0
    with pytest.raises(AssertionError, match=r"params: rank 2 vs rank 0: leaf \['params'\]\['w'\]"):
        assert_ranks_equal(same, "params")
    del same[1]["step"]
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: trees differ in their leaves"):
        assert_ranks_equal(same, "params")


def test_tolerances_come_in_pairs():
    with pytest.raises(ValueError, match="both rtol and atol"):
        assert_trees_close(_tree(), _tree(), rtol=1e-5)
