"""`load_engine`: the engine over a model folder, its runner and sampler on the device.

Here, under `runtime/`, because it imports torch; the engine itself (`worker/engine/`)
never does, and the sim path never calls this.
"""

from __future__ import annotations

from pathlib import Path

from shared.tokens.tokenizer import Tokenizer
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.runner import ModelRunner
from worker.engine.runtime.sampler import TorchSampler


def load_engine(model_dir: str | Path, config: EngineConfig) -> LLMEngine:
    runner = ModelRunner(
        model_dir,
        device=config.device,
        dtype=config.dtype,
        kv_capacity_tokens=config.kv_capacity_tokens,
        kv_memory_fraction=config.kv_memory_fraction,
        host_cache_tokens=config.host_cache_tokens,
        attention_backend=config.attention_backend,
        cuda_graphs=not config.disable_cuda_graph,
        piecewise_max_tokens=config.piecewise_cuda_graph_max_tokens,
        max_running_requests=config.max_running_requests,
        kv_cache_dtype=config.kv_cache_dtype,
        debug_checks=config.debug_checks,
    )
    sampler = TorchSampler(runner.device)
    return LLMEngine(runner, Tokenizer.from_dir(model_dir), config, sampler)
