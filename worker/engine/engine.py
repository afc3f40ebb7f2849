"""The engine: requests in, one `step()` at a time, outputs out.

    step = schedule -> launch (the runner's forward, the sampler's draws) -> postprocess

With overlap scheduling (`EngineConfig.overlap_schedule`, SGLang's default) a step
launches step N+1 and then postprocesses step N, whose draws were read back while
N+1 ran:

    host    schedule N+1 | launch N+1 | read N, postprocess N (stop, detokenize, stream)
    device  .. N ........| N+1 ............................................| N+2 ...

Step N's tokens are placeholders on the host until then (runtime/futures.py): N+1's input
ids hold them and the device swaps in the drawn ids. So a request that ended in step
N decodes once more in N+1, and that token is dropped. Steps whose requests need
their own output ids on the host to sample (penalties) read the previous step first.
The cost-model runner of the sim backend has no futures: it always runs in order.

The runner is the model (`runner.ModelRunner`) or a cost model (the `sim` backend's
`CostModelRunner`): the scheduler, radix cache and allocator are the same code for
both. Not thread-safe: `async_engine.AsyncEngine` drives it from one thread. Tests
drive it directly and call `check_integrity()` after every step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.tokens.prompt_tokens import encode_prompt
from worker.engine.allocator import SlotAllocator
from worker.engine.batch import Batch
from worker.engine.config import EngineConfig
from worker.engine.hiradix_cache import HiRadixCache
from worker.engine.host_tier import HostTier
from worker.engine.kv_blocks import BlockEvents
from worker.engine.pins import PinTable
from worker.engine.prefix_cache import NoCache, PrefixCache
from worker.engine.protocols import EngineTokenizer, Runner, Sampler
from worker.engine.radix_cache import RadixCache
from worker.engine.req import Req
from worker.engine.salt import SaltNames, salt_tag
from worker.engine.scheduler import Scheduler
from worker.engine.types import (
    EngineError,
    EngineRequest,
    EngineStats,
    GenerateOutput,
    TokenLogprob,
)

REQUEST_MS_WEIGHT = 0.1  # moving mean of seat time: the last ~10 requests dominate


class LLMEngine:
    """Owns the scheduler, the radix cache and the allocator around one runner.

    `runner` needs `config` (vocab_size, max_position_embeddings, eos_token_ids),
    `capacity` (KV slots), `forward(items)` and `release(seq_id)`; `sampler` needs
    `sample(logits, reqs) -> [(token, TokenLogprob | None)]` and `release(seq_id)`;
    `tokenizer` needs `encode` and `detokenizer` — so tests can pass fakes of all three.
    """

    def __init__(
        self,
        runner: Runner,
        tokenizer: EngineTokenizer,
        config: EngineConfig,
        sampler: Sampler,
        *,
        cache: PrefixCache | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.allocator = SlotAllocator(runner.capacity)
        if cache is None:
            if config.disable_radix_cache:
                cache = NoCache(self.allocator, page_size=config.page_size)
            else:
                # The runner owns the host pool's memory (it sized and allocated it).
                host_capacity = getattr(runner, "host_capacity", 0)
                write_through = config.host_write_policy == "write_through"
                chance = int(config.second_chance * self.allocator.capacity)
                if host_capacity:
                    host = HostTier(host_capacity, write_through)
                    cache = HiRadixCache(self.allocator, host, config.page_size, chance)
                else:
                    cache = RadixCache(self.allocator, config.page_size, chance)
        self.cache: PrefixCache = cache
        self.salt_names = SaltNames()  # cache namespaces' salts, named in KV events
        self.kv_events: BlockEvents | None = None  # drained by the worker's publisher
        if config.kv_events_block_size and isinstance(cache, RadixCache):
            self.kv_events = BlockEvents(config.kv_events_block_size, salts=self.salt_names)
            cache.publish_events(self.kv_events)
        pins = None
        if isinstance(cache, RadixCache) and config.pin_budget > 0:
            budget = int(config.pin_budget * self.allocator.capacity)
            pins = PinTable(cache, budget, config.pin_max_ttl_s, clock)
        self.scheduler = Scheduler(
            config, self.allocator, cache, on_release=runner.release, pins=pins
        )
        # The override may only shorten the model's context. And a request never holds
        # more slots than the pool has: then the oldest running request can always make
        # progress, whatever else is queued.
        model_len = runner.config.max_position_embeddings
        self.max_model_len = min(
            config.max_model_len or model_len, model_len, self.allocator.capacity
        )
        self.vocab_size: int = runner.config.vocab_size
        eos = getattr(tokenizer, "eos_token_ids", ())
        self.eos_ids = frozenset(eos) | frozenset(runner.config.eos_token_ids)
        self._seq_ids = itertools.count()
        self.in_flight: dict[str, list[Req]] = {}  # in-flight requests (their n choices) by id
        self.last_batch = Batch()  # what the last step ran (the simulator and tests read it)
        # Overlap needs a runner that keeps draws on the device and a sampler that
        # launches without reading back (the model's; not the sim's cost model).
        self.overlap = (
            config.overlap_schedule and hasattr(runner, "futures") and hasattr(sampler, "launch")
        )
        if hasattr(runner, "overlap_inputs"):  # engines may share a runner (GPU check)
            runner.overlap_inputs = self.overlap
        self._launched: _Launched | None = None  # the step whose draws are unread
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.host_cached_tokens_total = 0  # of them, loaded from the host tier
        self.completion_tokens_total = 0
        self.request_ms = 0.0  # how long an admitted request holds its seat: moving mean

    # --- requests ---

    def make_reqs(self, request: EngineRequest) -> list[Req]:
        """Validate and tokenize (one Req per choice); reads no mutable engine state,
        so any thread may call it."""
        params = request.params
        params.validate(max_n=self.config.max_n, vocab_size=self.vocab_size)
        if any(not s for s in params.stop):
            raise EngineError("stop strings must not be empty", param="stop")
        if (request.prompt is None) == (request.prompt_token_ids is None):
            raise EngineError("give exactly one of prompt or prompt_token_ids", param="prompt")
        if request.prompt is not None:
            if not request.prompt:
                raise EngineError("prompt is empty", param="prompt")
            ids = self.encode_prompt(request.prompt)
        else:
            ids = self._check_ids(request.prompt_token_ids, "prompt")
        if not ids:
            raise EngineError("prompt is empty", param="prompt")
        self._check_ids(params.stop_token_ids, "stop_token_ids")
        if len(ids) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(ids)} tokens; {self._context()} is {self.max_model_len} "
                "(the prompt and at least one new token must fit)",
                param="prompt",
                code="context_length_exceeded",
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"{self._context()}, {self.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        salt = None
        if request.cache_salt is not None:
            if not request.cache_salt:  # vLLM's rule and words
                raise EngineError(
                    "Parameter 'cache_salt' must be a non-empty string if provided.",
                    param="cache_salt",
                )
            salt = salt_tag(request.cache_salt)
            self.salt_names.name(salt, request.cache_salt)
        return [
            Req(
                request_id=request.request_id,
                prompt_ids=ids,
                params=params,
                detokenizer=self.tokenizer.detokenizer(),
                seq_id=next(self._seq_ids),
                stop_ids=stop_ids,
                index=i,
                salt=salt,
                priority=request.priority,
                pin_key=request.cache_key or (request.request_id if request.pin_ttl else None),
                pin_ttl=request.pin_ttl if i == 0 else 0.0,  # one pin per prompt
            )
            for i in range(params.n)
        ]

    def add(self, reqs: list[Req]) -> None:
        rid = reqs[0].request_id
        if rid in self.in_flight:
            raise EngineError(f"request id {rid!r} is already in flight", param="request_id")
        self.in_flight[rid] = reqs
        for req in reqs:
            self.scheduler.add(req)

    def add_request(self, request: EngineRequest) -> list[Req]:
        reqs = self.make_reqs(request)
        self.add(reqs)
        return reqs

    def abort(self, request_id: str) -> list[GenerateOutput]:
        """Drop a request and free what it held; the final output of each unfinished choice."""
        outputs = []
        for req in list(self.in_flight.get(request_id, ())):
            if req.is_finished:
                continue
            self.scheduler.abort(req)
            req.drop_placeholders()  # a draw not read yet is never sent
            req.finish_reason = "abort"
            self._retire(req)
            outputs.append(req.to_output())
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None

    # --- the loop ---

    def step(self) -> list[GenerateOutput]:
        """Schedule and launch a step; the outputs of the step whose draws are read
        now: this one (in order), or the one before it (overlap)."""
        try:
            return self._step()
        except BaseException:
            self._launched = None  # its requests are failed by the caller (async_engine)
            raise

    def _step(self) -> list[GenerateOutput]:
        outputs: list[GenerateOutput] = []
        before = self._launched
        if before is not None and before.needs_host_ids:
            outputs, before = self._postprocess(before), None  # penalties count real ids
        batch = self.last_batch = self.scheduler.schedule()
        self._stamp_admitted(batch.admitted)
        copies = self.cache.take_copies()
        if copies is not None:  # the step's write-backs and loads: before its forward
            self.runner.copy_kv(copies)  # (on CUDA ordered after the step still running)
        self._launched = self._launch(batch) if batch.items else None
        if before is not None:
            outputs += self._postprocess(before)  # while the device runs this step
        if not self.overlap and self._launched is not None:
            outputs += self._postprocess(self._launched)
            self._launched = None
        return outputs

    def _launch(self, batch: Batch) -> _Launched:
        logits = self.runner.forward(batch.items)  # rows for the sampled items only
        sampled = batch.sampled
        if not hasattr(self.sampler, "launch"):  # a sampler that answers at once (sim)
            ready = _Ready(self.sampler.sample(logits, sampled))
            self.scheduler.advance(batch)
            return _Launched(sampled, ready, False)
        drawn = self.sampler.launch(logits, sampled)
        self.scheduler.advance(batch)
        if self.overlap and sampled:
            futures = self.runner.futures
            start = futures.take(len(sampled))
            futures.publish(start, drawn.ids)
            for i, req in enumerate(sampled):
                req.add_placeholder(-(start + i + 1))
        penalized = any(s.params.penalized for s in sampled)
        return _Launched(sampled, drawn, penalized)

    def _postprocess(self, launched: _Launched) -> list[GenerateOutput]:
        """Read a launched step's draws (the host waits for that step only) and hand
        each request its token: stop checks, detokenizing, the output to stream."""
        outputs = []
        for req, (token, logprob) in zip(launched.reqs, launched.drawn.result(), strict=True):
            if req.is_finished:
                continue  # aborted, or ended the step before (overlap's one extra step)
            req.append_token(token, self.max_model_len, logprob)
            if req.finish_reason is not None:
                req.drop_placeholders()
                self.scheduler.abort(req)  # running, or queued again by a preemption
                self._retire(req)
            outputs.append(req.to_output())
        return outputs

    def _stamp_admitted(self, reqs: list[Req]) -> None:
        now = self.clock()
        for req in reqs:
            if req.admitted is None:  # not a readmission after a preemption
                req.admitted = now

    def _retire(self, req: Req) -> None:
        self.sampler.release(req.seq_id)
        if req.admitted is not None:
            held_ms = (self.clock() - req.admitted) * 1e3
            self.request_ms += REQUEST_MS_WEIGHT * (held_ms - self.request_ms)
        self.completion_tokens_total += len(req.output_ids)
        if req.index == 0:  # the prompt is one, however many choices share it
            self.prompt_tokens_total += len(req.prompt_ids)
            self.cached_tokens_total += req.cached_tokens or 0
            self.host_cached_tokens_total += req.host_cached_tokens
        choices = self.in_flight[req.request_id]
        if all(s.is_finished for s in choices):
            del self.in_flight[req.request_id]

    # --- cache, stats, invariants ---

    def flush_cache(self) -> bool:
        """Drop every cached prefix no running request holds."""
        self.cache.reset()
        return True

    def release_pin(self, key: str) -> bool:
        """Release the pin held under `key` (a session the router moved elsewhere:
        worker/engine/pins.py); whether there was one."""
        pins = self.scheduler.pins
        return pins is not None and pins.release(key, "moved")

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_capacity_tokens=self.allocator.capacity,
            kv_used_tokens=self.allocator.capacity - self.allocator.available,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            completion_tokens_total=self.completion_tokens_total,
            preemptions_total=self.scheduler.num_preemptions,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            # A cost-model runner knows its costs exactly; a model runner reports none.
            prefill_us_per_token=getattr(self.runner, "prefill_us_per_token", 0.0),
            decode_ms_per_token=getattr(self.runner, "decode_ms_per_token", 0.0),
            max_running_requests=self.config.max_running_requests,
            request_ms=self.request_ms,
            kv_block_size=self.kv_events.block_size if self.kv_events is not None else 0,
            pins=len(pins) if (pins := self.scheduler.pins) is not None else 0,
            pinned_tokens=pins.pinned_tokens if pins is not None else 0,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict[str, Any]:
        if not isinstance(self.cache, HiRadixCache):
            return {}
        host = self.cache.host
        return {
            "host_kv_capacity_tokens": host.capacity,
            "host_kv_used_tokens": host.used,
            "host_cached_tokens_total": self.host_cached_tokens_total,
            "host_load_tokens_total": host.loaded_tokens,
            "host_write_tokens_total": host.written_tokens,
            "host_load_bytes_per_s": getattr(self.runner, "host_load_bytes_per_s", 0.0),
            "kv_bytes_per_token": getattr(self.runner, "kv_bytes_per_token", 0),
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        tracked = sum(not s.is_finished for reqs in self.in_flight.values() for s in reqs)
        if in_flight != tracked:
            raise AssertionError(f"{tracked} choices tracked, {in_flight} scheduled")

    # --- input checks ---

    def encode_prompt(self, text: str) -> list[int]:
        # shared/: the router computes the same ids for its block index (issue 26).
        return encode_prompt(self.tokenizer, text)

    def _context(self) -> str:
        if self.max_model_len == self.allocator.capacity:
            return "the context length (what this worker's KV cache holds)"
        return "this model's context length"

    def _check_ids(self, ids: Any, param: str) -> list[int]:
        out = list(ids)
        for t in out:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise EngineError(f"{param} must be integers, got {t!r}", param=param)
            if not 0 <= t < self.vocab_size:
                raise EngineError(
                    f"token id {t} in {param} is outside the vocabulary [0, {self.vocab_size})",
                    param=param,
                )
        return [int(t) for t in out]


class _Ready:
    """Draws already on the host (a sampler without `launch`)."""

    def __init__(self, tokens: list[tuple[int, TokenLogprob | None]]) -> None:
        self.tokens = tokens

    def result(self) -> list[tuple[int, TokenLogprob | None]]:
        return self.tokens


@dataclass
class _Launched:
    """A step on the device: its sampled requests, in batch order, and their draws."""

    reqs: list[Req]
    drawn: Any  # `sampler.Sampled` or `_Ready`: `result()` -> [(token, logprob)]
    # Its requests need their real ids on the host before they sample again.
    needs_host_ids: bool
