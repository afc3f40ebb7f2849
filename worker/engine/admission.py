"""Who gets admitted next, and how much memory an admission must leave for outputs.

Three rules, as SGLang's scheduler has them:

- **Order**: by `priority` first (lower earlier: vLLM's, which the router's classes map
  to, shared/wire/service_class.py), then by `schedule_policy`: `fcfs`, or `lpm`
  (longest cached prefix first), which serves the requests whose prefix is in the tree
  before it is evicted. Over
  `lpm_max_waiting` queued requests lpm falls back to fcfs (a tree match per waiting
  request per step costs more than it saves, SGLang's cut-off too), and a request
  queued for `max_queue_wait_steps` steps goes first whatever its match: nothing
  starves.
- **Output reservation**: a request is admitted only if its uncached prompt plus an
  estimate of every running request's remaining output fits in free + evictable
  memory. The estimate is `new_token_ratio` x the tokens each may still generate
  (capped per request); the ratio starts at `init_new_token_ratio`, decays linearly to
  `min_new_token_ratio` over `new_token_ratio_decay_steps` decode steps while nothing
  is preempted, and is reset to its start after a preemption. Preemption is then the
  rare case, not how memory is managed.
- **In-batch prefix dedup**: a waiting request that shares more than
  `inbatch_dedup_min_tokens` uncached tokens with a request now prefilling is held
  back; that prefill enters the tree chunk by chunk (in-flight sharing), and the held
  request then hits it instead of computing the same prefix again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

from worker.engine.config import EngineConfig
from worker.engine.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from worker.engine.req import Req

# Waiting requests looked at per step: enough to skip past held ones, bounded so a
# queue of thousands costs nothing per step.
_SCAN = 256
_PRIORITY = attrgetter("priority")


class AdmissionRules:
    def __init__(self, config: EngineConfig, cache: PrefixCache, share: bool) -> None:
        self.config = config
        self.cache = cache
        dedup = config.inbatch_dedup_min_tokens
        self.dedup_min = max(dedup, cache.page_size) if share and dedup else 0  # 0: off
        self.new_token_ratio = config.init_new_token_ratio
        self._decay = (
            config.init_new_token_ratio - config.min_new_token_ratio
        ) / config.new_token_ratio_decay_steps

    def after_decode(self, preempted: bool, decoded: bool) -> None:
        if preempted:
            self.new_token_ratio = self.config.init_new_token_ratio
        elif decoded:
            floor = self.config.min_new_token_ratio
            self.new_token_ratio = max(floor, self.new_token_ratio - self._decay)

    def reserve(self, req: Req) -> int:
        """Slots kept free for `req`'s future output tokens (at least its next one)."""
        remaining = min(req.remaining_tokens, self.config.max_reserved_tokens_per_request)
        return max(1, math.ceil(remaining * self.new_token_ratio))

    def order(self, waiting: Iterable[Req], step: int) -> list[Req]:
        """The waiting requests in the order to try them (a copy: admission edits the queue)."""
        cfg = self.config
        if cfg.schedule_policy == "fcfs":
            return sorted(itertools.islice(waiting, _SCAN), key=_PRIORITY)  # stable
        queue = list(itertools.islice(waiting, cfg.lpm_max_waiting + 1))
        if len(queue) > cfg.lpm_max_waiting:
            return sorted(queue[:_SCAN], key=_PRIORITY)
        aged = [s for s in queue if step - s.queued_at_step >= cfg.max_queue_wait_steps]
        fresh = [s for s in queue if step - s.queued_at_step < cfg.max_queue_wait_steps]
        hits = {}
        for s in fresh:  # a host-resident prefix counts: it is loaded, not computed
            m = self.cache.match_prefix(s.match_key, record=False)
            hits[s.seq_id] = m.prefix_len + m.host_len
        aged.sort(key=_PRIORITY)
        # Stable: equal priorities and matches keep queue order.
        fresh.sort(key=lambda s: (s.priority, -hits[s.seq_id]))
        return aged + fresh

    def held_for_dedup(self, req: Req, matched: int, prefilling: list[Req]) -> bool:
        """Does a running prefill compute more than `dedup_min` of req's uncached prefix?"""
        need = self.dedup_min
        if need <= 0:
            return False
        arr = req.prompt_arr
        for other in prefilling:
            theirs = other.prompt_arr
            n = min(len(arr), len(theirs))
            if n - matched < need:
                continue
            neq = arr[:n] != theirs[:n]
            common = int(neq.argmax()) if neq.any() else n
            if common - matched >= need:
                return True
        return False
