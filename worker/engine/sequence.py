"""Per-request state: tokens, where their KV lives, and the text streamed so far.

Pure Python over ints, lists and numpy slot arrays: the scheduler reads and writes the
KV fields, the engine's postprocess the token/text fields. Which slots belong to whom
is explained once, in the table at the top of `scheduler.py`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from worker.engine.radix_cache import TreeNode
from worker.engine.types import FinishReason, GenerateOutput, SamplingParams


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no slots
    RUNNING = "running"  # admitted: holds slots, prefilling or decoding
    FINISHED = "finished"  # released: holds nothing


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    # Given by the engine, unique within it (client request ids may repeat over time).
    seq_id: int
    # eos (unless ignore_eos) and stop_token_ids: sampling one of them ends the request.
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # Monotonic times: queued, and first admitted by the scheduler (queue-time metric).
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None

    # --- KV state (owned by the scheduler) ---
    # One slot per token of all_ids[:len(slots)]; see the table in scheduler.py.
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    prefix_len: int = 0  # slots[:prefix_len] belong to the radix tree (locked path)
    num_computed: int = 0  # tokens whose KV has been written
    last_node: TreeNode | None = None  # the locked tree node ending the matched prefix
    # Prefix hit of the first admission: what the client is told was cached.
    cached_tokens: int | None = None

    # --- output text (owned by the engine's postprocess) ---
    text: str = ""  # everything detokenized so far (stop string excluded once found)
    sent_len: int = 0  # chars of `text` already streamed
    unsent_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        """Slots allocated whose KV is not written yet (prompt or recompute after preemption)."""
        return self.num_computed < len(self.slots)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Record a sampled token, detokenize it and decide whether the request ends."""
        self.output_ids.append(token_id)
        self.unsent_ids.append(token_id)
        if token_id in self.stop_ids:
            # Stop tokens (eos, stop_token_ids) count as completion tokens, but their
            # text is not part of the answer.
            self.finish_reason = "stop"
            return
        self.text += self.detokenizer.push(token_id)
        if self.params.stop and self._cut_at_stop_string():
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"

    def take_text_delta(self) -> str:
        """Text that can be streamed now; holds back a tail that may start a stop string."""
        end = len(self.text)
        if self.finish_reason is None and self.params.stop:
            end -= _stop_prefix_overlap(self.text, self.params.stop, self.sent_len)
        delta = self.text[self.sent_len : end]
        self.sent_len = max(self.sent_len, end)
        return delta

    def take_token_ids(self) -> tuple[int, ...]:
        ids, self.unsent_ids = tuple(self.unsent_ids), []
        return ids

    def to_output(self) -> GenerateOutput:
        """What the client has not seen yet, plus the counts so far (takes the deltas)."""
        return GenerateOutput(
            request_id=self.request_id,
            text_delta=self.take_text_delta(),
            token_ids=self.take_token_ids(),
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=len(self.output_ids),
            finished=self.finish_reason is not None,
            finish_reason=self.finish_reason,
            queue_seconds=None if self.admitted is None else self.admitted - self.arrived,
        )

    def _cut_at_stop_string(self) -> bool:
        # Only text not yet streamed can contain a new match start (earlier text was
        # sent because no stop string could start there).
        hits = [pos for s in self.params.stop if (pos := self.text.find(s, self.sent_len)) != -1]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True


def _stop_prefix_overlap(text: str, stops: tuple[str, ...], start: int) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text) - start), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
