"""`radix-worker attach`: make an unmodified SGLang or vLLM server a worker of the fleet.

    radix-worker attach --upstream http://127.0.0.1:8000 --engine {sglang,vllm}
                        --redis-url URL [--worker-id ID] [--advertise-url URL]

A sidecar next to the stock server (same pod in the chart). Every `--interval` it
scrapes the upstream's own `/metrics` (worker/attach/upstream_metrics.py: running, queued, KV
usage, token totals) and writes the same heartbeat record our workers write, with the
upstream's URL (or `--advertise-url`, what routers dial), its model from `/v1/models`
(the entry without a `parent`; the entries with one, vLLM's `--lora-modules` adapters,
as its `adapters`: read once per epoch, so an adapter loaded at run time is advertised
from the next restart), and its KV capacity (vLLM: `vllm:cache_config_info`; SGLang:
`/get_server_info` `max_total_num_tokens`). The router treats it as any worker: both engines serve the
OpenAI API and report `cached_tokens`. Of a host KV tier only SGLang's host hits are
exported in tokens (worker/attach/upstream_metrics.py says what each engine exposes).

Epochs: a router drops a worker's prefix tree when its epoch changes, so the sidecar
starts a new one whenever the upstream's cache may have been lost: its
`process_start_time_seconds` changed, its cumulative token counters went backwards,
or it stopped answering and came back. While the upstream does not answer, the
sidecar deregisters it (routers stop sending within a discovery interval) instead of
heartbeating a dead server; it registers again once it answers.

SIGTERM: deregister at once and exit 0. In the chart the engine container then keeps
serving through its preStop delay, so requests the routers still send are answered.
The command line (flags and their checks): worker/attach/command.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from shared.serving.aio import stop_task
from shared.wire.peers import served_adapters, served_model
from shared.wire.registry import Registry, WorkerRecord, fit_adapters
from worker.attach.echo_check import REQUEST_ID_HEADER, echo_advice, probe_id
from worker.attach.upstream_metrics import StockEngine, UpstreamLoad, parse_load
from worker.heartbeat import Heartbeat, connect

log = logging.getLogger("worker.attach")

# The most the sidecar reads of an upstream answer (/metrics every interval, /v1/models
# with its adapters): vLLM's /metrics is ~100 KB; read whole, any size was held and parsed.
MAX_ANSWER_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class AttachConfig:
    upstream: str
    engine: StockEngine
    redis_url: str
    worker_id: str
    advertise_url: str
    redis_prefix: str = "radixrouter:"
    redis_password_file: str | None = None
    served_model_name: str | None = None
    interval: float = 1.0
    ttl_intervals: int = 3
    timeout: float = 2.0
    # What the engine was started with: its batch cap (vLLM --max-num-seqs, SGLang
    # --max-running-requests; the router's seats, router/queue/seats.py; 0: unknown), and
    # whether it orders its queue by `priority` (vLLM --scheduling-policy priority).
    max_running_requests: int = 0
    priority_scheduling: bool = False
    # The engine's ZMQ KV-event publisher and replay socket (worker/attach/kv_subscriber.py).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_stream_len: int = 10_000


class Upstream:
    """What the sidecar knows of the stock server, refreshed once per interval."""

    def __init__(self, config: AttachConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session
        self.base = config.upstream.rstrip("/")
        self.epoch = 0.0
        self.model = ""
        self.adapters: tuple[str, ...] = ()  # LoRA adapters it serves (its /v1/models)
        self.capacity = 0
        self.block_size = 0  # of its KV events, as its own publisher names it (0: unknown)
        self._last: UpstreamLoad | None = None
        self._was_down = True
        self.echoes: bool | None = None  # answers echo x-request-id (None: not checked yet)

    async def _get(self, path: str, request_id: str | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout)
        headers = {REQUEST_ID_HEADER: request_id} if request_id is not None else None
        async with self.session.get(self.base + path, timeout=timeout, headers=headers) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            if request_id is not None:
                self.echoes = r.headers.get(REQUEST_ID_HEADER) == request_id
            body = bytearray()
            async for chunk in r.content.iter_any():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:  # before it is all held, and parsed
                    raise ValueError(f"{path} answered over {MAX_ANSWER_BYTES} bytes")
            text = body.decode("utf-8", "replace")
            return text if path == "/metrics" else json.loads(text)

    async def _identify(self) -> None:
        """Model name and KV capacity: read once per epoch (they change only on restart);
        and whether the upstream echoes request ids (worker/attach/echo_check.py)."""
        models = await self._get("/v1/models", probe_id())
        if not self.echoes:
            log.warning("%s", echo_advice(self.config.engine, self.base))
        self.model = self.config.served_model_name or served_model(models)
        self.adapters = fit_adapters(served_adapters(models))
        if self.config.engine == "sglang":
            info = await self._get("/get_server_info")
            value = info.get("max_total_num_tokens") if isinstance(info, dict) else None
            self.capacity = value if isinstance(value, int) and value > 0 else 0

    def _restarted(self, load: UpstreamLoad) -> bool:
        last = self._last
        if self._was_down or last is None:
            return True
        if (
            load.start_time is not None
            and last.start_time is not None
            and (abs(load.start_time - last.start_time) > 1e-3)
        ):
            return True
        return (
            load.prompt_tokens_total < last.prompt_tokens_total
            or load.cached_tokens_total < last.cached_tokens_total
        )

    async def poll(self) -> UpstreamLoad | None:
        """The upstream's load now, or None when it does not answer as the engine named."""
        try:
            load = parse_load(self.config.engine, await self._get("/metrics"))
            if load is None:
                raise ValueError(f"/metrics has no {self.config.engine} load metrics")
            if self._restarted(load):
                await self._identify()
                self.epoch = time.time()
                log.info("upstream %s is up: model %r, new epoch", self.base, self.model)
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            if not self._was_down:
                log.warning("upstream %s stopped answering (%s)", self.base, exc)
            self._was_down = True
            return None
        self._was_down = False
        self._last = load
        if load.capacity_tokens:
            self.capacity = load.capacity_tokens
        return load

    def record(self, load: UpstreamLoad) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.config.worker_id,
            url=self.config.advertise_url,
            model=self.model,
            adapters=self.adapters,
            engine=self.config.engine,
            epoch=self.epoch,
            running=load.running,
            waiting=load.waiting,
            kv_capacity_tokens=self.capacity,
            kv_used_tokens=int(load.kv_usage * self.capacity),
            prompt_tokens_total=load.prompt_tokens_total,
            cached_tokens_total=load.cached_tokens_total,
            host_cached_tokens_total=load.host_cached_tokens_total,
            kv_block_size=self.block_size,
            max_running_requests=self.config.max_running_requests,
            priority_scheduling=self.config.priority_scheduling,
        )


