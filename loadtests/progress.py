"""Progress lines for the long commands (`run`, `compare`, `simulate`), and their verdicts.

One line per phase (or every few seconds inside a long phase), each with the elapsed
time and, once something is known about the pace, an estimate of what is left:

    [compare 2/3  0:21 elapsed, ~0:20 left] round_robin: running the workload

Lines go to stderr (stdout keeps the results, e.g. a markdown table to paste) and are
flushed at once, so a piped or logged run shows them live.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(
        self, name: str, phases: int, out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.name, self.phases = name, max(1, phases)
        self.out = out or sys.stderr
        self.clock = clock
        self.started = clock()
        self.done = 0  # phases finished

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def eta(self) -> float | None:
        """Seconds left at the pace of the phases finished so far (None before the first)."""
        if not self.done:
            return None
        return self.elapsed / self.done * (self.phases - self.done)

    def say(self, text: str, left: float | None = None, step: int | None = None) -> None:
        """A line about the current phase (or `step`)."""
        left = self.eta() if left is None else left
        pace = f", ~{clock_text(left)} left" if left is not None else ""
        step = min(self.done + 1, self.phases) if step is None else step
        head = f"[{self.name} {step}/{self.phases}  {clock_text(self.elapsed)} elapsed{pace}]"
        print(f"{head} {text}", file=self.out, flush=True)

    def finished(self, text: str = "") -> None:
        """One phase done."""
        self.done += 1
        if text:
            self.say(text, step=self.done)
