"""The worker app's typed state: one `web.AppKey` per resource, all in one place.

Handlers import these keys; `worker.http.app.create_app` fills them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from shared.config import WorkerConfig
from worker.engine.types import Engine
from worker.heartbeat import Heartbeat
from worker.http.metrics import WorkerMetrics


@dataclass
class WorkerState:
    """What changes while the worker runs (the config never does)."""

    worker_id: str
    served_model: str
    epoch: float = field(default_factory=time.time)
    url: str | None = None  # what routers dial; known once the socket is bound
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set when inflight == 0
    booted: asyncio.Event = field(default_factory=asyncio.Event)  # start() returned or failed
    failure: BaseException | None = None  # the engine failed to start


CONFIG = web.AppKey("config", WorkerConfig)
ENGINE = web.AppKey("engine", Engine)
STATE = web.AppKey("state", WorkerState)
METRICS = web.AppKey("metrics", WorkerMetrics)
HEARTBEAT = web.AppKey("heartbeat", Heartbeat)
