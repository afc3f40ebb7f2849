"""The fleet registry in Redis: the one place that knows the key names.

Layout (prefix default `radixrouter:`):

    <prefix>worker:<id>   hash, written every heartbeat, expires after a few intervals
    <prefix>workers       set of worker ids (may hold ids whose hash already expired)
    <prefix>events        pub/sub channel: JSON {"event": "join"|"leave", "worker_id", "url"}
    <prefix>decisions     stream of routing decisions shared by router replicas (router/sync.py)
    <prefix>router:<id>   hash worker_id -> requests in flight from router replica <id>, short expiry

Workers write (`publish_heartbeat`, `leave`); routers read (`read_fleet`). A worker
whose hash expired is gone even if its id is still in the set; readers prune such ids.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from redis.asyncio import Redis

from shared.config import check_worker_url


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    url: str
    model: str
    engine: str
    epoch: float  # process start time: a new epoch means an empty cache
    running: int = 0
    waiting: int = 0
    cache_capacity_tokens: int = 0
    cache_used_tokens: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    draining: bool = False
    # Inputs of the router's cost_aware policy (see worker.engine.types.EngineStats).
    queued_prefill_tokens: int = 0
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_running_requests: int = 0
    request_ms: float = 0.0

    def to_hash(self) -> dict[str, str]:
        return {
            k: (str(int(v)) if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()
        }

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> WorkerRecord:
        """Parse a hash; raises ValueError on a malformed record (never trust the store blindly:
        the URL ends up in the proxy)."""
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.name in ("worker_id", "url", "model", "engine", "epoch"):
                    raise ValueError(f"worker record lacks {f.name!r}")
                continue
            value = data[f.name]
            if f.type in ("int",):
                kwargs[f.name] = int(value)
            elif f.type == "float":
                kwargs[f.name] = float(value)
            elif f.type == "bool":
                kwargs[f.name] = value not in ("0", "", "false", "False")
            else:
                kwargs[f.name] = value
        record = cls(**kwargs)  # type: ignore[arg-type]
        check_worker_url(record.url)
        return record


class Registry:
    def __init__(self, redis: Redis, prefix: str = "radixrouter:") -> None:
        self.redis = redis
        self.prefix = prefix

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    @property
    def workers_key(self) -> str:
        return f"{self.prefix}workers"

    @property
    def events_channel(self) -> str:
        return f"{self.prefix}events"

    @property
    def decisions_stream(self) -> str:
        return f"{self.prefix}decisions"

    def router_key(self, replica_id: str) -> str:
        return f"{self.prefix}router:{replica_id}"

    @property
    def router_pattern(self) -> str:
        return f"{self.prefix}router:*"

    async def publish_heartbeat(self, record: WorkerRecord, ttl_s: float, *, joined: bool) -> None:
        key = self.worker_key(record.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=record.to_hash())
            pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            pipe.sadd(self.workers_key, record.worker_id)
            if joined:
                pipe.publish(self.events_channel, _event("join", record))
            await pipe.execute()

    async def leave(self, record: WorkerRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.worker_key(record.worker_id))
            pipe.srem(self.workers_key, record.worker_id)
            pipe.publish(self.events_channel, _event("leave", record))
            await pipe.execute()

    async def read_fleet(self) -> dict[str, WorkerRecord]:
        """Every live worker. Ids whose hash expired are removed from the set."""
        ids = sorted(
            m.decode() if isinstance(m, bytes) else m
            for m in await self.redis.smembers(self.workers_key)
        )
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.worker_key(wid))
            hashes = await pipe.execute()
        fleet: dict[str, WorkerRecord] = {}
        gone: list[str] = []
        for wid, raw in zip(ids, hashes, strict=True):
            if not raw:
                gone.append(wid)
                continue
            try:
                record = WorkerRecord.from_hash(raw)
            except (ValueError, TypeError):
                continue  # a malformed record is ignored, not routed to
            if record.worker_id == wid:
                fleet[wid] = record
        if gone:
            await self.redis.srem(self.workers_key, *gone)
        return fleet


def _event(kind: str, record: WorkerRecord) -> str:
    return json.dumps({"event": kind, "worker_id": record.worker_id, "url": record.url})
