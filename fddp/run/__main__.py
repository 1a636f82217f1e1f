"""The command ``python -m fddp.run``."""

import sys

from fddp.run import main

if __name__ == "__main__":
    sys.exit(main())
