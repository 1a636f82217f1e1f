"""Where a benchmark result came from: the repository's commit (shared by the scripts)."""

from __future__ import annotations

import os
import subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args: str) -> str:
    """``git ARGS`` in the repository, its output stripped; "unknown" where git cannot say."""
    try:
        done = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def commit() -> str:
    """The short hash of HEAD."""
    return git("rev-parse", "--short", "HEAD")
