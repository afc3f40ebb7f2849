"""Per-request state (`Req`): tokens, where their KV lives, and the text streamed so far.

Pure Python over ints, lists and numpy slot arrays: the scheduler reads and writes the
KV fields, the engine's postprocess the token/text fields. Which slots belong to whom
is explained once, in the table at the top of `scheduler.py`. A request with `n` > 1
is `n` Reqs with the same request_id and prompt (choice `index` 0..n-1).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from worker.engine.salt import Tag, salted
from worker.engine.tree_node import TreeNode
from worker.engine.types import FinishReason, GenerateOutput, SamplingParams, TokenLogprob


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no slots
    RUNNING = "running"  # admitted: holds slots, prefilling or decoding
    FINISHED = "finished"  # released: holds nothing


class StopMatcher:
    """Finds stop strings in text fed a few characters at a time, in time linear in
    the characters fed (a KMP automaton per stop string). A rescan of the unsent text
    per token cost 0.6-1 s per request with crafted stop strings (issue 15)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)  # chars of stops[i] that end the text fed so far
        self._fed = 0

    def feed(self, chars: str) -> int | None:
        """Feed new text; the start (in all text fed) of the earliest stop string that
        completes within it, or None."""
        best: int | None = None
        for i, stop in enumerate(self.stops):
            fail, k = self._fail[i], self._state[i]
            for j, c in enumerate(chars):
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    start = self._fed + j + 1 - k
                    best = start if best is None else min(best, start)
                    k = fail[k - 1]
                    break
            self._state[i] = k
        self._fed += len(chars)
        return best

    @property
    def overlap(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        return max(self._state, default=0)


def _failure(s: str) -> list[int]:
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


@dataclass(eq=False)
class Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    # Given by the engine, unique within it (client request ids may repeat over time).
    seq_id: int
    # eos (unless ignore_eos) and stop_token_ids: sampling one of them ends the request.
    stop_ids: frozenset[int] = frozenset()
    index: int = 0  # the choice this Req produces (n > 1)
    salt: Tag | None = None  # its cache namespace (cache_salt: worker/engine/salt.py)
    priority: int = 0  # lower is admitted earlier (admission.py's order)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    # Monotonic times: queued, and first admitted by the scheduler (queue-time metric).
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None

    # --- KV state (owned by the scheduler) ---
    # One slot per token of all_ids[:len(slots)]; see the table in scheduler.py.
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    prefix_len: int = 0  # slots[:prefix_len] belong to the radix tree (locked path)
    num_computed: int = 0  # tokens whose KV has been written
    last_node: TreeNode | None = None  # the locked tree node ending the matched prefix
    dirty_from: int = 0  # slots[:dirty_from] are what the runner last saw (batch.py)
    queued_at_step: int = 0  # the scheduler's step count when it last queued (lpm age)
    # Monotonic times: queued, and first admitted (queue-time metric, seat time).
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    # Pin the sequence's prefix this long once answered, under this key (pins.py).
    pin_key: str | None = None
    pin_ttl: float = 0.0
    # Prefix hit of the first admission: what the client is told was cached.
    cached_tokens: int | None = None
    host_cached_tokens: int = 0  # of them, loaded from the host tier

    # --- output text (owned by the engine's postprocess) ---
    text: str = ""  # everything detokenized so far (stop string excluded once found)
    sent_len: int = 0  # chars of `text` already streamed
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_matcher: StopMatcher | None = None
    # Output ids still placeholders (overlap scheduling, futures.py): the last ones.
    pending_tokens: int = 0

    def __post_init__(self) -> None:
        self.prompt_arr = np.asarray(self.prompt_ids, dtype=np.int64)
        if self.params.stop:
            self.stop_matcher = StopMatcher(self.params.stop)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without building all_ids: a decode step's one input token
        cost a copy of the whole sequence per request per step (O(length²) a request)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def match_key(self) -> np.ndarray:
        """The tokens a prefix match may cover: all but the last (its logits give the
        next token, so it is always computed). Reuses the prompt's array when no output
        exists yet (the common case: a new request in the queue)."""
        if self.salt is not None:
            return self.key(self.all_ids[:-1])
        if not self.output_ids:
            return self.prompt_arr[:-1]
        return np.asarray(self.all_ids[:-1], dtype=np.int64)

    def key(self, ids: list[int]) -> list[int] | np.ndarray:
        """The radix tree's key of `ids` (a prefix of all_ids): in the request's cache
        namespace when it has a salt, else the ids themselves."""
        return ids if self.salt is None else salted(ids, self.salt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Slots allocated whose KV is not written yet (prompt or recompute after preemption)."""
        return self.num_computed < len(self.slots)

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        """Output tokens this request may still generate (what admission reserves for)."""
        return self.params.max_tokens - len(self.output_ids)

    def add_placeholder(self, placeholder: int) -> None:
        """A token drawn on the device, not read yet: the next step's input all the same."""
        self.output_ids.append(placeholder)
        self.pending_tokens += 1

    def drop_placeholders(self) -> None:
        """The request ended: draws made after its last token (one step of lag) go."""
        if self.pending_tokens:
            del self.output_ids[-self.pending_tokens :]
            self.pending_tokens = 0

    def append_token(
        self, token_id: int, max_model_len: int, logprob: TokenLogprob | None = None
    ) -> None:
        """Record a sampled token (in place of its placeholder, the oldest one, if it
        has one), detokenize it and decide whether the request ends."""
        if self.pending_tokens:
            n = len(self.output_ids) - self.pending_tokens + 1  # outputs up to this one
            self.output_ids[n - 1] = token_id
            self.pending_tokens -= 1
        else:
            self.output_ids.append(token_id)
            n = len(self.output_ids)
        self.unsent_ids.append(token_id)
        if logprob is not None:
            self.unsent_logprobs.append(logprob)
        if token_id in self.stop_ids:
            # Stop tokens (eos, stop_token_ids) count as completion tokens, but their
            # text is not part of the answer.
            self.finish_reason = "stop"
            return
        piece = self.detokenizer.push(token_id)
        self.text += piece
        if self.stop_matcher is not None and piece:
            hit = self.stop_matcher.feed(piece)
            if hit is not None:
                self.text = self.text[:hit]  # the held-back tail was never sent
                self.finish_reason = "stop"
                return
        if n >= self.params.max_tokens or len(self.prompt_ids) + n >= max_model_len:
            self.finish_reason = "length"

    def take_text_delta(self) -> str:
        """Text that can be streamed now; holds back a tail that may start a stop string."""
        end = len(self.text)
        if self.finish_reason is None and self.stop_matcher is not None:
            end -= self.stop_matcher.overlap
        delta = self.text[self.sent_len : end]
        self.sent_len = max(self.sent_len, end)
        return delta

    def to_output(self) -> GenerateOutput:
        """What the client has not seen yet, plus the counts so far (takes the deltas)."""
        ids, self.unsent_ids = tuple(self.unsent_ids), []
        logprobs, self.unsent_logprobs = tuple(self.unsent_logprobs), []
        return GenerateOutput(
            request_id=self.request_id,
            text_delta=self.take_text_delta(),
            token_ids=ids,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=len(self.output_ids) - self.pending_tokens,
            finished=self.finish_reason is not None,
            finish_reason=self.finish_reason,
            index=self.index,
            logprobs=logprobs,
            queue_seconds=None if self.admitted is None else self.admitted - self.arrived,
        )
