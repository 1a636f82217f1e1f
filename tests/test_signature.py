"""The per-call signature: equal exactly when the tree, every tensor leaf's shape, strides,
dtype and device, which leaves are the same tensor, and the non-tensor values are; its
per-leaf specs (for messages) name each of them."""

from __future__ import annotations

import torch

from fddp._ranks._signature import StaticSpec, TensorSpec, signature_of


def _args(w=None, scale=0.5, same=False):
    w = torch.zeros(3, 4) if w is None else w
    b = torch.zeros(4)
    return ({"w": w, "b": w if same else b}, scale, torch.ones(2, dtype=torch.int64))


def test_equal_for_new_tensors_of_the_same_metadata():
    a, _ = signature_of(_args())
    b, _ = signature_of(_args())
    assert a == b and hash(a) == hash(b)


def test_each_difference_makes_another_signature():
    base, _ = signature_of(_args())
    others = [
        _args(w=torch.zeros(4, 3)),  # shape
        _args(w=torch.zeros(4, 3).t()),  # strides
        _args(w=torch.zeros(3, 4, dtype=torch.float64)),  # dtype
        _args(scale=0.25),  # a non-tensor value
        _args(same=True),  # one tensor passed twice (b's shape differs too: same tensor only)
        ({"w": torch.zeros(3, 4)}, 0.5, torch.ones(2, dtype=torch.int64)),  # tree
    ]
    for other in others:
        assert signature_of(other)[0] != base


def test_aliased_leaves_are_told_apart_from_equal_copies():
    w = torch.zeros(4)
    aliased, _ = signature_of(({"w": w, "b": w}, 0.5, torch.ones(2, dtype=torch.int64)))
    copies, _ = signature_of(({"w": w, "b": w.clone()}, 0.5, torch.ones(2, dtype=torch.int64)))
    assert aliased != copies


def test_leaf_specs_name_every_leaf_in_tree_order():
    w = torch.zeros(3, 4)
    signature, leaves = signature_of(({"b": w, "w": w}, 0.5, torch.ones(2, dtype=torch.int64)))
    assert len(leaves) == 4
    assert signature.leaves == (
        TensorSpec(torch.Size([3, 4]), (4, 1), torch.float32, torch.device("cpu"), 0),
        TensorSpec(torch.Size([3, 4]), (4, 1), torch.float32, torch.device("cpu"), 0),
        StaticSpec(float, 0.5, 0.5),
        TensorSpec(torch.Size([2]), (1,), torch.int64, torch.device("cpu"), 3),
    )
    assert signature.lines(["a", "b", "c", "d"])[1] == (
        "argument leaf b",
        "torch.float32 [3, 4] on cpu (strides [4, 1]), the same tensor as leaf 0",
    )
