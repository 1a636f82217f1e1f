"""What a compile is asked for: the bucket caps, the wire dtype, the backend, overlap, remat."""

from __future__ import annotations

import dataclasses

import torch

from fddp._collectives._bucket_policy import CapPolicy
from fddp._func._remat import Policy


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """The part of a step's options the compiler reads (``StepOptions.for_compiler``)."""

    cap: CapPolicy
    comm_dtype: torch.dtype | None
    backend: str  # one of _backend.BACKENDS
    overlap_steps: bool = False
    remat: Policy | None = None  # the step's rematerialisation policy (fddp.remat_policies)

    @property
    def in_place(self) -> bool:
        """The FX backend runs buckets and updates in place; Inductor needs functional ops."""
        return self.backend == "fx"
