"""The `vllm` backend: vLLM's `AsyncLLM` with prefix caching, behind our Engine protocol.

vLLM is imported only in `start()` (it is an optional, heavy dependency). Prompts are
tokenized here with the model's own tokenizer and chat template (worker/engine/
tokenizer.py, the same files vLLM reads), then passed as token ids, so every backend
counts and renders prompts identically. vLLM streams text deltas
(`RequestOutputKind.DELTA`) and reports the prefix-cache hit per request in
`RequestOutput.num_cached_tokens`.

Queue and KV usage live inside vLLM's engine core; the stats report requests this
worker has in flight and the KV capacity vLLM sized, and keep our own token totals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shared.config import WorkerConfig
from worker.engine.chat import ChatPrompts
from worker.engine.tokenizer import Tokenizer
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    FinishReason,
    GenerateOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


def _model_max_len(model_dir: str) -> int:
    import json

    cfg = json.loads(Path(model_dir, "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048))


class VllmEngine(ChatPrompts):
    def __init__(self, config: WorkerConfig) -> None:
        assert config.model is not None
        self.config = config
        self.model_dir = config.model
        self.model_name = config.served_model_name or Path(config.model).name
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.max_model_len = config.max_model_len or _model_max_len(config.model)
        self._llm: Any = None
        self._inflight: set[str] = set()
        self._capacity_tokens = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.completion_tokens_total = 0

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = (
            "float32"
            if self.config.dtype == "auto" and self.config.device == "cpu"
            else self.config.dtype
        )
        args = AsyncEngineArgs(
            model=self.model_dir,
            served_model_name=[self.model_name],
            enable_prefix_caching=True,
            enforce_eager=True,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_running_requests,
            dtype=dtype,
            seed=0,
            disable_log_stats=True,
        )
        # Building the engine starts its core process and profiles memory (tens of
        # seconds): off the event loop, so /health keeps answering 503 meanwhile.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self.max_model_len = self._llm.model_config.max_model_len
        cache = self._llm.vllm_config.cache_config
        self._capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        log.info("vLLM engine up: %s, %d KV tokens", self.model_name, self._capacity_tokens)

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def generate(self, request: EngineRequest) -> AsyncIterator[GenerateOutput]:
        if self._llm is None:
            raise EngineOverloaded("the engine is not running")
        params = request.params
        params.validate(max_n=1, vocab_size=self.tokenizer.vocab_size)
        if params.needs_logprobs:  # vLLM computes them; this backend does not return them yet
            raise EngineError("logprobs are not supported by the vllm backend", "logprobs")
        if request.request_id in self._inflight:
            raise EngineError(
                f"request id {request.request_id!r} is already in flight", "request_id"
            )
        limit = self.config.max_running_requests + self.config.max_waiting_requests
        if len(self._inflight) >= limit:
            raise EngineOverloaded(f"{len(self._inflight)} requests in flight; try again later")
        ids = self.prompt_ids(request)
        if len(ids) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(ids)} tokens; this model's context length is "
                f"{self.max_model_len}", param="prompt", code="context_length_exceeded",
            )  # fmt: skip
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}", param="max_tokens",
                code="context_length_exceeded",
            )  # fmt: skip
        return self._stream(request.request_id, ids, params)

    def _sampling(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        return VllmSampling(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=max(params.top_k, 0), seed=params.seed, stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
            min_p=params.min_p, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) or None, output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip

    async def _stream(
        self, rid: str, ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        from vllm.inputs import TokensPrompt

        self._inflight.add(rid)
        finished, completion, cached = False, 0, 0
        try:
            stream = self._llm.generate(
                TokensPrompt(prompt_token_ids=ids), self._sampling(params), rid
            )
            async for out in stream:
                choice = out.outputs[0]
                completion += len(choice.token_ids)
                cached = out.num_cached_tokens or 0
                finished = out.finished
                yield GenerateOutput(
                    request_id=rid, text_delta=choice.text, token_ids=tuple(choice.token_ids),
                    prompt_tokens=len(ids), cached_tokens=cached, completion_tokens=completion,
                    finished=finished, finish_reason=_finish(choice.finish_reason) if finished else None,
                )  # fmt: skip
                if finished:
                    return
        finally:
            self._inflight.discard(rid)
            self.prompt_tokens_total += len(ids)
            self.cached_tokens_total += cached
            self.completion_tokens_total += completion
            if not finished and self._llm is not None:
                await asyncio.shield(self._llm.abort(rid))  # client gone: free its KV

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def flush_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache()) if self._llm is not None else False

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._inflight),
            waiting=0,
            cache_capacity_tokens=self._capacity_tokens,
            cache_used_tokens=0,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            completion_tokens_total=self.completion_tokens_total,
        )


def _finish(reason: str | None) -> FinishReason:
    return "length" if reason == "length" else ("abort" if reason == "abort" else "stop")
