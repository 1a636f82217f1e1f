"""The undo log of a step: every random generator it may draw from, and the state it may write."""

from __future__ import annotations

from typing import Any

import optree
import torch


def generator_states() -> list[torch.Tensor]:
    """The state of every default generator of this process: the CPU one, then each CUDA
    device's once CUDA is initialised (a step's random ops draw from these)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def set_generator_states(states: list[torch.Tensor]) -> None:
    """Put every default generator back to ``states`` (as :func:`generator_states` made them)."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


class UndoLog:
    """What an attempt at a step may change, copied before it runs, put back if it fails.

    The generators' states always (a failed attempt may have drawn the step's dropout seed, so
    the redone step would draw another); with donated arguments also the state's tensors, which
    the attempt may have overwritten in place (one copy of the state, kept until the next step).
    """

    def __init__(self, donate: bool) -> None:
        self._donate = donate
        self._generators: list[torch.Tensor] = []
        self._tensors: list[torch.Tensor] | None = None

    def keep(self, params: Any, opt_state: Any) -> None:
        self._generators = generator_states()
        if not self._donate:
            return
        leaves = _tensors(params, opt_state)
        if self._tensors is None or len(self._tensors) != len(leaves):
            self._tensors = [torch.empty_like(x) for x in leaves]
        torch._foreach_copy_(self._tensors, leaves)

    def restore(self, params: Any, opt_state: Any) -> None:
        set_generator_states(self._generators)
        if self._donate:
            assert self._tensors is not None
            torch._foreach_copy_(_tensors(params, opt_state), self._tensors)


def _tensors(params: Any, opt_state: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves((params, opt_state)) if isinstance(x, torch.Tensor)]
