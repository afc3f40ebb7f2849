"""HTTP pieces both services use, defined once: paths, content types, buckets, the SSE
response class."""

from __future__ import annotations

from aiohttp import web

# Endpoints that run inference: rate-limited by the router, counted in flight and
# refused while draining by the worker.
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})

EVENT_STREAM = "text/event-stream"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

# Request latency histogram buckets (seconds); Prometheus adds +Inf. Up to 2 minutes:
# a long generation is still a normal request.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EventStreamResponse(web.StreamResponse):
    """A stream whose status line and headers go out with its first chunk, in one write.

    aiohttp's own `web.Response` works this way (the class attribute below); a plain
    `StreamResponse` sends the headers alone at `prepare()`, one more socket write (and
    wake-up of the client) per stream. Callers write their first chunk right after
    `prepare()`, so the headers are never held back.
    """

    _send_headers_immediately = False
