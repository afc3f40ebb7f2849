"""`python -m worker ...` is `radix-worker ...`."""

from worker.cli import main

raise SystemExit(main())
