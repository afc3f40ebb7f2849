"""The sim worker reports its cost model in its stats, which its heartbeat carries to
the router's cost_aware policy (router/policy/cost_aware.py)."""

from __future__ import annotations

import pytest

from loadtests.simulate.worker import CostModel, SimWorker
from shared.config import WorkerConfig
from shared.tokens.text_tokenizer import TextTokenizer
from shared.wire.registry import WorkerRecord
from worker.backends import build_engine
from worker.backends.sim import build_sim_llm_engine
from worker.engine.config import EngineConfig
from worker.engine.types import EngineRequest, SamplingParams
from worker.http.app import make_record
from worker.http.state import WorkerState


def test_sim_stats_and_heartbeat_carry_the_cost_model_and_seats() -> None:
    config = WorkerConfig(
        engine="sim", cache_tokens=4096, max_running_requests=3,
        sim_prefill_us_per_token=25.0, sim_decode_ms_per_token=2.0,
    )  # fmt: skip
    engine = build_engine(config)
    stats = engine.stats()
    assert (stats.prefill_us_per_token, stats.decode_ms_per_token) == (25.0, 2.0)
    assert stats.max_running_requests == 3 and stats.queued_prefill_tokens == 0
    record = make_record(config, engine, WorkerState("w1", "sim", url="http://127.0.0.1:9"))
    assert (record.prefill_us_per_token, record.decode_ms_per_token) == (25.0, 2.0)
    assert record.max_running_requests == 3
    # Through Redis and back (every field is a string there).
    assert WorkerRecord.from_hash(record.to_hash()) == record


def _decode_step_s(batch: int, prompt: int, **cost: float) -> tuple[float, int]:
    """The priced seconds of one decode step of `batch` requests of `prompt` tokens,
    and the context tokens that step read."""
    engine = build_sim_llm_engine(
        EngineConfig(kv_capacity_tokens=1 << 20, max_prefill_tokens=1 << 18),
        TextTokenizer(), sleep=None, **cost,
    )  # fmt: skip
    for i in range(batch):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        engine.add_request(
            EngineRequest(f"r{i}", prompt_token_ids=[10 + i] * prompt, params=params)
        )
    engine.step()  # every prompt's prefill
    engine.step()  # a decode step: each request reads its prompt and its first token
    assert all(len(it.input_ids) == 1 for it in engine.last_batch.items)
    return engine.runner.last_step_s, sum(it.end_pos for it in engine.last_batch.items)


def test_decode_step_is_priced_from_batch_and_context() -> None:
    """A decode step costs its weights pass, its sequences and the KV they read: batch
    64 x 2k context costs more than batch 64 x 128 and than batch 8 x 2k (it was one
    constant, whatever the batch and context)."""
    cost = dict(decode_ms_per_token=3.0, decode_us_per_seq=10.0, decode_us_per_1k_context=40.0)
    long_s, long_ctx = _decode_step_s(64, 2048, **cost)
    assert long_ctx == 64 * 2049
    assert long_s == pytest.approx(3e-3 + 64 * 10e-6 + long_ctx / 1000 * 40e-6)
    short_s, _ = _decode_step_s(64, 128, **cost)
    small_s, _ = _decode_step_s(8, 2048, **cost)
    assert long_s > short_s > 3e-3 and long_s > small_s > 3e-3
    kv_s = long_ctx / 1000 * 40e-6
    assert 0.6 < kv_s / (kv_s + 3e-3) < 0.7  # KV vs weights at 64 x 2k: Llama-3.2-1B's bytes


def test_fleet_simulator_prices_context_by_default() -> None:
    """The virtual-time workers of every fleet study use the context-priced step."""
    worker = SimWorker(0, CostModel())
    assert worker.runner.context_s > 0
    assert CostModel().decode_us_per_1k_context == pytest.approx(40.0)
