"""Decode graphs are captured before traffic (worker/engine/runtime/cuda_graphs.py), on CPU's
emulated path: the same static buffers, padding, capture at start-up, load and replay,
with the replay run eagerly (no CUDA here; tests/gpu/ runs the real graphs)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from functools import partialmethod
from pathlib import Path
from typing import Any

import pytest

from shared.config import WorkerConfig
from shared.tokens.tokenizer import Tokenizer
from worker.backends import build_engine, engine_config
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.runtime.cuda_graphs import BUCKETS, DecodeGraphs
from worker.engine.runtime.load import load_engine
from worker.engine.runtime.runner import ModelRunner
from worker.engine.runtime.sampler import TorchSampler
from worker.engine.types import EngineRequest, SamplingParams
from worker.http.app import create_app
from worker.http.state import ENGINE, STATE

MAX_RUNNING = 10


def _engine(model_dir: Path, graphs: bool, **cfg: object) -> LLMEngine:
    runner = ModelRunner(
        model_dir, device="cpu", dtype="float32", kv_capacity_tokens=2048,
        attention_backend="sdpa", max_running_requests=MAX_RUNNING,
        emulate_cuda_graphs=graphs,
    )  # fmt: skip
    config = EngineConfig(device="cpu", max_running_requests=MAX_RUNNING, **cfg)  # type: ignore[arg-type]
    return LLMEngine(runner, Tokenizer.from_dir(model_dir), config, TorchSampler(runner.device))


def _traffic(engine: LLMEngine) -> dict[str, list[int]]:
    """Requests arriving a few at a time: decode batches of many sizes."""
    rng = random.Random(3)
    pending = [
        EngineRequest(f"r{i}", prompt_token_ids=[rng.randrange(4, 1000) for _ in range(9 + i)],
                      params=SamplingParams(max_tokens=4 + i % 7, temperature=0, ignore_eos=True))
        for i in range(MAX_RUNNING)
    ]  # fmt: skip
    out: dict[str, list[int]] = {r.request_id: [] for r in pending}
    while pending or engine.has_work:
        for _ in range(min(3, len(pending))):
            engine.add_request(pending.pop(0))
        for o in engine.step():
            out[o.request_id] += o.token_ids
        engine.check_integrity()
    return out


def test_every_bucket_is_captured_at_start_and_none_during_traffic(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="worker.engine.runtime.cuda_graphs"):
        engine = _engine(tiny_model_dir, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.emulate
    wanted = tuple(b for b in BUCKETS if b <= 12)  # 10 running: the 12 bucket is the last
    assert tuple(graphs.capture_seconds) == wanted and graphs.captures == len(wanted)
    assert engine.runner.graph_capture_s >= sum(graphs.capture_seconds.values()) > 0
    assert any(
        f"captured {len(wanted)} decode emulated graphs" in r.message for r in caplog.records
    )

    got = _traffic(engine)
    assert graphs.replays >= 5  # decode-only steps went through the graphs
    assert graphs.captures == len(wanted) and graphs.late_captures == 0  # none in traffic
    # Padding to a bucket changes nothing: the same greedy tokens as the eager engine.
    assert got == _traffic(_engine(tiny_model_dir, graphs=False))


def test_disable_cuda_graph_still_runs_eagerly(tiny_model_dir: Path) -> None:
    config = engine_config(WorkerConfig(model=str(tiny_model_dir), disable_cuda_graph=True))
    assert config.disable_cuda_graph
    engine = load_engine(
        tiny_model_dir, EngineConfig(device="cpu", kv_capacity_tokens=512, disable_cuda_graph=True)
    )
    assert engine.runner.graphs is None and engine.runner.graph_capture_s == 0.0
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("a", prompt_token_ids=[5, 6, 7], params=params))
    steps = 0
    while engine.has_work:
        steps += 1
        engine.step()
    assert steps >= 3 and engine.stats().completion_tokens_total == 3


async def test_worker_is_not_ready_until_every_graph_is_captured(
    tiny_model_dir: Path, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's real start-up (AsyncEngine.start loads the engine and builds the runner, which captures
    every bucket): /health says 503 and requests are refused until capture is done;
    the heartbeat waits on the same `ready` event."""
    gate, capturing = threading.Event(), threading.Event()
    capture_all = DecodeGraphs.capture_all

    def slow_capture(self: DecodeGraphs, max_batch: int) -> float:
        capturing.set()
        assert gate.wait(30)
        return capture_all(self, max_batch)

    monkeypatch.setattr(DecodeGraphs, "capture_all", slow_capture)
    # CPU has no CUDA graphs: the runner the worker builds takes the emulated ones (and
    # the piecewise ones, captured after the decode buckets, also before ready).
    monkeypatch.setattr(ModelRunner, "__init__",
                        partialmethod(ModelRunner.__init__, emulate_cuda_graphs=True))  # fmt: skip
    config = WorkerConfig(model=str(tiny_model_dir), worker_id="w", device="cpu",
                          cache_tokens=1024, max_running_requests=4,
                          piecewise_cuda_graph_max_tokens=16)  # fmt: skip
    app = create_app(config, build_engine(config))
    client = await aiohttp_client(app)
    assert await asyncio.to_thread(capturing.wait, 60)  # capture has started ...
    assert (await client.get("/health")).status == 503  # ... and is not done: not ready
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_ready"
    gate.set()
    await asyncio.wait_for(app[STATE].ready.wait(), 60)
    assert (await client.get("/health")).status == 200
    graphs = app[ENGINE].engine.runner.graphs
    assert graphs.captures == 3 and graphs.late_captures == 0  # buckets 1, 2, 4
    pieces = app[ENGINE].engine.runner.piecewise
    assert pieces.captures == 1 and pieces.capture_seconds.keys() == {16}
