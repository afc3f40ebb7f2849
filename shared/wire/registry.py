"""The fleet registry in Redis: the one place that knows the key names.

Layout (prefix default `radixrouter:`):

    <prefix>worker:<id>   hash, written every heartbeat, expires after a few intervals
    <prefix>events        pub/sub channel: JSON {"event": "join"|"leave", "worker_id", "url"}
    <prefix>decisions     stream of routing decisions shared by router replicas (router/holdings/sync.py)
    <prefix>router:<id>   hash worker_id -> requests in flight from router replica <id>, short expiry
    <prefix>ratelimit:<c> string: GCRA arrival time of client hash <c> (router/http/ratelimit.py)
    <prefix>kvevents:<id> stream of worker <id>'s KV-cache events (shared/wire/kv_events.py),
                          bounded (MAXLEN ~); written under the worker's own ACL like its hash

Workers write (`publish_heartbeat`, `leave`); routers read (`read_fleet`).

Membership is the set of live heartbeat hashes, found by SCAN, and nothing else. Each
worker's Redis user may write only its own hash (README's ACL lines), so no worker
credential can add, remove or replace another worker: an earlier shared id set that
every worker could DEL/SREM/SADD let one worker empty every router's fleet or stand in
for the others. A worker's hash names itself in its key; a record whose `worker_id`
disagrees with its key is rejected. The events channel only wakes routers early (its
content is never trusted; router/fleet/discovery.py bounds how often it may wake them).

Cost: SCAN walks the whole database, not only matching keys, so a poll costs
O(keys in the db / SCAN_COUNT) round trips plus one pipelined HGETALL per worker
(loadtests/results/registry_scan.md has the numbers at 1,000 workers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis

from shared.wire.kv_events import MAX_BATCH_BYTES, entry_fields
from shared.wire.peers import Rejections, check_worker_id, check_worker_url

# Counts and sizes a worker reports (tokens, requests) are far below this; larger is a lie.
MAX_COUNT = 10**15
MAX_WORKERS = 4096  # worker hashes read per poll
# A KV-event stream entry's fields (a batch of at most MAX_BATCH_BYTES and its header).
MAX_ENTRY_BYTES = MAX_BATCH_BYTES + 1024
MAX_REPLY_BYTES = 2 * MAX_ENTRY_BYTES  # one read of every stream, whatever `count` is
SCAN_COUNT = 10_000  # keys the server walks per SCAN round trip (~1 ms of its time)
# A model or adapter name, and any other text field of a record: at most this many
# characters (the router keys and quotes no longer name: router/holdings/namespace.py).
MAX_NAME_CHARS = 256
MAX_ADAPTERS = 32  # adapter names one worker may advertise (each a model name)
MAX_FIELD_CHARS = 1024  # any field of a record (the adapters' names joined, too)


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    url: str
    model: str
    engine: str
    epoch: float  # process start time: a new epoch means an empty cache
    running: int = 0
    waiting: int = 0
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    draining: bool = False
    # Inputs of the router's cost_aware policy (see worker.engine.types.EngineStats).
    queued_prefill_tokens: int = 0
    prefill_us_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_running_requests: int = 0
    request_ms: float = 0.0
    # The host KV tier (0: none): capacity and use in tokens, prompt tokens served from
    # it (part of cached_tokens_total), its load bandwidth and the KV bytes of a token
    # (a host hit costs kv_bytes_per_token / host_load_bytes_per_s, not a prefill).
    host_kv_capacity_tokens: int = 0
    host_kv_used_tokens: int = 0
    host_cached_tokens_total: int = 0
    host_load_bytes_per_s: float = 0.0
    kv_bytes_per_token: int = 0
    # Tokens per block of its KV events (0: it publishes none): routers index its events
    # at this size, never at whatever size the first publisher used (router/holdings/kv_feed.py).
    kv_block_size: int = 0
    # The engine admits its waiting requests by the body's integer `priority` (vLLM's
    # --scheduling-policy priority, attached): the router then adds the class's one
    # (shared/wire/service_class.py). Our engine reads the class from the body itself.
    priority_scheduling: bool = False
    # Pins across tool gaps (worker/engine/pins.py): prefixes held, and their tokens.
    pins: int = 0
    pinned_tokens: int = 0
    # LoRA adapters served beside `model`, each under its own `model` name (vLLM's
    # `--lora-modules`, read from the upstream's /v1/models by `attach`): routers send an
    # adapter's requests here, keyed apart from the base model's (router/holdings/namespace.py).
    # In the hash: the names joined by ",", at most MAX_ADAPTERS of them.
    adapters: tuple[str, ...] = ()

    def to_hash(self) -> dict[str, str]:
        out = {k: (str(int(v)) if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()}
        out["adapters"] = ",".join(self.adapters)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> WorkerRecord:
        """Parse a hash; ValueError on anything malformed. The store is not trusted: the id
        ends up in headers and key names, the URL in the proxy, the numbers in routing."""
        if len(raw) > 64:
            raise ValueError("worker record has too many fields")
        data: dict[str, str] = {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else k
            value = v.decode() if isinstance(v, bytes) else v
            if len(value) > MAX_FIELD_CHARS:
                raise ValueError(f"worker record field {key!r:.40} is too long")
            data[key] = value
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.name in ("worker_id", "url", "model", "engine", "epoch"):
                    raise ValueError(f"worker record lacks {f.name!r}")
                continue
            value = data[f.name]
            if f.type == "int":
                number = int(value)  # ValueError on "1.5", "x"
                if not 0 <= number <= MAX_COUNT:
                    raise ValueError(f"{f.name} out of range: {number}")
                kwargs[f.name] = number
            elif f.type == "float":
                real = float(value)
                if not (math.isfinite(real) and 0 <= real <= MAX_COUNT):
                    raise ValueError(f"{f.name} out of range: {real}")
                kwargs[f.name] = real
            elif f.type == "bool":
                kwargs[f.name] = value not in ("0", "", "false", "False")
            elif f.name == "adapters":
                kwargs[f.name] = parse_adapters(value)
            elif not value.isprintable() or len(value) > MAX_NAME_CHARS:
                raise ValueError(
                    f"{f.name} must be printable text of at most {MAX_NAME_CHARS} characters"
                )
            else:
                kwargs[f.name] = value
        record = cls(**kwargs)  # type: ignore[arg-type]
        check_worker_id(record.worker_id)
        check_worker_url(record.url)
        return record


def parse_adapters(value: str) -> tuple[str, ...]:
    """A record's `adapters` field: "" or names joined by ","; ValueError beyond
    MAX_ADAPTERS names or on a name that could not be a model name."""
    if not value:
        return ()
    names = value.split(",")
    if len(names) > MAX_ADAPTERS:
        raise ValueError(f"adapters names more than {MAX_ADAPTERS} names")
    for name in names:
        if not name or not name.isprintable() or len(name) > MAX_NAME_CHARS:
            raise ValueError(
                f"adapters must be printable names of at most {MAX_NAME_CHARS} characters"
            )
    return tuple(names)


def fit_adapters(names: list[str]) -> tuple[str, ...]:
    """The adapter names a record can carry, in order: valid names (no ",") while they
    fit MAX_ADAPTERS and MAX_FIELD_CHARS joined; the rest are not advertised."""
    out: list[str] = []
    used = -1
    for name in names:
        if "," in name or not name or not name.isprintable() or len(name) > MAX_NAME_CHARS:
            continue
        if len(out) == MAX_ADAPTERS or used + 1 + len(name) > MAX_FIELD_CHARS:
            break
        out.append(name)
        used += 1 + len(name)
    return tuple(out)


class Registry:
    def __init__(
        self, redis: Redis, prefix: str = "radixrouter:", rejections: Rejections | None = None
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.rejections = rejections if rejections is not None else Rejections()

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        """SCAN pattern of every worker hash (glob characters in the prefix escaped)."""
        return f"{_glob_escape(self.prefix)}worker:*"

    @property
    def events_channel(self) -> str:
        return f"{self.prefix}events"

    @property
    def decisions_stream(self) -> str:
        return f"{self.prefix}decisions"

    def kv_events_key(self, worker_id: str) -> str:
        return f"{self.prefix}kvevents:{worker_id}"

    async def append_kv_events(
        self, worker_id: str, epoch: float, seq: int, payload: bytes, maxlen: int,
        resync: bool = False,
    ) -> None:  # fmt: skip
        """One batch onto the worker's bounded event stream (trimmed approximately: cheap).
        `resync`: events before it were lost for good (shared/wire/kv_events.py StreamEntry)."""
        await self.redis.xadd(
            self.kv_events_key(worker_id),
            entry_fields(worker_id, epoch, seq, payload, resync),  # type: ignore[arg-type]
            maxlen=maxlen,
            approximate=True,
        )

    async def read_kv_events(
        self,
        cursors: dict[str, str],
        count: int,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        trim: Sequence[str] = (),
        maxlen: int = 0,
    ) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
        """New entries of each worker's stream after its cursor (an entry id; "0" for all),
        as [(worker_id, [(entry_id, fields), ...]), ...], at most `count` per stream.
        `trim`: workers whose streams are also trimmed to about `maxlen` entries
        (`trim_kv_events`) in the same round trip; a trim that fails is not the read's
        failure (the next one trims).

        Sizes are checked in Redis, before anything crosses the wire: an entry whose
        fields exceed `max_entry_bytes` comes back as `{b"oversized": b"<bytes>"}` (its
        id kept, so the cursor moves past it). XREAD would send it whole first: 8 entries
        of 64 MB took a router from 73 MB to 641 MB (issue 30). One reply carries at most
        `max_reply_bytes` (at least one entry): 256 entries of 4 MB would be 1 GB. So the read is a script
        (XRANGE per stream, exclusive of the cursor), and does not block: the caller
        polls.

        What measuring costs Redis: XRANGE copies an entry into the script to measure
        it, and no command tells an entry's size without that copy. The script takes one
        entry at a time (one XRANGE each), so it holds at most one oversized entry's copy,
        and it stops a stream's read at its first oversized entry (a 64 MB copy is ~10-20
        ms of Redis): 8 entries of 64 MB were 512 MB copied into Lua at once. The reader
        then trims the stream past it (`trim_kv_events_past`), so it is measured once, not
        once per router."""
        if not cursors:
            return []
        keys = [self.kv_events_key(w) for w in cursors]
        args = [count, max_entry_bytes, max_reply_bytes, *cursors.values()]
        # EVAL_RO: read-only key access (the routers' ACL reads worker streams, %R~).
        if trim:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.eval_ro(_READ_SIZED, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
                for wid in trim:
                    pipe.xtrim(self.kv_events_key(wid), maxlen=maxlen, approximate=True)
                replies, *_ = await pipe.execute(raise_on_error=False)
            if isinstance(replies, Exception):
                raise replies
        else:
            replies = await self.redis.eval_ro(_READ_SIZED, len(keys), *keys, *args)  # type: ignore[misc]
        cut = len(self.kv_events_key(""))
        out = []
        for key, flat in zip(keys, replies or (), strict=False):
            if not flat:
                continue
            entries = [(eid, dict(zip(f[::2], f[1::2], strict=False))) for eid, f in flat]
            out.append((key[cut:], entries))
        return out

    async def trim_kv_events(self, worker_ids: list[str], maxlen: int) -> None:
        """Cap each worker's stream at about `maxlen` entries (MAXLEN ~): routers do it
        too, as a worker that does not trim its own stream could fill Redis. (The routers'
        ACL allows XTRIM alone on these keys: a selector, README.md.)"""
        if not worker_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in worker_ids:
                pipe.xtrim(self.kv_events_key(wid), maxlen=maxlen, approximate=True)
            await pipe.execute()

    async def trim_kv_events_past(self, worker_id: str, entry_id: bytes | str) -> None:
        """Remove the worker's entries up to `entry_id` included (XTRIM MINID): what an
        oversized entry leaves (`read_kv_events`). Other routers that had not read up to
        it see a gap there, as they would have in any case (they would drop it too)."""
        text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        ms, seq = text.split("-")
        await self.redis.xtrim(self.kv_events_key(worker_id), minid=f"{ms}-{int(seq) + 1}")

    async def last_kv_event_id(self, worker_id: str) -> bytes | None:
        """The id of the newest entry in the worker's stream (None when empty)."""
        entries = await self.redis.xrevrange(self.kv_events_key(worker_id), count=1)
        return entries[0][0] if entries else None

    def router_key(self, replica_id: str) -> str:
        return f"{self.prefix}router:{replica_id}"

    def ratelimit_key(self, client_hex: str) -> str:
        return f"{self.prefix}ratelimit:{client_hex}"

    @property
    def router_pattern(self) -> str:
        return f"{self.prefix}router:*"

    async def publish_heartbeat(self, record: WorkerRecord, ttl_s: float, *, joined: bool) -> None:
        key = self.worker_key(record.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=record.to_hash())
            pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            if joined:
                pipe.publish(self.events_channel, _membership_event("join", record))
            await pipe.execute()

    async def leave(self, record: WorkerRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.worker_key(record.worker_id))
            pipe.publish(self.events_channel, _membership_event("leave", record))
            await pipe.execute()

    async def read_fleet(self) -> dict[str, WorkerRecord]:
        """Every live worker: each heartbeat hash under the prefix. Malformed ids and
        records, and records naming another id than their key, are skipped, counted and
        logged (`rejections`), never routed to."""
        ids = await self._worker_ids()
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self.worker_key(wid))
            # One hash that is not a hash (WRONGTYPE) must not hide the others.
            hashes = await pipe.execute(raise_on_error=False)
        fleet: dict[str, WorkerRecord] = {}
        for wid, raw in zip(ids, hashes, strict=True):
            if not raw:  # expired between SCAN and HGETALL
                continue
            try:
                if isinstance(raw, Exception):
                    raise ValueError(f"unreadable record: {raw}")
                record = WorkerRecord.from_hash(raw)
                if record.worker_id != wid:
                    raise ValueError(f"record names another worker ({record.worker_id!r:.40})")
            except (ValueError, TypeError, UnicodeDecodeError) as e:
                self.rejections.reject("registry", wid, str(e))
                continue
            fleet[wid] = record
        return fleet

    async def _worker_ids(self) -> list[str]:
        """The ids of the worker hashes (from their keys), sorted, at most MAX_WORKERS."""
        start = len(self.worker_key(""))
        found: set[str] = set()  # SCAN may return a key twice
        async for key in self.redis.scan_iter(
            match=self.worker_pattern, count=SCAN_COUNT, _type="hash"
        ):
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            wid = name[start:]
            if wid in found:
                continue
            if len(found) >= MAX_WORKERS:
                self.rejections.reject("registry", "scan", f"over {MAX_WORKERS} workers")
                break
            try:
                found.add(check_worker_id(wid))
            except ValueError as e:
                self.rejections.reject("registry", wid, str(e))
        return sorted(found)


