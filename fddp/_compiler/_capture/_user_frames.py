"""The user's frame in a stack: the innermost outside torch, optree, fddp and the stdlib."""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

import optree
import torch

_FDDP_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # fddp/_compiler/_capture/ -> fddp/
_LIBRARY_DIRS = (
    *(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, optree.__file__)),
    os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep,  # the standard library
    _FDDP_DIR,
)


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost of ``frames`` outside the libraries: the step's or the model's code."""
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    return outside[-1] if outside else None


def where(frame: traceback.FrameSummary | None) -> str:
    """``frame`` as an error message's line (empty without one)."""
    if frame is None:
        return ""
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"\n  in {frame.name}, {frame.filename}:{frame.lineno}{code}"
