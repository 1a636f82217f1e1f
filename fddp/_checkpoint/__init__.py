"""Checkpoints: one file (save, load) or a sharded directory (save_sharded, load_sharded)."""

from fddp._checkpoint._sharded import load_sharded, save_sharded
from fddp._checkpoint._single import load, save

__all__ = ["load", "load_sharded", "save", "save_sharded"]
