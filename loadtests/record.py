"""Write a benchmark's table to its `--out` file, with the command that made it.

Every number in loadtests/results/ carries the command line that produced it, so a
reader can rerun it; the benches that take `--out` write through here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def command_line(name: str, argv: Sequence[str] | None) -> str:
    """`python -m loadtests NAME ARGS`, as it was (or would be) typed."""
    args = argv if argv is not None else sys.argv[1:]
    return f"python -m loadtests {name} {' '.join(args)}".strip()


def write_table(
    out: Path, name: str, argv: Sequence[str] | None, table: str, *, title: str | None = None
) -> None:
    """Append `table` under its command; with `title`, start the file afresh with it."""
    text = f"Command: `{command_line(name, argv)}`\n\n{table}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    if title is not None:
        out.write_text(f"# {title}\n\n{text}")
    else:
        with out.open("a") as f:
            f.write(f"\n{text}")
