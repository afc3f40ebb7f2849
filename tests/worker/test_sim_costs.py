"""The sim worker reports its cost model in its stats, which its heartbeat carries to
the router's cost_aware policy (router/policy/cost_aware.py)."""

from __future__ import annotations

from shared.config import WorkerConfig
from shared.registry import WorkerRecord
from worker.app import make_record
from worker.backends import build_engine
from worker.state import WorkerState


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
