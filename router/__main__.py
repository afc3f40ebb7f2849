"""`python -m router` is `radix-router`."""

import sys

from router.cli import main

sys.exit(main())
