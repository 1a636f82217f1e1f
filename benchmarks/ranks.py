"""A single-node world of ranks, as torchrun would set it up (shared by the benchmark scripts)."""

from __future__ import annotations

import os
import socket

import torch

import fddp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(rank: int, world: int, port: int, threads: int) -> None:
    """Set the environment torchrun would set for a single-node job, then ``fddp.init()``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    fddp.init()
