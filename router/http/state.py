"""The router app's typed state: every AppKey in one place but the proxy's
(`router.upstream.proxy.PROXY`, beside its class: the HTTP room's state then sits above
the upstream room, not between it and the handlers)."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from router.fleet.discovery import Discovery
from router.fleet.table import Fleet
from router.holdings.kv_feed import KvEventFeed
from router.holdings.sync import ReplicaSync
from router.http.edge import Edge
from router.http.tokenize import Tokenizing
from router.metrics import Metrics
from router.queue.fleet_queue import FleetQueue
from router.routing import Routing
from shared.config import RouterConfig
from shared.serving.http import request_key
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire.peers import Rejections

CONFIG = web.AppKey("config", RouterConfig)
CLOCK = web.AppKey("clock", Callable[[], float])
FLEET = web.AppKey("fleet", Fleet)
ROUTING = web.AppKey("routing", Routing)  # the holdings room and the policy
METRICS = web.AppKey("metrics", Metrics)
QUEUE = web.AppKey("queue", FleetQueue)  # seats and the waiting requests (router/queue/)
OPENAPI = web.AppKey("openapi", dict)
REJECTIONS = web.AppKey("rejections", Rejections)  # counted at the Redis boundary
SYNC = web.AppKey("sync", ReplicaSync | None)  # replica sync; None on a lone router
TOKENS = web.AppKey("tokens", PromptTokens)  # the workers' tokenizer (config `tokenizer`)
TOKENIZE = web.AppKey("tokenize", Tokenizing)  # ... used bounded (router/http/tokenize.py)
KV_FEED = web.AppKey("kv_feed", KvEventFeed)  # workers' KV events (config `kv_events`)
EDGE = web.AppKey("edge", Edge)  # what every request passes through (router/http/edge.py)


class Inference:
    """What the inference handlers read of their app, bound once by `create_app`: one
    lookup a request, not seven (`Application.__getitem__` is a Python call each)."""

    __slots__ = ("clock", "config", "fleet", "metrics", "queue", "tokenize")

    def __init__(
        self, config: RouterConfig, clock: Callable[[], float], fleet: Fleet, metrics: Metrics,
        queue: FleetQueue, tokenize: Tokenizing | None,
    ) -> None:  # fmt: skip
        self.config, self.clock, self.fleet = config, clock, fleet
        self.metrics, self.queue, self.tokenize = metrics, queue, tokenize


INFERENCE = web.AppKey("inference", Inference)
# Set up in cleanup_ctx (they need the running loop):
# Per request: its ticket in the fleet queue (its first byte is told to the queue).
TICKET = request_key("ticket")
SESSION = web.AppKey("session", aiohttp.ClientSession)
DISCOVERY = web.AppKey("discovery", Discovery)
