"""The `radix` backend: our engine (worker/engine/), configured from the worker config.

Loading weights takes from seconds (the tiny model) to minutes (a real model), so the
backend loads them in `start()`, which the app runs after its port is open: meanwhile
`/health` answers 503 ("engine is starting") instead of refusing connections, which is
what Kubernetes startup probes and `radix-router up` expect.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from shared.config import ConfigError, WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.kv_blocks import BlockEvents
from worker.engine.types import EngineOverloaded, EngineRequest, EngineStats, OutputStream


def engine_config(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        max_model_len=config.max_model_len,
        page_size=config.page_size,
        kv_capacity_tokens=config.cache_tokens,
        kv_memory_fraction=config.kv_memory_fraction,
        host_cache_tokens=config.host_cache_tokens,
        host_write_policy=config.host_write_policy,
        device=config.device,
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        kv_cache_dtype=config.kv_cache_dtype,
        disable_cuda_graph=config.disable_cuda_graph,
        piecewise_cuda_graph_max_tokens=config.piecewise_cuda_graph_max_tokens,
        overlap_schedule=not config.disable_overlap_schedule,
        disable_radix_cache=config.disable_radix_cache,
        max_waiting_requests=max(1, config.max_waiting_requests),
        max_n=config.max_n,
        schedule_policy=config.schedule_policy,
        share_inflight_prefixes=config.share_inflight_prefixes,
        kv_events_block_size=config.kv_events_block_size if config.kv_events else 0,
    )


class RadixBackend:
    """`AsyncEngine` behind the Engine protocol, with its weights loaded in `start()`."""

    def __init__(self, config: WorkerConfig) -> None:
        assert config.model is not None
        if not Path(config.model, "config.json").is_file():
            raise ConfigError(f"model: {config.model} is not a model folder (no config.json)")
        self.config = config
        self.model_name = config.served_model_name or Path(config.model).name
        self._async: AsyncEngine | None = None

    @property
    def loaded(self) -> AsyncEngine:
        if self._async is None:
            # The HTTP layer refuses requests before the engine is ready; this is the
            # backstop for anything that slips through (answered 503).
            raise EngineOverloaded("the model is still loading")
        return self._async

    @property
    def engine(self) -> LLMEngine:
        """The synchronous engine (tests read its integrity while it is idle)."""
        return self.loaded.engine

    @property
    def max_model_len(self) -> int:
        return self._async.max_model_len if self._async is not None else 0

    async def start(self) -> None:
        if self._async is None:
            model, config = self.config.model, engine_config(self.config)
            # torch comes in here, with the model: the sim path (which builds its
            # EngineConfig with `engine_config` above) never imports it.
            from worker.engine.runtime.load import load_engine

            engine = await asyncio.to_thread(load_engine, model, config)  # type: ignore[arg-type]
            self._async = AsyncEngine(engine, self.model_name)
        await self._async.start()

    async def stop(self) -> None:
        if self._async is not None:
            await self._async.stop()

    def generate(self, request: EngineRequest) -> OutputStream:
        return self.loaded.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.loaded.abort(request_id)

    async def flush_cache(self) -> bool:
        return await self.loaded.flush_cache()

    def stats(self) -> EngineStats:
        if self._async is None:
            return EngineStats(0, 0, 0, 0, 0, 0, 0)
        return self._async.stats()

    @property
    def kv_events(self) -> BlockEvents | None:
        return None if self._async is None else self._async.kv_events

    def tokenize(self, text: str) -> list[int]:
        return self.loaded.tokenize(text)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        return self.loaded.token_bytes(ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return self.loaded.apply_chat_template(messages, add_generation_prompt)


def build_radix_engine(config: WorkerConfig) -> RadixBackend:
    """Cheap: checks the model folder; the weights load in `start()`."""
    return RadixBackend(config)
