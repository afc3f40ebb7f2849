"""The `radix` backend: our engine (worker/engine/), configured from the worker config."""

from __future__ import annotations

from pathlib import Path

from shared.config import ConfigError, WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig


def engine_config(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        max_model_len=config.max_model_len,
        page_size=config.page_size,
        kv_capacity_tokens=config.cache_tokens,
        kv_memory_fraction=config.kv_memory_fraction,
        device=config.device,
        dtype=config.dtype,
        disable_radix_cache=config.disable_radix_cache,
        max_waiting_requests=max(1, config.max_waiting_requests),
    )


def build_radix_engine(config: WorkerConfig) -> AsyncEngine:
    """Loads the model (blocking; call it off the event loop for big models)."""
    assert config.model is not None
    if not Path(config.model, "config.json").is_file():
        raise ConfigError(f"model: {config.model} is not a model folder (no config.json)")
    engine = AsyncEngine(config.model, engine_config(config))
    if config.served_model_name:
        engine.model_name = config.served_model_name
    return engine
