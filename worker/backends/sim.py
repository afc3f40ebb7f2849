"""`SimEngine`: the real radix cache with a cost model instead of a model.

Fleet benchmarks and load tests run this on CPU, so everything that shapes routing is
real: the RadixCache over a SlotAllocator of `cache_tokens` slots (LRU eviction in
batches, as the radix engine does), at most `max_running_requests` admitted at once
with a FIFO queue behind them, cached-prefix accounting, abort that frees. Only the
model is fake:

- cost: `prefill_us_per_token` × uncached prompt tokens, then `decode_ms_per_token`
  per output token, all `asyncio.sleep` (a zero cost still yields to the loop);
- output: exactly `max_tokens` tokens of words drawn from a generator seeded by the
  prompt's token ids (same prompt, same answer), cut short only by a stop string or
  stop token id. It never emits EOS.

A request's KV, in slots: `prefix` slots (the tree's, locked) + the uncached prompt
suffix + `max_tokens` output slots, all reserved at admission so a running request
never waits for memory. On finish or abort, prompt + output are inserted into the
tree (which frees duplicates) and unused reserved slots are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from worker.backends.sim_model import SimTokenizer, answer_ids
from worker.engine.allocator import SlotAllocator
from worker.engine.chat import ChatPrompts
from worker.engine.radix_cache import NoCache, RadixCache
from worker.engine.sequence import Sequence
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineStats,
    GenerateOutput,
    GenerateRequest,
)

REQUEST_MS_WEIGHT = 0.1  # moving mean of seat time: the last ~10 requests dominate


@dataclass(frozen=True)
class SimConfig:
    model_name: str = "sim"
    cache_tokens: int = 1_000_000
    page_size: int = 1
    max_running_requests: int = 64
    max_waiting_requests: int = 1024
    max_model_len: int = 32_768
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    evict_batch_tokens: int = 256
    disable_radix_cache: bool = False


@dataclass(eq=False)
class _Entry:
    seq: Sequence
    admitted: asyncio.Future[bool]  # True: admitted; False: aborted while waiting
    aborted: bool = False
    prefilled: bool = False
    admitted_at: float = 0.0


class SimEngine(ChatPrompts):
    def __init__(self, config: SimConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.max_model_len = config.max_model_len
        self.allocator = SlotAllocator(config.cache_tokens)
        cache_cls = NoCache if config.disable_radix_cache else RadixCache
        self.cache = cache_cls(self.allocator, config.page_size)
        self._waiting: deque[_Entry] = deque()
        self._running: dict[str, _Entry] = {}
        self._active: dict[str, _Entry] = {}  # waiting or running, by request id
        self._seq_ids = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.completion_tokens_total = 0
        self.request_ms = 0.0  # how long an admitted request holds its seat: moving mean

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for entry in list(self._active.values()):
            entry.aborted = True

    # --- requests ---

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Validates now; the request queues when the iterator is first awaited."""
        params = request.params
        params.validate()
        if request.request_id in self._active:
            raise EngineError(
                f"request id {request.request_id!r} is already in flight", "request_id"
            )
        ids = self.prompt_ids(request)
        self._check_fits(len(ids), params.max_tokens)
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"{len(self._waiting)} requests waiting; try again later")
        self._seq_ids += 1
        seq = Sequence(
            request_id=request.request_id,
            prompt_ids=ids,
            params=params,
            detokenizer=self.tokenizer.detokenizer(),
            seq_id=self._seq_ids,
            stop_ids=frozenset(params.stop_token_ids),
        )
        return self._stream(seq)

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise EngineError(
                f"prompt has {prompt_len} tokens; this model's context length is {limit} "
                "(the prompt and at least one new token must fit)",
                param="prompt",
                code="context_length_exceeded",
            )
        if prompt_len + max_tokens > limit:
            raise EngineError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if prompt_len + max_tokens > self.allocator.capacity:
            raise EngineError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV "
                f"cache ({self.allocator.capacity} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
            )

    async def _stream(self, seq: Sequence) -> AsyncIterator[GenerateOutput]:
        entry = _Entry(seq, asyncio.get_running_loop().create_future())
        self._active[seq.request_id] = entry
        self._waiting.append(entry)
        self._admit()
        try:
            if not await entry.admitted:
                seq.finish_reason = "abort"
                yield seq.to_output()
                return
            uncached = len(seq.prompt_ids) - seq.prefix_len
            await asyncio.sleep(self.config.prefill_us_per_token * uncached / 1e6)
            entry.prefilled = True
            answer = answer_ids(self.tokenizer, seq.prompt_ids, seq.params.max_tokens)
            decode_s = self.config.decode_ms_per_token / 1e3
            for token_id in answer:
                await asyncio.sleep(decode_s)
                if entry.aborted:
                    seq.finish_reason = "abort"
                else:
                    seq.append_token(token_id, self.max_model_len)
                yield seq.to_output()
                if seq.finish_reason is not None:
                    return
        finally:
            self._finish(entry)

    async def abort(self, request_id: str) -> None:
        entry = self._active.get(request_id)
        if entry is not None:
            entry.aborted = True
            if not entry.admitted.done():
                entry.admitted.set_result(False)

    # --- admission and KV bookkeeping (synchronous: no await, so no interleaving) ---

    def _admit(self) -> None:
        """Admit waiting requests in FIFO order while a batch seat and their KV are free."""
        while self._waiting and len(self._running) < self.config.max_running_requests:
            entry = self._waiting[0]
            if entry.admitted.done():  # aborted while waiting
                self._waiting.popleft()
                continue
            if not self._reserve(entry.seq):
                return  # head-of-line waits for KV; a finishing request calls _admit again
            self._waiting.popleft()
            self._running[entry.seq.request_id] = entry
            entry.admitted_at = time.monotonic()
            entry.admitted.set_result(True)

    def _reserve(self, seq: Sequence) -> bool:
        # The last prompt token is always computed (its logits give the first token).
        match = self.cache.match_prefix(seq.prompt_ids[:-1])
        self.cache.lock(match.last_node)
        need = len(seq.prompt_ids) - match.prefix_len + seq.params.max_tokens
        slots = self.allocator.alloc(need)
        if slots is None:
            shortfall = need - self.allocator.available
            self.cache.evict(max(shortfall, self.config.evict_batch_tokens))
            slots = self.allocator.alloc(need)
            if slots is None:
                self.cache.unlock(match.last_node)
                return False
        seq.slots = np.concatenate([match.slots, slots])
        seq.prefix_len = match.prefix_len
        seq.last_node = match.last_node
        seq.cached_tokens = match.prefix_len
        self.prompt_tokens_total += len(seq.prompt_ids)
        self.cached_tokens_total += match.prefix_len
        return True

    def _finish(self, entry: _Entry) -> None:
        seq = entry.seq
        self._active.pop(seq.request_id, None)
        if self._running.pop(seq.request_id, None) is None:
            if not entry.admitted.done():
                entry.admitted.set_result(False)
            with contextlib.suppress(ValueError):  # still queued: leave the queue (rare, O(n))
                self._waiting.remove(entry)
            return
        self.completion_tokens_total += len(seq.output_ids)
        held_ms = (time.monotonic() - entry.admitted_at) * 1e3
        self.request_ms += REQUEST_MS_WEIGHT * (held_ms - self.request_ms)
        # Prompt + output go into the tree (it frees what it already held); the reserved
        # but unused output slots go back to the allocator.
        n = seq.num_tokens
        self.cache.insert(seq.all_ids, seq.slots[:n], cached_len=seq.prefix_len)
        self.allocator.free(seq.slots[n:])
        self.cache.unlock(seq.last_node)
        seq.slots = seq.slots[:0]
        self._admit()

    # --- introspection ---

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests hold KV, as SGLang does."""
        if self._running:
            return False
        self.cache.reset()
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            cache_capacity_tokens=self.allocator.capacity,
            cache_used_tokens=self.allocator.capacity - self.allocator.available,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            completion_tokens_total=self.completion_tokens_total,
            queued_prefill_tokens=self._queued_prefill_tokens(),
            prefill_us_per_token=self.config.prefill_us_per_token,  # the cost model, exact
            decode_ms_per_token=self.config.decode_ms_per_token,
            max_running_requests=self.config.max_running_requests,
            request_ms=self.request_ms,
        )

    def _queued_prefill_tokens(self) -> int:
        waiting = sum(len(e.seq.prompt_ids) for e in self._waiting)
        running = sum(
            len(e.seq.prompt_ids) - e.seq.prefix_len
            for e in self._running.values()
            if not e.prefilled
        )
        return waiting + running

    def check_integrity(self) -> None:
        """Free + cached + held by running requests == every slot, each exactly once."""
        self.cache.check_integrity()
        held = [e.seq.slots[e.seq.prefix_len :] for e in self._running.values()]
        owned = np.concatenate([self.cache.cached_slots(), *held])
        self.allocator.check_integrity(owned)
