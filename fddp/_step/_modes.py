"""The models a step is known to run: their train/eval modes enter the signature of its calls."""

from __future__ import annotations

from typing import Any

from fddp._base import _model_calls
from fddp._compiler._program import Compiled
from fddp._ranks._signature import Modes, Signature, signature_of


class KnownModels:
    """The models the captures of one step ran (a program is kept per mode of them)."""

    def __init__(self) -> None:
        self._modes: Modes | None = None

    def signature(self, args: tuple) -> tuple[Signature, list[Any]]:
        """The signature of a call with ``args`` (the known models' modes included) and the
        arguments' flat leaves."""
        return signature_of(args, self._modes)

    def after_compile(self, signature: Signature, args: tuple, compiled: Compiled) -> Signature:
        """``signature`` with the modes of every model the step is known to run, those of
        ``compiled``'s capture included (a program loaded from the persistent cache could have
        run any model ``fddp.functional`` wraps)."""
        ran = _model_calls.functional_models() if compiled.from_cache else compiled.captured.models
        known = self._modes.models if self._modes is not None else ()
        if all(any(m is k for k in known) for m in ran):
            return signature
        self._modes = Modes([*known, *(m for m in ran if not any(m is k for k in known))])
        return signature_of(args, self._modes)[0]
