"""fddp: JAX-style functional data parallelism on PyTorch."""

from fddp import data, nn, optim, remat_policies
from fddp._base._errors import (
    CaptureError,
    PrintWhileTracingWarning,
    RankFailureError,
    ReplicaMismatchError,
    RetraceWarning,
    SaveArrivalError,
    ScheduleMismatchError,
)
from fddp._batches import shard
from fddp._checkpoint import load, load_sharded, save, save_sharded
from fddp._collectives._ops import (
    all_gather,
    axis_index,
    axis_size,
    broadcast,
    pmean,
    psum,
    psum_scatter,
)
from fddp._compiler._cache._persistent import cache_dir, set_cache_dir
from fddp._func._accumulate import accumulate_gradients
from fddp._func._grad import grad, value_and_grad
from fddp._func._invariant import Invariant
from fddp._func._loss import Loss
from fddp._func._remat import remat, remat_name
from fddp._func._vmap import vmap
from fddp._lowcomm._low_comm import LowCommState, diloco, local_sgd
from fddp._lowcomm._powersgd import powersgd
from fddp._nn._module import functional, state
from fddp._ranks._pending import block_until_ready
from fddp._ranks._runtime import init, rank, replicate, world_size
from fddp._ranks._timeline import plot_timeline
from fddp._recovery._step import RecoverableStep, Recovery, recoverable
from fddp._sharding import ShardedParams, full_params, full_state_dict, shard_params
from fddp._step._data_parallel import data_parallel

__version__ = "0.1.0"

__all__ = [
    "Invariant",
    "Loss",
    "LowCommState",
    "CaptureError",
    "PrintWhileTracingWarning",
    "RankFailureError",
    "RecoverableStep",
    "Recovery",
    "ReplicaMismatchError",
    "RetraceWarning",
    "SaveArrivalError",
    "ShardedParams",
    "ScheduleMismatchError",
    "accumulate_gradients",
    "all_gather",
    "axis_index",
    "axis_size",
    "block_until_ready",
    "broadcast",
    "cache_dir",
    "data",
    "data_parallel",
    "diloco",
    "full_params",
    "full_state_dict",
    "functional",
    "grad",
    "init",
    "load",
    "load_sharded",
    "local_sgd",
    "nn",
    "optim",
    "plot_timeline",
    "pmean",
    "powersgd",
    "psum",
    "psum_scatter",
    "rank",
    "recoverable",
    "remat",
    "remat_name",
    "remat_policies",
    "replicate",
    "save",
    "save_sharded",
    "set_cache_dir",
    "shard",
    "shard_params",
    "state",
    "value_and_grad",
    "vmap",
    "world_size",
]