# KEYS: the streams; ARGV: count, the entry size bound, the reply's byte budget, then
# each stream's cursor. Each entry's fields are measured here, in Redis; an oversized one
# is sent as its size. Past the budget no more entries are sent (the next read goes on).
_READ_SIZED = """
local count, bound, budget, out = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), {}
local total = 0
for i, key in ipairs(KEYS) do
  local kept, cursor = {}, ARGV[3 + i]
  while total < budget and #kept < count do
    local entry = redis.call('XRANGE', key, '(' .. cursor, '+', 'COUNT', 1)[1]
    if entry == nil then break end
    cursor = entry[1]
    local size = 0
    for _, v in ipairs(entry[2]) do size = size + #v end
    local oversized = size > bound
    if oversized then
      entry[2] = {'oversized', tostring(size)}
      size = 64
    end
    if total > 0 and total + size > budget then break end
    total = total + size
    kept[#kept + 1] = entry
    if oversized then break end
  end
  out[i] = kept
end
return out
"""


def _glob_escape(text: str) -> str:
    """`text` matched literally in a Redis glob pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _membership_event(kind: str, record: WorkerRecord) -> str:
    return json.dumps({"event": kind, "worker_id": record.worker_id, "url": record.url})


def redact_url(url: str) -> str:
    """`redis://:secret@host:6379/0` -> `redis://:***@host:6379/0`: a URL fit for a log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
