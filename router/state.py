"""The router app's typed state: every AppKey in one place."""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from router.admission import Admission
from router.discovery import Discovery
from router.fleet import Fleet
from router.metrics import Metrics
from router.policy import Policy
from router.proxy import Proxy
from shared.config import RouterConfig

CONFIG = web.AppKey("config", RouterConfig)
CLOCK = web.AppKey("clock", Callable[[], float])
FLEET = web.AppKey("fleet", Fleet)
POLICY = web.AppKey("policy", Policy)
METRICS = web.AppKey("metrics", Metrics)
ADMISSION = web.AppKey("admission", Admission)
OPENAPI = web.AppKey("openapi", dict)
# Set up in cleanup_ctx (they need the running loop):
SESSION = web.AppKey("session", aiohttp.ClientSession)
PROXY = web.AppKey("proxy", Proxy)
DISCOVERY = web.AppKey("discovery", Discovery)

DEFAULT_CLOCK: Callable[[], float] = time.monotonic
