"""Backends: run the scheduled aten graph as Python (FX) or hand it to Inductor."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def fx_runner(gm: fx.GraphModule) -> Runner:
    """Run the graph's generated Python code; each collective launches where it stands."""
    gm.recompile()
    forward = gm.forward
    return lambda inputs: forward(*inputs)


# Inductor would otherwise reorder for peak memory, pulling each bucket's optimizer update (and
# so its wait) up to right after the launch; sinking waits keeps them at their first use.
_KEEP_COMM_PLACEMENT = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits"],
}


def inductor_runner(gm: fx.GraphModule) -> Runner:
    """Compile the scheduled graph with Inductor on its first run (it needs real inputs)."""
    from torch._inductor.compile_fx import compile_fx

    compiled: list[Callable] = []

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not compiled:
            with torch._inductor.config.patch(_KEEP_COMM_PLACEMENT):
                compiled.append(compile_fx(gm, inputs))
        return compiled[0](*inputs)

    return run


def build(gm: fx.GraphModule, compile: bool | str) -> Runner:
    if compile in (False, None, "fx"):
        return fx_runner(gm)
    if compile in (True, "inductor"):
        return inductor_runner(gm)
    raise ValueError(f"compile={compile!r}: use False (run the FX graph) or True/'inductor'.")
