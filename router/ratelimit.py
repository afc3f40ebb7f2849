"""Per-client rate limit on the inference endpoints: a token bucket per API key.

With `rate_limit_per_key` set, each client may send that many requests per second on
average, in bursts of up to `rate_limit_burst`; beyond that it gets 429 with a
`Retry-After` saying when the next request will be accepted. Clients are told apart by
their API key (a hash of it: the table never holds keys), or by their address when the
router has no keys. The table is bounded (least recently seen clients are forgotten,
which only ever gives them a fresh, full bucket).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from router.auth import bearer_token
from shared.config import RouterConfig
from shared.errors import APIError, Handler
from shared.http import INFERENCE_PATHS

MAX_CLIENTS = 100_000


class TokenBuckets:
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


def client_id(request: web.Request) -> bytes:
    token = bearer_token(request)
    if token is not None:
        return hashlib.sha256(token.encode()).digest()
    return (request.remote or "").encode()


def make_rate_limit_middleware(
    config: RouterConfig, clock: Callable[[], float]
) -> web.middleware | None:
    if config.rate_limit_per_key is None:
        return None
    buckets = TokenBuckets(config.rate_limit_per_key, config.rate_limit_burst, clock)

    @web.middleware
    async def rate_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in INFERENCE_PATHS:
            wait = buckets.take(client_id(request))
            if wait > 0:
                raise APIError(
                    429,
                    f"rate limit of {config.rate_limit_per_key:g} requests/s exceeded",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        return await handler(request)

    return rate_limit_middleware
