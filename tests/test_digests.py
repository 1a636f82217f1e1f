"""Replica digests: each tensor's digest is two position-weighted sums of its 32-bit words (its
bytes, where the size is not a multiple of 4) in wrapping int64 arithmetic, computed here the
plain way, word by word in Python, and compared with fddp's batched and chunked computation."""

from __future__ import annotations

import torch

from fddp._ranks import _digests

_MASK = 2**64


def _signed(x: int) -> int:
    x %= _MASK
    return x - _MASK if x >= 2**63 else x


def _reference(t: torch.Tensor) -> list[int]:
    raw = t.contiguous().view(-1).view(torch.uint8)
    words = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).tolist()
    (a, b), (c, d) = _digests._WEIGHT, _digests._SECOND
    first = sum(w * (p * a + b) for p, w in enumerate(words))
    second = sum(w * w * (p * c + d) for p, w in enumerate(words))
    return [_signed(first), _signed(second)]


def test_digests_equal_the_word_by_word_sums(monkeypatch):
    monkeypatch.setattr(_digests, "_CHUNK", 64)  # so that chunks and batches both occur here
    _digests._position_weights.cache_clear()
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(5, 7, generator=g),  # batched with the next ones
        torch.randn(3, generator=g).to(torch.float16),  # 6 bytes: byte words
        torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int64),
        torch.randn(20, 13, generator=g),  # 260 words: chunked
        torch.tensor(float("nan")),
        torch.zeros(0),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.randn(70, generator=g).to(torch.bfloat16),
    ]
    try:
        got = _digests.digests(tensors).tolist()
    finally:
        _digests._position_weights.cache_clear()
    assert got == [_reference(t) for t in tensors]


def test_digest_sees_one_bit_and_a_permutation():
    x = torch.randn(1000)
    flipped = x.clone()
    flipped.view(torch.int32)[500] ^= 1
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    rows = _digests.digests([x, flipped, swapped, x.clone()])
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
    assert torch.equal(rows[0], rows[3])
