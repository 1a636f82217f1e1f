"""Rematerialisation policies for ``fddp.remat`` and ``data_parallel(remat=...)``, by JAX's names.

=================================== =============================================================
``nothing_saveable``                keep only each region's inputs; recompute everything else
``everything_saveable``             keep everything (no recomputation)
``dots_saveable``                   keep matrix products, batched ones and attention included
``dots_with_no_batch_dims_saveable`` keep matrix products without batch dims (``mm``, ``addmm``)
``save_only_these_names(*names)``   keep only the values ``fddp.remat_name`` named so
``save_any_names_but_these(*names)`` keep every named value except these
``memory_budget(fraction, bytes)``  keep what fits the budget, recompute the cheapest rest
=================================== =============================================================

>>> import fddp
>>> fddp.remat_policies.dots_with_no_batch_dims_saveable
dots_with_no_batch_dims_saveable
"""

from fddp._func._remat import (
    Policy,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    memory_budget,
    nothing_saveable,
    save_any_names_but_these,
    save_only_these_names,
)

__all__ = [
    "Policy",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "memory_budget",
    "nothing_saveable",
    "save_any_names_but_these",
    "save_only_these_names",
]
