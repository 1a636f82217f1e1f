"""Clean process exit after fddp.init(): tear the process group down before the interpreter."""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def register() -> None:
    """Install the exit handler once per process."""
    global _registered
    if not _registered:
        atexit.register(_shutdown)
        _registered = True
