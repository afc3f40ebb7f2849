"""The radix backend loads its weights in start(), after the port is open, so /health
can answer 503 while a model loads instead of refusing connections."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import WorkerConfig
from worker.backends import build_engine
from worker.engine.types import EngineOverloaded, EngineRequest, SamplingParams


async def test_weights_load_in_start_not_in_the_constructor(tiny_model_dir: Path) -> None:
    backend = build_engine(
        WorkerConfig(engine="radix", model=str(tiny_model_dir), cache_tokens=4096)
    )
    assert backend.model_name == tiny_model_dir.name
    assert backend.max_model_len == 0 and backend.stats().kv_capacity_tokens == 0
    request = EngineRequest(
        "r1", prompt="hello radix", params=SamplingParams(max_tokens=3, temperature=0)
    )
    with pytest.raises(EngineOverloaded, match="loading"):
        backend.generate(request)
    await backend.start()
    try:
        outputs = [o async for o in backend.generate(request)]
        assert outputs[-1].finished and outputs[-1].completion_tokens == 3
        assert backend.max_model_len > 0 and backend.stats().kv_capacity_tokens == 4096
    finally:
        await backend.stop()
