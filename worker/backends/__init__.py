"""Backends behind the one `Engine` protocol, chosen with `--engine`.

Each is imported only when chosen: `vllm` is an optional, heavy dependency, and the
sim engine must start without torch model weights.
"""

from __future__ import annotations

from shared.config import ConfigError, WorkerConfig
from worker.engine.types import Engine


def build_engine(config: WorkerConfig) -> Engine:
    """The engine `config.engine` names, built (and its model loaded) but not started."""
    if config.engine == "sim":
        from worker.backends.sim import build_sim_engine

        return build_sim_engine(config)
    if config.model is None:
        raise ConfigError(f"model: required for --engine {config.engine} (a local model folder)")
    if config.engine == "vllm":
        from worker.backends.vllm_backend import VllmEngine

        return VllmEngine(config)
    from worker.backends.radix import build_radix_engine

    return build_radix_engine(config)