async def attach(config: AttachConfig, stop: asyncio.Event) -> None:
    """Heartbeat for the upstream until `stop` is set, then deregister it."""
    redis = connect(config.redis_url, config.interval, config.redis_password_file)
    registry = Registry(redis, config.redis_prefix)
    current: list[WorkerRecord] = []
    heartbeat = Heartbeat(registry, lambda: current[-1], config.interval, config.ttl_intervals)
    async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as tasks:
        upstream = Upstream(config, session)
        if config.kv_events:
            tasks.push_async_callback(_stop_all, _start_kv_events(config, registry, upstream))
        try:
            while not stop.is_set():
                try:
                    load = await upstream.poll()
                    if load is not None:
                        current[:] = [upstream.record(load)]
                        await heartbeat.beat()
                    elif heartbeat.joined:
                        await _leave(registry, current[-1])
                        heartbeat.joined = False
                except Exception:  # a sidecar that dies leaves its engine unregistered
                    log.exception("attach: unexpected error; retrying next interval")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), config.interval)
        finally:
            if heartbeat.joined and current:
                await _leave(registry, replace(current[-1], draining=True))
            await redis.aclose()


def _start_kv_events(
    config: AttachConfig, registry: Registry, upstream: Upstream
) -> list[asyncio.Task[None]]:
    from worker.attach.kv_subscriber import ZmqEventSubscriber, forward

    queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)
    assert config.kv_events is not None
    subscriber = ZmqEventSubscriber(config.kv_events, config.kv_events_replay, queue)

    def block_size(size: int) -> None:  # the heartbeat names it (router/holdings/kv_feed.py)
        upstream.block_size = size

    subscriber.on_block_size = block_size
    return [
        asyncio.create_task(subscriber.run(), name="kv-events-sub"),
        asyncio.create_task(
            forward(
                queue,
                registry,
                config.worker_id,
                lambda: upstream.epoch,
                config.kv_events_stream_len,
                subscriber.complete,
            ),
            name="kv-events-forward",
        ),
    ]


async def _stop_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        await stop_task(task)


async def _leave(registry: Registry, record: WorkerRecord) -> None:
    try:
        await registry.leave(record)
        log.info("deregistered %s", record.worker_id)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("could not deregister in Redis (%s); the record expires", exc)
