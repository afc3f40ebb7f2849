"""Continuous batching over the radix cache.

Each step every running request that has finished its prefill decodes one token, and
prompts (only their uncached suffix) are prefilled in chunks under a per-step token
budget. Pure Python over ints, lists and numpy slot arrays: the model runner owns every
tensor, so this module is tested with a fake runner.

The slots of one sequence (`seq.slots`, one per token of `seq.all_ids[:len(slots)]`),
described here and sliced nowhere else:

    token    0 ........... prefix_len .......... num_computed ........... len(slots)
             |    cached       |      computed        |      allocated       |
    owner    | radix tree      | this sequence        | this sequence        |
             | (path locked)   | (KV written)         | (KV not yet written) |
    admit    | match + lock    | alloc(num_tokens - prefix_len) -------------->|
    step     |                 | a prefill chunk or a decode writes KV, so      |
             |                 | num_computed grows; a decode first allocs one  |
             |                 | slot for its input (the last sampled token)    |
    release  | unlock          | insert(all_ids[:num_computed],                 | free
    (finish, |                 |   slots[:num_computed], cached_len=prefix_len):|
    preempt, |                 |   the tree keeps the new slots and frees the   |
    abort)   |                 |   duplicates and the page-unaligned tail       |

A decoding sequence has len(slots) == num_computed == num_tokens - 1: its last sampled
token is the next step's input. Preempted sequences keep their output tokens and, once
readmitted, recompute whatever the tree no longer holds.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from worker.engine.allocator import SlotAllocator
from worker.engine.config import EngineConfig
from worker.engine.radix_cache import PrefixCache
from worker.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledItem:
    """One sequence's share of a step: `input_ids` at positions start_pos.. ."""

    seq: Sequence
    input_ids: list[int]
    start_pos: int
    slots: np.ndarray  # slots of tokens 0 .. start_pos + len(input_ids) - 1

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.input_ids)

    @property
    def samples(self) -> bool:
        """The last chunk of a prefill, or a decode: its logits give the next token."""
        return self.end_pos == self.seq.num_tokens


@dataclass
class Schedule:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: SlotAllocator, cache: PrefixCache) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Schedule:
        out = Schedule()
        # Taken before the decoders get their new slot (which makes them look prefilling).
        prefilling = [s for s in self.running if s.is_prefilling]
        decoders = self._grow_decoders(out.preempted)
        for seq in decoders:
            out.items.append(ScheduledItem(seq, [seq.last_token], seq.num_computed, seq.slots))
        budget = self.config.max_prefill_tokens
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is SeqStatus.RUNNING:  # not just preempted
                budget -= self._add_chunk(out, seq, budget)
        # Admitting right after a preemption would only thrash: memory is short.
        while (
            not out.preempted
            and budget > 0
            and self.waiting
            and len(self.running) < self.config.max_running_requests
            and self._admit(self.waiting[0])
        ):
            seq = self.waiting.popleft()
            if seq.admitted is None:
                seq.admitted = time.monotonic()
            self.running.append(seq)
            budget -= self._add_chunk(out, seq, budget)
        return out

    def advance(self, schedule: Schedule) -> None:
        """The runner wrote the KV of every scheduled item."""
        for item in schedule.items:
            item.seq.num_computed = item.end_pos

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def abort(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.finish(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED

    # --- slots ---

    def _grow_decoders(self, preempted: list[Sequence]) -> list[Sequence]:
        """One new slot per decoding sequence; preempt the newest until they fit."""
        decoders = [s for s in self.running if not s.is_prefilling]
        while decoders and not self._ensure_free(len(decoders)):
            victim = self.running.pop()
            self._release(victim)
            victim.status = SeqStatus.WAITING
            self.waiting.appendleft(victim)  # readmitted first, oldest ahead
            preempted.append(victim)
            self.num_preemptions += 1
            if victim in decoders:
                decoders.remove(victim)
        if decoders:
            new = self.allocator.alloc(len(decoders))
            for seq, slot in zip(decoders, new, strict=True):
                seq.slots = np.append(seq.slots, slot)
        return decoders

    def _admit(self, seq: Sequence) -> bool:
        tokens = seq.all_ids
        # Leave at least one token to run: its logits give the next token.
        match = self.cache.match_prefix(tokens[:-1])
        self.cache.lock(match.last_node)
        need = len(tokens) - match.prefix_len
        # Keep one decode slot per running request (and this one) for the next step, or
        # the admission would be undone by a preemption right away.
        if not self._ensure_free(need + len(self.running) + 1):
            self.cache.unlock(match.last_node)
            return False
        seq.slots = np.concatenate([match.slots[: match.prefix_len], self.allocator.alloc(need)])
        seq.prefix_len = seq.num_computed = match.prefix_len
        seq.last_node = match.last_node
        seq.status = SeqStatus.RUNNING
        if seq.cached_tokens is None:
            seq.cached_tokens = min(match.prefix_len, len(seq.prompt_ids))
        return True

    def _ensure_free(self, n: int) -> bool:
        shortfall = n - self.allocator.available
        if shortfall > 0 and self.cache.evictable_size > 0:
            self.cache.evict(max(shortfall, self.config.evict_batch_tokens))
        return self.allocator.available >= n

    def _add_chunk(self, out: Schedule, seq: Sequence, budget: int) -> int:
        n = min(len(seq.slots) - seq.num_computed, budget)
        end = seq.num_computed + n
        ids = seq.all_ids[seq.num_computed : end]
        out.items.append(ScheduledItem(seq, ids, seq.num_computed, seq.slots[:end]))
        return n

    def _release(self, seq: Sequence) -> None:
        """Hand the KV back: see the table at the top of this module."""
        n = seq.num_computed
        if n > seq.prefix_len:
            self.cache.insert(seq.all_ids[:n], seq.slots[:n], cached_len=seq.prefix_len)
        if n < len(seq.slots):
            self.allocator.free(seq.slots[n:])
        if seq.last_node is not None:
            self.cache.unlock(seq.last_node)
        seq.slots = seq.slots[:0]
        seq.prefix_len = seq.num_computed = 0
        seq.last_node = None

    # --- invariants ---

    def check_integrity(self) -> None:
        """free + cached + held by running == capacity, no slot twice."""
        self.cache.check_integrity()
        cached = np.asarray(self.cache.cached_slots(), dtype=np.int64)
        held = [s.slots[s.prefix_len :] for s in self.running]
        owned = np.concatenate([cached, *held])
        if len(np.unique(owned)) != len(owned):
            raise AssertionError("a slot is owned twice (cache and/or running requests)")
        if self.allocator.available + len(owned) != self.allocator.capacity:
            raise AssertionError(
                f"free {self.allocator.available} + cached {len(cached)} + held "
                f"{len(owned) - len(cached)} != capacity {self.allocator.capacity}"
            )
        self.allocator.check_integrity(owned)
        for s in self.running:
            if not s.prefix_len <= s.num_computed <= len(s.slots) <= s.num_tokens:
                raise AssertionError(f"bad KV counters for {s.request_id}")
            if len(s.slots) < s.num_tokens - 1:
                raise AssertionError(f"{s.request_id} lacks slots for its tokens")
            if not np.isin(s.slots[: s.prefix_len], cached).all():
                raise AssertionError(f"{s.request_id}'s prefix is not held by the cache")
        for s in self.waiting:
            if len(s.slots) or s.last_node is not None:
                raise AssertionError(f"waiting {s.request_id} holds KV")
