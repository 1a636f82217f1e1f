"""fddp: JAX-style functional data parallelism on PyTorch."""

from fddp import optim
from fddp._accumulate import accumulate_gradients
from fddp._checkpoint import load, save
from fddp._collectives import all_gather, axis_index, axis_size, broadcast, pmean, psum
from fddp._data import lockstep, pad_rows, shard_batches, weighted_pmean
from fddp._grad import grad, value_and_grad
from fddp._module import functional, state
from fddp._powersgd import PowerSGDState, powersgd, powersgd_init
from fddp._precision import cast_floating, mixed_precision
from fddp._replicas import ReplicaMismatchError
from fddp._runtime import RankFailureError, init, rank, replicate, shard, world_size
from fddp._schedule._capture import CaptureError
from fddp._schedule._fingerprint import ScheduleMismatchError
from fddp._syncbn import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm, sync_buffers
from fddp._timeline import plot_timeline
from fddp._transform import data_parallel
from fddp._vmap import vmap

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "PowerSGDState",
    "RankFailureError",
    "ReplicaMismatchError",
    "ScheduleMismatchError",
    "SyncBatchNorm",
    "accumulate_gradients",
    "all_gather",
    "axis_index",
    "axis_size",
    "broadcast",
    "cast_floating",
    "convert_sync_batchnorm",
    "data_parallel",
    "functional",
    "grad",
    "init",
    "load",
    "lockstep",
    "mixed_precision",
    "optim",
    "pad_rows",
    "plot_timeline",
    "pmean",
    "powersgd",
    "powersgd_init",
    "psum",
    "rank",
    "replicate",
    "save",
    "shard",
    "shard_batches",
    "state",
    "sync_batch_norm",
    "sync_buffers",
    "value_and_grad",
    "vmap",
    "weighted_pmean",
    "world_size",
]
