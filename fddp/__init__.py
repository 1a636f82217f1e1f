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

__all__ = [  # in the order the reference page shows them
    # the runtime, the state, the step
    "init",
    "rank",
    "world_size",
    "replicate",
    "shard",
    "state",
    "functional",
    "data_parallel",
    "grad",
    "value_and_grad",
    "accumulate_gradients",
    "Loss",
    "vmap",
    "block_until_ready",
    # collectives (per leaf, over a named axis)
    "psum",
    "pmean",
    "psum_scatter",
    "all_gather",
    "broadcast",
    "axis_index",
    "axis_size",
    # sharded parameters
    "shard_params",
    "full_params",
    "full_state_dict",
    "ShardedParams",
    # low-communication steps
    "local_sgd",
    "diloco",
    "powersgd",
    "LowCommState",
    # training through failures
    "recoverable",
    "RecoverableStep",
    "Recovery",
    # the invariant mode, rematerialisation
    "Invariant",
    "remat",
    "remat_name",
    # checkpoints, the program cache, the timeline
    "save",
    "load",
    "save_sharded",
    "load_sharded",
    "cache_dir",
    "set_cache_dir",
    "plot_timeline",
    # namespaces
    "data",
    "nn",
    "optim",
    "remat_policies",
    # errors and warnings
    "CaptureError",
    "PrintWhileTracingWarning",
    "RankFailureError",
    "ReplicaMismatchError",
    "RetraceWarning",
    "SaveArrivalError",
    "ScheduleMismatchError",
]
