"""Uneven data across ranks: per-rank sample indices, padding with a mask, the exact global
mean, and the same number of steps on every rank.

>>> import fddp
>>> fddp.data.shard_batches(5, 2, num_replicas=2, rank=0)
[[0, 2], [4]]
"""

from fddp._batches import lockstep, pad_rows, shard_batches, weighted_pmean

__all__ = ["lockstep", "pad_rows", "shard_batches", "weighted_pmean"]
