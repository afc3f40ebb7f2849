"""Future token ids: a step's sampled ids, kept on the device for the next step's input.

With overlap scheduling (engine.py) the host schedules step N+1 before it has read
step N's tokens. Each token sampled in step N gets a placeholder id, `-(k + 1)` for
slot k of this ring, which goes into the request's output ids and so into step N+1's
`input_ids`; step N's draws are written to `ring[k]` on the device, and step N+1's
forward swaps every negative id for the ring's value before the embedding. Both
happen on the device's stream in order, so nothing waits. (SGLang's
`future_token_ids_map`.) The host replaces a placeholder with the real id when it
reads step N's results, one step later.

A placeholder is read by the very next forward only (a request preempted or finished
meanwhile has its ids resolved on the host before it runs again), so the ring needs
room for two steps of draws; `take` starts again at 0 when a block would not fit.
"""

from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, max_per_step: int, device: torch.device) -> None:
        self.max_per_step = max_per_step
        self.size = 2 * max_per_step + 2
        self.ring = torch.zeros(self.size, dtype=torch.int64, device=device)
        self._next = 0

    def take(self, n: int) -> int:
        """The first ring slot of a block of `n` (placeholders -(k+1) for k in it)."""
        if n > self.max_per_step:
            raise ValueError(f"{n} draws in one step; the ring holds {self.max_per_step}")
        if self._next + n > self.size:
            self._next = 0
        start, self._next = self._next, self._next + n
        return start

    def publish(self, start: int, ids: torch.Tensor) -> None:
        """A step's draws (device int64) into their slots: no host wait."""
        self.ring[start : start + len(ids)] = ids

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with every placeholder replaced by its drawn id (on the device)."""
        index = (-input_ids - 1).clamp(min=0)
        return torch.where(input_ids < 0, self.ring[index], input_ids)
