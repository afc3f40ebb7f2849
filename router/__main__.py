"""`python -m router` is `radix-router`."""

import sys

from router.cli import main

# Guarded: `serve --processes N` starts its children with multiprocessing's spawn, which
# imports this module again in each child (as `__mp_main__`).
if __name__ == "__main__":
    sys.exit(main())
