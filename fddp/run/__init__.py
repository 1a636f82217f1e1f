"""python -m fddp.run: torchrun's flags; survivors keep running, dead workers are replaced."""

from fddp._recovery._launcher import main, parser

__all__ = ["main", "parser"]
