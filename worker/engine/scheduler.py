"""Continuous batching over the radix cache, shared while requests still run.

Each step every running request that has finished its prefill decodes one token, and
prompts (only their uncached suffix) are prefilled in chunks under a per-step token
budget. Pure Python over ints, lists and numpy slot arrays: the model runner owns every
tensor, so this module is tested with a fake runner, and the `sim` backend and the
virtual-time fleet simulator run it with a cost model instead of a model.

The slots of one sequence (`req.slots`, one per token of `req.all_ids[:len(slots)]`),
described here and sliced nowhere else:

    token    0 ........... prefix_len .......... num_computed ........... len(slots)
             |    cached       |      computed        |      allocated       |
    owner    | radix tree      | this sequence        | this sequence        |
             | (path locked)   | (KV written)         | (KV not yet written) |
    admit    | match + lock    | alloc(num_tokens - prefix_len) -------------->|
    chunk    | insert(all_ids[:aligned num_computed]): the tree takes the new |
    done     | slots, frees the ones it already held (the sequence switches to|
    (prefill)| the tree's), the lock moves down: prefix_len = that length     |
    decode   |                 | first allocs one slot for its input (the last |
             |                 | sampled token), then writes its KV            |
    release  | unlock          | insert(all_ids[:num_computed],                 | free
    (finish, |                 |   slots[:num_computed], cached_len=prefix_len):|
    preempt, |                 |   the tree keeps the new slots and frees the   |
    abort)   |                 |   duplicates and the page-unaligned tail       |

Prefill chunks join the tree as soon as they are computed (SGLang's
`cache_unfinished_req`), so a request arriving while another with the same prefix is
still running reuses it. Decode tokens join at release only: inserting them each step
would cost a tree walk per token per request, and the request that would reuse an
answer (the next turn of the conversation) arrives after it finished anyway.

With a host tier (hiradix_cache.py) a match may end in host-resident nodes: admission
locks the whole matched path, makes room for them like for new tokens, and
`cache.load` gives them device slots at once (so the prefix is the tree's, locked, as
above); the copies are planned, and the engine has the runner make them before the
step's forward (host_tier.py). A host hit counts in `cached_tokens` (and
`host_cached_tokens`): it is loaded, not computed.

A decoding sequence has len(slots) == num_computed == num_tokens - 1: its last sampled
token is the next step's input. Preempted sequences keep their output tokens and, once
readmitted, recompute whatever the tree no longer holds (usually nothing: their KV
went into the tree when they were preempted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from worker.engine.admission import AdmissionRules
from worker.engine.allocator import SlotAllocator
from worker.engine.batch import Batch, BatchItem
from worker.engine.config import EngineConfig
from worker.engine.pins import PinTable
from worker.engine.prefix_cache import NoCache, PrefixCache
from worker.engine.radix_cache import RadixCache
from worker.engine.req import Req, ReqStatus


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: SlotAllocator,
        cache: PrefixCache,
        on_release: Callable[[int], None] = lambda seq_id: None,
        pins: PinTable | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.on_release = on_release  # the runner forgets a sequence that left the batch
        self.share = config.share_inflight_prefixes and not isinstance(cache, NoCache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order: the newest is preempted first
        self.admission = AdmissionRules(config, cache, share=self.share)
        self.steps = 0
        self.num_preemptions = 0
        self.waiting_prompt_tokens = 0  # prompt tokens of the queue (cost_aware reads it)
        self._slot_buffers: dict[int, np.ndarray] = {}  # seq_id -> where slots grow
        self.pins = pins  # prefixes held across tool gaps (pins.py); None: off

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        req.queued_at_step = self.steps
        self.waiting.append(req)
        self.waiting_prompt_tokens += len(req.prompt_ids)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens queued (whole prompts: a hit is known only at admission) or
        admitted but not prefilled yet."""
        running = sum(len(s.slots) - s.num_computed for s in self.running if s.is_prefilling)
        return self.waiting_prompt_tokens + running

    def schedule(self) -> Batch:
        self.steps += 1
        if self.pins is not None:
            self.pins.expire()
        out = Batch()
        # Taken before the decoders get their new slot (which makes them look prefilling).
        prefilling = [s for s in self.running if s.is_prefilling]
        for req in self._grow_decoders(out.preempted):
            self._emit(out, req, 1)
        budget = self.config.max_prefill_tokens
        for req in prefilling:
            if budget <= 0:
                break
            if req.status is ReqStatus.RUNNING:  # not just preempted
                budget -= self._add_chunk(out, req, budget)
        self.admission.after_decode(preempted=bool(out.preempted), decoded=bool(out.items))
        # Admitting right after a preemption would only thrash: memory is short.
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def advance(self, batch: Batch) -> None:
        """The runner wrote the KV of every scheduled item: prefill chunks join the tree."""
        for req, item in zip(batch.reqs, batch.items, strict=True):
            req.num_computed = item.end_pos
        if self.share:
            for req in batch.chunked:
                self._cache_unfinished(req)

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        n = req.num_computed
        self._release(req)
        req.status = ReqStatus.FINISHED
        answered = req.finish_reason in ("stop", "length")  # not aborted
        if self.pins is not None and req.pin_key is not None and req.pin_ttl and answered:
            self.pins.pin(req.pin_key, req.all_ids[:n], req.pin_ttl)

    def abort(self, req: Req) -> None:
        if req.status is ReqStatus.RUNNING:
            self.finish(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            self.waiting_prompt_tokens -= len(req.prompt_ids)
            req.status = ReqStatus.FINISHED

    # --- admission ---

    def _admit_waiting(self, out: Batch, budget: int) -> None:
        cfg = self.config
        prefilling = [s for s in self.running if s.is_prefilling]
        reserved = sum(self.admission.reserve(s) for s in self.running)
        for req in self.admission.order(self.waiting, self.steps):
            if budget <= 0 or len(self.running) >= cfg.max_running_requests:
                return
            match = self.cache.match_prefix(req.match_key)
            hit = match.prefix_len + match.host_len  # host tokens are loaded, not computed
            if self.admission.held_for_dedup(req, hit, prefilling):
                continue  # a running prefill computes its prefix: admit it after that
            self.cache.lock(match.last_node)  # both tiers: the host run stays until loaded
            need = req.num_tokens - match.prefix_len  # device slots: loads + new tokens
            reserve = self.admission.reserve(req)
            usable = self.allocator.available + self.cache.evictable_size
            if need + reserve + reserved > usable and self.pins is not None:
                # Memory pressure: pins give way (pins.py), the oldest first.
                self.pins.relieve(need + reserve + reserved - self.allocator.available)
                usable = self.allocator.available + self.cache.evictable_size
            if need + reserve + reserved > usable or not self._ensure_free(need):
                self.cache.unlock(match.last_node)
                return  # head of line waits: a finishing request frees memory
            loaded = self.cache.load(match.last_node) if match.host_len else match.slots[:0]
            req.slots = np.concatenate(
                [match.slots, loaded, self.allocator.alloc(req.num_tokens - hit)]
            )
            req.prefix_len = req.num_computed = hit
            req.last_node = match.last_node
            req.status = ReqStatus.RUNNING
            req.dirty_from = 0
            if req.cached_tokens is None:
                req.cached_tokens = min(hit, len(req.prompt_ids))
                req.host_cached_tokens = req.cached_tokens - min(
                    match.prefix_len, req.cached_tokens
                )
            if self.pins is not None and req.pin_key is not None and req.index == 0:
                # The session's next call holds the path now: its pin has done its job.
                self.pins.release(req.pin_key, "next_call")
            self.waiting.remove(req)
            self.waiting_prompt_tokens -= len(req.prompt_ids)
            self.running.append(req)
            out.admitted.append(req)
            reserved += reserve
            prefilling.append(req)
            budget -= self._add_chunk(out, req, budget)

    # --- slots ---

    def _grow_decoders(self, preempted: list[Req]) -> list[Req]:
        """One new slot per decoding sequence; preempt the newest until they fit."""
        decoders = [s for s in self.running if not s.is_prefilling]
        while decoders and not self._ensure_free(len(decoders)):
            victim = self.running.pop()
            self._release(victim)
            victim.status = ReqStatus.WAITING
            self.waiting.appendleft(victim)  # readmitted first, oldest ahead
            self.waiting_prompt_tokens += len(victim.prompt_ids)
            victim.queued_at_step = self.steps
            preempted.append(victim)
            self.num_preemptions += 1
            if victim in decoders:
                decoders.remove(victim)
        if decoders:
            new = self.allocator.alloc(len(decoders))
            for req, slot in zip(decoders, new.tolist(), strict=True):
                self._grow(req, slot)
        return decoders

    def _grow(self, req: Req, slot: int) -> None:
        """One more slot in O(1): `req.slots` is a view of a buffer that doubles when
        full (`np.append` copied every slot, per decoder per step: 29% of a sim worker's
        CPU streaming 64 x 128 tokens, py-spy). Older views cover `slots[:n]` only."""
        slots, n = req.slots, len(req.slots)
        buf = self._slot_buffers.get(req.seq_id)
        if buf is None or slots.base is not buf or len(buf) == n:  # fresh array, or full
            buf = np.empty(max(64, 2 * n), dtype=np.int64)
            buf[:n] = slots
            self._slot_buffers[req.seq_id] = buf
        buf[n] = slot
        req.slots = buf[: n + 1]

    def _ensure_free(self, n: int) -> bool:
        shortfall = n - self.allocator.available
        if shortfall > self.cache.evictable_size and self.pins is not None:
            self.pins.relieve(shortfall)
        if shortfall > 0 and self.cache.evictable_size > 0:
            self.cache.evict(max(shortfall, self.config.evict_batch_tokens))
        return self.allocator.available >= n

    def _add_chunk(self, out: Batch, req: Req, budget: int) -> int:
        n = min(len(req.slots) - req.num_computed, budget)
        self._emit(out, req, n)
        out.chunked.append(req)
        return n

    def _emit(self, out: Batch, req: Req, n: int) -> None:
        start = req.num_computed
        end = start + n
        ids, sample = req.ids(start, end), end == req.num_tokens
        item = BatchItem(ids, start, req.slots[:end], req.seq_id, req.dirty_from, sample)
        req.dirty_from = end  # the runner sees every slot up to `end` now
        out.items.append(item)
        out.reqs.append(req)

    def _cache_unfinished(self, req: Req) -> None:
        """Hand the computed, page-aligned prefix to the tree while the request runs."""
        n = req.num_computed
        limit = n - n % self.cache.page_size
        if limit <= req.prefix_len:
            return
        prompt = req.prompt_ids
        ids = prompt[:limit] if limit <= len(prompt) else req.all_ids[:limit]
        key = req.key(ids)
        had = self.cache.insert(key, req.slots[:limit], cached_len=req.prefix_len)
        match = self.cache.match_prefix(key, record=False)
        assert match.prefix_len == limit, "a just-inserted prefix must match whole"
        self.cache.lock(match.last_node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        if had > req.prefix_len:
            # The tree held [prefix_len, had) already and freed our copies: use its slots
            # (the same tokens at the same positions, so the same K/V).
            req.slots[req.prefix_len : had] = match.slots[req.prefix_len : had]
            req.dirty_from = min(req.dirty_from, req.prefix_len)
        req.prefix_len = limit
        req.last_node = match.last_node

    def _release(self, req: Req) -> None:
        """Hand the KV back: see the table at the top of this module."""
        n = req.num_computed
        if n > req.prefix_len:
            self.cache.insert(req.key(req.all_ids[:n]), req.slots[:n], cached_len=req.prefix_len)
        if n < len(req.slots):
            self.allocator.free(req.slots[n:])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.slots = req.slots[:0]
        self._slot_buffers.pop(req.seq_id, None)
        req.prefix_len = req.num_computed = req.dirty_from = 0
        req.last_node = None
        self.on_release(req.seq_id)

    # --- invariants ---

    def _check_locks(self) -> None:
        """Every node's lock count is exactly the running requests' and the pins' locks
        on the paths through it (a lock nobody holds would never be evicted)."""
        holders = [s.last_node for s in self.running if s.last_node is not None]
        if self.pins is not None:
            self.pins.check()
            holders += self.pins.locked_nodes()
        expected: dict[int, int] = {}
        for node in holders:
            while node.parent is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self.cache._nodes() if isinstance(self.cache, RadixCache) else ():
            if node.lock_ref != expected.get(id(node), 0):
                raise AssertionError(
                    f"{node!r}: lock_ref {node.lock_ref}, held by {expected.get(id(node), 0)}"
                )

    def check_integrity(self) -> None:
        """Per tier: free + cached (+ held by running, on the device) == capacity, no slot
        twice (the host tier's sum is checked by the cache: running requests hold none)."""
        self.cache.check_integrity()
        self._check_locks()
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
