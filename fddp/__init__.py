"""fddp: JAX-style functional data parallelism on PyTorch."""

from fddp import optim
from fddp._checkpoint import load, save
from fddp._collectives import all_gather, axis_index, axis_size, broadcast, pmean, psum
from fddp._grad import grad, value_and_grad
from fddp._module import functional, state
from fddp._replicas import ReplicaMismatchError
from fddp._runtime import RankFailureError, init, rank, replicate, shard, world_size
from fddp._schedule._capture import CaptureError
from fddp._schedule._fingerprint import ScheduleMismatchError
from fddp._timeline import plot_timeline
from fddp._transform import data_parallel
from fddp._vmap import vmap

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "RankFailureError",
    "ReplicaMismatchError",
    "ScheduleMismatchError",
    "all_gather",
    "axis_index",
    "axis_size",
    "broadcast",
    "data_parallel",
    "functional",
    "grad",
    "init",
    "load",
    "optim",
    "plot_timeline",
    "pmean",
    "psum",
    "rank",
    "replicate",
    "save",
    "shard",
    "state",
    "value_and_grad",
    "vmap",
    "world_size",
]
