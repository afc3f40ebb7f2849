"""Heartbeats in a real Redis-protocol server (valkey/redis-server, started here)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable

import redis

from shared.procs import wait_until
from shared.redis_server import RedisServer, free_port
from shared.wire.registry import WorkerRecord
from tests.worker.conftest import WorkerProcess, WorkerThread, sim_config
from worker.http.state import HEARTBEAT

PREFIX = "radixrouter:"
FAST = ["--engine", "sim", "--heartbeat-interval", "0.2", "--cache-tokens", "1000"]


def record(client: redis.Redis, worker_id: str) -> WorkerRecord | None:
    raw = client.hgetall(f"{PREFIX}worker:{worker_id}")
    return WorkerRecord.from_hash(raw) if raw else None


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_record_fields_and_load(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    config = sim_config(redis_url=redis_server.url, heartbeat_interval=0.1, worker_id="hb-fields")
    with WorkerThread(config) as worker:
        wait_until(lambda: record(client, "hb-fields") is not None, 10)
        rec = record(client, "hb-fields")
        assert rec is not None
        assert (rec.url, rec.model, rec.engine) == (worker.url, "sim", "sim")
        assert abs(rec.epoch - time.time()) < 60 and rec.kv_capacity_tokens == 50_000
        # Membership is the heartbeat hash itself: no shared id set a worker could empty.
        assert not client.exists(f"{PREFIX}workers")
        ttl_ms = client.pttl(f"{PREFIX}worker:hb-fields")
        assert 0 < ttl_ms <= 300  # a few intervals
        post(worker.url + "/v1/completions", {"prompt": "count me " * 20, "max_tokens": 2})
        post(worker.url + "/v1/completions", {"prompt": "count me " * 20, "max_tokens": 2})

        def counted() -> bool:
            r = record(client, "hb-fields")
            return r is not None and r.prompt_tokens_total > 0 and r.cached_tokens_total > 0

        wait_until(counted, 10)
        rec = record(client, "hb-fields")
        assert rec is not None and rec.kv_used_tokens > 0 and rec.running == 0
    # A clean stop leaves the fleet.
    assert record(client, "hb-fields") is None


def test_worker_survives_redis_outage_and_resumes() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        config = sim_config(redis_url=server.url, heartbeat_interval=0.1, worker_id="hb-outage")
        with WorkerThread(config) as worker:
            wait_until(lambda: record(client, "hb-outage") is not None, 10)
            heartbeat = worker.app[HEARTBEAT]  # type: ignore[index]
            server.stop()
            failed = heartbeat.failures
            wait_until(lambda: heartbeat.failures >= failed + 2, 10)  # beats did fail
            body = post(
                worker.url + "/v1/completions", {"prompt": "still serving", "max_tokens": 2}
            )
            assert body["usage"]["completion_tokens"] == 2  # type: ignore[index]
            server.start()
            client = redis.Redis.from_url(server.url)  # the new server starts empty
            pubsub = client.pubsub()
            pubsub.subscribe(f"{PREFIX}events")
            wait_until(lambda: record(client, "hb-outage") is not None, 10)
            # The first beat after the outage announces the worker again.
            wait_until(lambda: (m := pubsub.get_message(timeout=0.05)) is not None
                       and m["type"] == "message" and b'"join"' in m["data"], 10)  # fmt: skip
            pubsub.close()


def test_sigkill_record_expires(
    redis_server: RedisServer, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    worker = spawn_worker(*FAST, "--redis-url", redis_server.url, "--worker-id", "hb-kill")
    worker.wait_ready()
    wait_until(lambda: record(client, "hb-kill") is not None, 10)
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(10)
    wait_until(lambda: record(client, "hb-kill") is None, 5)


def test_sigterm_leaves_the_fleet(
    redis_server: RedisServer, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    worker = spawn_worker(*FAST, "--redis-url", redis_server.url, "--worker-id", "hb-term")
    worker.wait_ready()
    wait_until(lambda: record(client, "hb-term") is not None, 10)
    pubsub = client.pubsub()
    pubsub.subscribe(f"{PREFIX}events")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(20) == 0, worker.log()
    assert record(client, "hb-term") is None
    events = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not events:
        msg = pubsub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            events.append(json.loads(msg["data"]))
    assert events and events[0]["event"] == "leave" and events[0]["worker_id"] == "hb-term"
    pubsub.close()


def test_starts_and_serves_without_reachable_redis() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    config = sim_config(redis_url=dead, heartbeat_interval=0.05, worker_id="hb-dead")
    with WorkerThread(config) as worker:
        body = post(worker.url + "/v1/completions", {"prompt": "no redis", "max_tokens": 2})
        assert body["usage"]["completion_tokens"] == 2  # type: ignore[index]
        assert worker.app is not None
        heartbeat = worker.app[HEARTBEAT]
        # Not a wait for nothing: the loop did try (and fail) several times.
        wait_until(lambda: heartbeat.failures >= 3, 10)
        assert heartbeat.beats == 0 and not heartbeat.joined


def test_the_record_takes_the_engines_stats_by_their_own_names() -> None:
    """One name per fact: every number a worker record carries is an EngineStats field of
    the same name (so the record is built from the stats, never copied with renames),
    and make_record carries each value over."""
    from dataclasses import fields

    from shared.config import WorkerConfig
    from worker.engine.types import EngineStats
    from worker.http.app import make_record
    from worker.http.state import WorkerState

    # What the worker says of itself, not its engine's numbers (priority_scheduling: an
    # attached vLLM started with priority scheduling; our engine always orders by class;
    # adapters: an attached vLLM's LoRA adapters, our engine serves none).
    own = {"worker_id", "url", "model", "engine", "epoch", "draining", "priority_scheduling",
           "adapters"}  # fmt: skip
    stats_names = [f.name for f in fields(EngineStats)]
    record_names = {f.name for f in fields(WorkerRecord)} - own
    assert record_names <= set(stats_names), record_names - set(stats_names)
    stats = EngineStats(*range(1, len(stats_names) + 1))  # every field a distinct value

    class Fixed:  # an engine that reports `stats` (the rest of the protocol is unused)
        def stats(self) -> EngineStats:
            return stats

    state = WorkerState(worker_id="w-1", served_model="m", epoch=5.0)
    record = make_record(WorkerConfig(engine="sim"), Fixed(), state)  # type: ignore[arg-type]
    assert {n: getattr(record, n) for n in record_names} == {
        n: getattr(stats, n) for n in record_names
    }
