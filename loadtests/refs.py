"""`--before-ref`: a benchmark's "before" side, the same code at another git ref.

The ref is checked out into a temporary `git worktree` (detached, removed afterwards),
and the benchmark starts that side's processes from it (`cwd` and `PYTHONPATH` there),
so both sides run in one session on one machine, interleaved where the benchmark
interleaves: the before/after ratio is measured, not recalled from another day.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """A temporary worktree of `ref` (a branch, tag or commit of this repository)."""
    with tempfile.TemporaryDirectory(prefix="bench-ref-") as d:
        path = Path(d) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                check=False, capture_output=True,
            )  # fmt: skip


def short(ref: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True
    )
    return out.stdout.strip() or ref
