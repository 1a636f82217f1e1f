"""Sharding over a replica axis: one bucket layout, sharded optimizer state, sharded params."""

from fddp._sharding._full import full_params, full_state_dict
from fddp._sharding._layout import Bucket, bucket_piece
from fddp._sharding._params import Layout, ShardedParams, shard_params
from fddp._sharding._state import ShardedState, shard_state, state_bytes
from fddp._sharding._step import TAKES_SHARDS, gathering
from fddp._sharding._trees import cut_ranks, per_rank_leaves, sharded_positions

__all__ = [
    "TAKES_SHARDS",
    "Bucket",
    "Layout",
    "ShardedParams",
    "ShardedState",
    "bucket_piece",
    "cut_ranks",
    "full_params",
    "full_state_dict",
    "gathering",
    "per_rank_leaves",
    "shard_params",
    "shard_state",
    "sharded_positions",
    "state_bytes",
]
