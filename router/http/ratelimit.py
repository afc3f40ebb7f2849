"""Per-client rate limit on the inference endpoints, shared by every router replica.

With `rate_limit_per_key` set, each client may send that many requests per second on
average, in bursts of up to `rate_limit_burst`; beyond that it gets 429 with a
`Retry-After` saying when the next request will be accepted.

Who is a client: with `api_keys` configured, the (already verified) key, as a hash; the
table never holds keys. Without keys, the client's address: an arbitrary Bearer value
would otherwise buy a fresh bucket per request. Behind a load balancer or ingress, the
address is the first hop of `X-Forwarded-For` that is not one of `trusted_proxies`
(CIDRs); the header is ignored unless the direct peer is such a proxy, so a client
cannot choose its own address.

Where the limit lives: with Redis (`redis_url`), in Redis, one GCRA cell per client
updated by one Lua script per request (atomic, on Redis's clock), so N replicas admit
the configured rate in total, not N times it. The script is the whole protocol: one
round trip, no read-modify-write race between replicas. When Redis does not answer
within `rate_limit_redis_timeout`, each replica falls back to its own in-process token
bucket (logged once per outage) and asks Redis again only `REDIS_RETRY_S` later: a Redis
outage must not stop traffic, nor slow it (a Redis that stopped answering used to add
the whole timeout to every request until it came back). Without Redis, the in-process
bucket is the limiter.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.http.auth import request_bearer_token
from shared.config import RouterConfig
from shared.serving.errors import APIError
from shared.serving.http import INFERENCE_PATHS
from shared.wire.registry import Registry

log = logging.getLogger(__name__)

MAX_CLIENTS = 100_000
REDIS_RETRY_S = 1.0  # after Redis failed, how long the local bucket decides alone

# GCRA (the generic cell rate algorithm): one number per client, the theoretical arrival
# time (TAT) of its next request, in microseconds of Redis's clock. A request at `now` is
# admitted when now >= TAT - tolerance, and moves TAT on by one emission interval. This
# equals a token bucket of `burst` tokens refilled at `rate`, in one key and one write.
# Returns 0 when admitted, else the microseconds until a request would be.
GCRA_LUA = """
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - tolerance - now
if wait > 0 then return math.ceil(wait) end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX',
           math.ceil((new_tat - now) / 1000) + 1)
return 0
"""


class TokenBuckets:
    """The in-process limiter: a token bucket per client, bounded (least recently seen
    clients are forgotten, which only ever gives them a fresh, full bucket)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # tokens, at

    def take(self, client: bytes) -> float:
        """Take one token; 0.0 when allowed, else seconds until a token is available."""
        now = self.clock()
        tokens, at = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return wait


class RedisGcra:
    """The shared limiter: the GCRA script above, run once per request."""

    def __init__(self, redis: Redis, registry: Registry, rate: float, burst: int) -> None:
        self.registry = registry
        self.interval_us = 1e6 / rate
        self.tolerance_us = (burst - 1) * self.interval_us
        self._script = redis.register_script(GCRA_LUA)

    async def take(self, client: bytes) -> float:
        """Seconds until admitted (0.0: admitted now); raises RedisError/OSError/TimeoutError."""
        key = self.registry.ratelimit_key(client.hex())
        wait_us = await self._script(keys=[key], args=[self.interval_us, self.tolerance_us])
        return int(wait_us) / 1e6


class ClientIdentity:
    """Who a request comes from, for the limiter (see the module docstring)."""

    def __init__(self, config: RouterConfig) -> None:
        self.keyed = bool(config.api_keys)
        self.proxies = tuple(ipaddress.ip_network(c, strict=False) for c in config.trusted_proxies)

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.strip())
        except ValueError:
            return False
        return any(ip in net for net in self.proxies)

    def address(self, request: web.Request) -> str:
        peer = request.remote or ""
        if not self.proxies or not self._trusted(peer):
            return peer
        # Right to left: each trusted proxy appended the address it received from.
        hops = [
            h.strip() for h in ",".join(request.headers.getall("X-Forwarded-For", [])).split(",")
        ]
        for hop in reversed([h for h in hops if h]):
            if not self._trusted(hop):
                return hop
        return peer

    def __call__(self, request: web.Request) -> bytes:
        if self.keyed:
            token = request_bearer_token(request)
            if token is not None:  # the auth check has matched it against api_keys
                return hashlib.sha256(b"key:" + token.encode()).digest()[:16]
        return hashlib.sha256(b"ip:" + self.address(request).encode()).digest()[:16]


RateLimitCheck = Callable[[web.Request], Awaitable[None]]


def make_rate_limit_check(
    config: RouterConfig, clock: Callable[[], float], redis: Redis | None = None
) -> RateLimitCheck | None:
    """Raises 429 for an inference request over its client's rate; None when no limit is
    set. Run by the router's one middleware (router/http/edge.py)."""
    if config.rate_limit_per_key is None:
        return None
    rate, burst = config.rate_limit_per_key, config.rate_limit_burst
    local = TokenBuckets(rate, burst, clock)
    shared = (
        None
        if redis is None
        else RedisGcra(redis, Registry(redis, config.redis_prefix), rate, burst)
    )
    identity = ClientIdentity(config)
    failed_at: float | None = None  # when Redis last failed; None while it answers

    async def wait_for(client: bytes) -> float:
        nonlocal failed_at
        if shared is not None and (failed_at is None or clock() >= failed_at + REDIS_RETRY_S):
            try:
                wait = await shared.take(client)
            except (RedisError, OSError, TimeoutError) as exc:
                if failed_at is None:
                    log.warning("rate limit: Redis unavailable (%s); limiting per replica", exc)
                failed_at = clock()
            else:
                if failed_at is not None:
                    log.info("rate limit: Redis reachable again; limiting across replicas")
                failed_at = None
                return wait
        return local.take(client)

    async def check(request: web.Request) -> None:
        if request.path in INFERENCE_PATHS:
            wait = await wait_for(identity(request))
            if wait > 0:
                raise APIError(
                    429,
                    f"rate limit of {rate:g} requests/s exceeded",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )

    return check
