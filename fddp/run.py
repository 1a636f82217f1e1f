"""python -m fddp.run: torchrun's flags; survivors keep running, dead workers are replaced."""

from __future__ import annotations

import sys

from fddp._recovery._launcher import main, parser

__all__ = ["main", "parser"]

if __name__ == "__main__":
    sys.exit(main())
