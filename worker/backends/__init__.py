"""Backends behind the one `Engine` protocol, chosen with `--engine`.

Each is imported only when chosen: the sim engine must start without torch model
weights. (A stock vLLM or SGLang server joins the fleet through `radix-worker attach`
instead: worker/attach/sidecar.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shared.config import ConfigError, WorkerConfig
from worker.engine.types import Engine

if TYPE_CHECKING:
    from worker.engine.protocols import EngineTokenizer


def build_engine(config: WorkerConfig) -> Engine:
    """The engine `config.engine` names, built (and its model loaded) but not started."""
    if config.engine == "sim":
        return build_sim_engine(config)
    if config.model is None:
        raise ConfigError(f"model: required for --engine {config.engine} (a local model folder)")
    from worker.backends.radix import build_radix_engine

    return build_radix_engine(config)


def build_sim_engine(config: WorkerConfig) -> Engine:
    """The engine over a cost model (worker/backends/sim.py): the model's tokenizer when
    `--model` is given, else the built-in `TextTokenizer` (no files needed)."""
    from dataclasses import replace

    from shared.tokens.text_tokenizer import TextTokenizer
    from worker.backends.radix import engine_config
    from worker.backends.sim import build_sim_async_engine

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
