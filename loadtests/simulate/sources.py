"""Requests for the fleet simulation: token ids for the worker, text for the router.

- Mooncake trace: each block id becomes `block_words` token ids of its own (unique per
  block, so equal leading blocks are exactly a shared prefix) and the same block's
  words as text. A fleet of N workers replays `ceil(N / workers_per_copy)` copies of
  the trace, each with its own block-id namespace and a random phase, so load per
  worker and reuse per worker stay the same as the fleet grows.
- Generated workloads (`shared_prefix`, `rag`): the generator's requests with Poisson
  arrivals at `rate` req/s; the text is split into words, one token id per word.
- `multi_turn` is closed loop: `users` simulated users each keep a conversation
  (loadtests.load.workloads.ConversationSession); a turn is sent when the last one ends.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from loadtests.load.workloads import VOCAB, Workload, read_trace
from loadtests.options import WorkloadOptions

_M64 = (1 << 64) - 1
_OUT_BASE = 1 << 56  # output token ids: unique per request, never equal to a prompt id


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    text: str
    tokens: np.ndarray
    out_len: int


class WordTokenizer:
    """One id per whitespace-separated word: deterministic, and a text that extends
    another at a word boundary gets ids that extend the other's ids."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> np.ndarray:
        ids = self._ids
        return np.fromiter((ids.setdefault(w, len(ids)) for w in text.split()), dtype=np.int64)


def output_tokens(rid: int, n: int) -> np.ndarray:
    start = _OUT_BASE + rid * 65_536
    return np.arange(start, start + n, dtype=np.int64)


def _mix(x: int) -> int:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Blocks:
    """Words of a namespaced block id, from a cheap deterministic mix (no RNG object per block)."""

    def __init__(self, seed: int, block_words: int) -> None:
        self.block_words = block_words
        self._seed = seed
        self._offsets = np.arange(block_words, dtype=np.int64)
        self._cache: dict[int, str] = {}

    def text(self, block: int) -> str:
        got = self._cache.get(block)
        if got is None:
            if len(self._cache) > 400_000:  # bounded: copies of the trace never share blocks
                self._cache.clear()
            h = _mix(block ^ (self._seed << 48))
            n = len(VOCAB)
            got = " ".join(VOCAB[_mix(h + j) % n] for j in range(self.block_words))
            got += " "
            self._cache[block] = got
        return got

    def tokens(self, blocks: list[int], n: int) -> np.ndarray:
        arr = np.asarray(blocks, dtype=np.int64)[:, None] * self.block_words + self._offsets
        return arr.ravel()[:n]


def mooncake_requests(
    o: WorkloadOptions, workers: int, workers_per_copy: int, speedup: float, seed: int
) -> Iterator[SimRequest]:
    """The trace, `ceil(workers / workers_per_copy)` times over, merged in arrival order."""
    trace = read_trace(o.trace, o.trace_limit)
    copies = max(1, math.ceil(workers / workers_per_copy))
    span = max(float(r["timestamp"]) for r in trace) / 1000.0 / speedup or 1.0  # type: ignore[arg-type]
    rng = random.Random(seed)
    phases = [0.0] + [rng.uniform(0, span) for _ in range(copies - 1)]
    blocks = _Blocks(o.seed, o.block_words)

    def one_copy(c: int) -> Iterator[tuple[float, int, int]]:
        # (arrival, copy, line): shifted by the copy's phase, wrapped around the trace span.
        times = [(float(r["timestamp"]) / 1000.0 / speedup + phases[c]) % span for r in trace]  # type: ignore[arg-type]
        return iter(sorted((t, c, i) for i, t in enumerate(times)))

    for t, c, i in heapq.merge(*(one_copy(c) for c in range(copies))):
        rec = trace[i]
        ids = [c << 32 | int(b) for b in rec["hash_ids"]]  # type: ignore[union-attr]
        n = max(2, math.ceil(int(rec["input_length"]) * o.block_words / 512))  # type: ignore[call-overload]
        out = max(1, int(rec.get("output_length", o.output_len)))  # type: ignore[call-overload]
        if o.max_output is not None:
            out = min(out, o.max_output)
        text = "".join(blocks.text(b) for b in ids)
        yield SimRequest(t, text, blocks.tokens(ids, n), out)


def generated_requests(o: WorkloadOptions, rate: float, seed: int) -> Iterator[SimRequest]:
    """An open-loop generator's requests, Poisson arrivals at `rate` req/s."""
    tok = WordTokenizer()
    rng = random.Random(seed)
    t = 0.0
    for req in Workload(o).requests():
        t += rng.expovariate(rate)
        text = req.text()
        yield SimRequest(t, text, tok.encode(text), req.max_tokens)


def reply_text(rid: int, n: int) -> str:
    """A simulated assistant reply of `n` words (multi-turn sends it back next turn)."""
    rng = random.Random(rid)
    return " ".join(rng.choices(VOCAB, k=n))
