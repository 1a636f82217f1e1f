"""What ``python -m fddp.run`` tells its workers: the job's store, each worker's id, joining."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch.distributed as dist

LAUNCHED = "FDDP_RUN"  # "1" in every worker fddp.run starts
JOIN = "FDDP_RUN_JOIN"  # "1" in a replacement
PREFIX = "fddp-recoverable"  # recoverable's keys in the store: fddp.run reads admissions there


@dataclasses.dataclass(frozen=True)
class Launch:
    """A worker's part in the job: the store, its id, the first world size, whether it joins."""

    store: dist.Store
    rank: int
    world_size: int
    join: bool


def worker_env(
    *,
    uid: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node: int,
    store_address: tuple[str, int],
    run_id: str,
    join: bool,
    attempt: int,
) -> dict[str, str]:
    """The environment of worker ``uid``: torchrun's variables (``fddp.init()`` and other
    torchrun scripts read them; the store is the launcher's, as torchrun's agent store), and
    fddp.run's own."""
    host, port = store_address
    return {
        "RANK": str(uid),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(node),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "PYTHONUNBUFFERED": "1",
        LAUNCHED: "1",
        JOIN: "1" if join else "0",
    }


def launched(timeout: float) -> Launch | None:
    """The launch this process is part of (None when no launcher started it).

    Raises:
        ValueError: under torchrun, whose agent stops every worker when one fails.
    """
    if os.environ.get(LAUNCHED) != "1":
        if "TORCHELASTIC_RUN_ID" in os.environ:
            raise ValueError(
                "recoverable: this process runs under torchrun, whose agent stops every "
                "worker as soon as one fails, so the survivors could not go on. Launch with "
                "python -m fddp.run (torchrun's flags; it keeps survivors running, hosts the "
                "store and starts replacements), or pass store=, rank= and world_size= from "
                "your own launcher."
            )
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
    )
    return Launch(
        store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ.get(JOIN) == "1"
    )
