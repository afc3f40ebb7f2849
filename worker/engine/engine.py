"""The synchronous engine: requests in, one `step()` at a time, outputs out.

    step = schedule -> run -> sample -> postprocess

Not thread-safe: `async_engine.AsyncEngine` drives it from one thread. Tests drive it
directly and call `check_integrity()` after every step.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from worker.engine.config import EngineConfig
from worker.engine.radix_cache import NoCache, PrefixCache, RadixCache
from worker.engine.runner import ModelRunner, SeqBatchItem
from worker.engine.sampler import Sampler
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.tokenizer import Tokenizer
from worker.engine.types import EngineError, EngineStats, GenerateOutput, GenerateRequest


class LLMEngine:
    """Owns the scheduler, the radix cache and the sampler around one model runner.

    `runner` needs `config` (vocab_size, max_position_embeddings, eos_token_ids),
    `pool.allocator`, `device` and `forward(items) -> logits`; `tokenizer` needs
    `encode`, `detokenizer` and `eos_token_ids` — so tests can pass fakes of both.
    """

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        config: EngineConfig,
        *,
        cache: PrefixCache | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.allocator = runner.pool.allocator
        if cache is None:
            cache_cls = NoCache if config.disable_radix_cache else RadixCache
            cache = cache_cls(self.allocator, page_size=config.page_size)
        self.cache: PrefixCache = cache
        self.scheduler = Scheduler(config, self.allocator, cache)
        self.sampler = sampler or Sampler(runner.device)
        # The override may only shorten the model's context. And a request never holds
        # more slots than the pool has: then the oldest running request can always make
        # progress, whatever else is queued.
        model_len = runner.config.max_position_embeddings
        self.max_model_len = min(
            config.max_model_len or model_len, model_len, self.allocator.capacity
        )
        self.vocab_size: int = runner.config.vocab_size
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(runner.config.eos_token_ids)
        self._seq_ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}  # in-flight requests by request_id
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.completion_tokens_total = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig) -> LLMEngine:
        runner = ModelRunner(
            model_dir,
            device=config.device,
            dtype=config.dtype,
            kv_capacity_tokens=config.kv_capacity_tokens,
            kv_memory_fraction=config.kv_memory_fraction,
            attention_backend=config.attention_backend,
            cuda_graphs=not config.disable_cuda_graph,
            max_running_requests=config.max_running_requests,
        )
        return cls(runner, Tokenizer.from_dir(model_dir), config)

    # --- requests ---

    def make_sequence(self, request: GenerateRequest) -> Sequence:
        """Validate and tokenize; reads no mutable engine state, so any thread may call it."""
        params = request.params
        params.validate()
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
                f"prompt has {len(ids)} tokens; this model's context length is "
                f"{self.max_model_len} (the prompt and at least one new token must fit)",
                param="prompt",
                code="context_length_exceeded",
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        return Sequence(
            request_id=request.request_id,
            prompt_ids=ids,
            params=params,
            detokenizer=self.tokenizer.detokenizer(),
            seq_id=next(self._seq_ids),
            stop_ids=stop_ids,
        )

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise EngineError(
                f"request id {seq.request_id!r} is already in flight", param="request_id"
            )
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, request: GenerateRequest) -> Sequence:
        seq = self.make_sequence(request)
        self.add(seq)
        return seq

    def abort(self, request_id: str) -> GenerateOutput | None:
        """Drop a request and free what it held; its final output (None if unknown)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        seq.finish_reason = "abort"
        self._retire(seq)
        return seq.to_output()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- the loop ---

    def step(self) -> list[GenerateOutput]:
        schedule = self.scheduler.schedule()
        if not schedule.items:
            return []
        logits = self.runner.forward(
            [SeqBatchItem(i.input_ids, i.start_pos, i.slots) for i in schedule.items]
        )
        sampling = [i.seq for i in schedule.items if i.samples]
        rows = [k for k, i in enumerate(schedule.items) if i.samples]
        self.scheduler.advance(schedule)
        if not sampling:
            return []
        if len(rows) < len(schedule.items):
            logits = logits[rows]
        tokens = self.sampler.sample(
            logits, [s.params for s in sampling], [s.seq_id for s in sampling]
        )
        outputs = []
        for seq, token in zip(sampling, tokens, strict=True):
            seq.append_token(token, self.max_model_len)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self._retire(seq)
            outputs.append(seq.to_output())
        return outputs

    def _retire(self, seq: Sequence) -> None:
        del self._seqs[seq.request_id]
        self.sampler.release(seq.seq_id)
        self.prompt_tokens_total += len(seq.prompt_ids)
        self.cached_tokens_total += seq.cached_tokens or 0
        self.completion_tokens_total += len(seq.output_ids)

    # --- cache, stats, invariants ---

    def flush_cache(self) -> bool:
        """Drop every cached prefix no running request holds."""
        self.cache.reset()
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            cache_capacity_tokens=self.allocator.capacity,
            cache_used_tokens=self.allocator.capacity - self.allocator.available,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            completion_tokens_total=self.completion_tokens_total,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if in_flight != len(self._seqs):
            raise AssertionError(f"{len(self._seqs)} requests tracked, {in_flight} scheduled")

    # --- input checks ---

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # A chat template's output already starts with BOS; encoding adds a second one.
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids

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
