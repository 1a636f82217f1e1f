"""Model-level helpers for data-parallel training: synchronised batch norm, buffers, precision.

>>> import fddp, torch
>>> fddp.nn.sync_buffers({"running_mean": torch.tensor([0.5])}, "mean")
{'running_mean': tensor([0.5000])}
"""

from fddp._nn._precision import cast_floating, mixed_precision
from fddp._nn._syncbn import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm, sync_buffers

__all__ = [
    "SyncBatchNorm",
    "cast_floating",
    "convert_sync_batchnorm",
    "mixed_precision",
    "sync_batch_norm",
    "sync_buffers",
]
