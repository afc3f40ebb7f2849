"""Backends behind the one `Engine` protocol, chosen with `--engine`: both are an
`AsyncEngine` (worker/engine/async_engine.py), over our model runner (`radix`) or over a
cost model (`sim`, worker/backends/sim.py).

Torch comes in only with the radix model, in the loader `AsyncEngine.start()` runs:
the sim engine starts without torch model weights. (A stock vLLM or SGLang server
joins the fleet through `radix-worker attach` instead: worker/attach/sidecar.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from shared.config import ConfigError, WorkerConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.protocols import EngineTokenizer


def build_engine(config: WorkerConfig) -> AsyncEngine:
    """The engine `config.engine` names, not started. Cheap for `radix`: it checks the
    model folder; the weights load in `start()`."""
    if config.engine == "sim":
        return build_sim_engine(config)
    if config.model is None:
        raise ConfigError(f"model: required for --engine {config.engine} (a local model folder)")
    if not Path(config.model, "config.json").is_file():
        raise ConfigError(f"model: {config.model} is not a model folder (no config.json)")
    name = config.served_model_name or Path(config.model).name
    return AsyncEngine(radix_loader(config.model, engine_config(config)), name)


def radix_loader(model: str, config: EngineConfig) -> Callable[[], LLMEngine]:
    def load() -> LLMEngine:
        # torch comes in here, with the model, in the thread `start()` runs this in.
        from worker.engine.runtime.load import load_engine

        return load_engine(model, config)  # type: ignore[arg-type]

    return load


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
        pin_budget=config.pin_budget,
        pin_max_ttl_s=config.pin_max_ttl_s,
        pin_default_ttl_s=config.pin_default_ttl_s,
        second_chance=config.second_chance,
    )


def build_sim_engine(config: WorkerConfig) -> AsyncEngine:
    """The engine over a cost model: the model's tokenizer when `--model` is given, else
    the built-in `TextTokenizer` (no files needed)."""
    from shared.tokens.text_tokenizer import TextTokenizer

    tokenizer: EngineTokenizer
    if config.model is not None:
        from shared.tokens.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(config.model)
        name = Path(config.model).name
    else:
        tokenizer = TextTokenizer()
        name = "sim"
    engine = replace(engine_config(config), kv_capacity_tokens=config.cache_tokens or 1_000_000)
    return build_sim_async_engine(
        engine,
        tokenizer,
        config.served_model_name or name,
        max_model_len=config.max_model_len or 32_768,
        prefill_us_per_token=config.sim_prefill_us_per_token,
        decode_ms_per_token=config.sim_decode_ms_per_token,
        decode_us_per_seq=config.sim_decode_us_per_seq,
        decode_us_per_1k_context=config.sim_decode_us_per_1k_context,
    )


def build_sim_async_engine(
    config: EngineConfig, tokenizer: EngineTokenizer, model_name: str = "sim", **cost: float
) -> AsyncEngine:
    """The live `--engine sim` worker's engine: the cost is slept in the step thread."""
    from worker.backends.sim import build_sim_llm_engine

    return AsyncEngine(build_sim_llm_engine(config, tokenizer, **cost), model_name)  # type: ignore[arg-type]
