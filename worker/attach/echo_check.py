"""Does the stock engine echo `x-request-id`? And, where not, the exact fix.

The router reuses a keep-alive connection to a worker only after an answer that echoed
the request's id (router/upstream/connection.py): a worker that does not echo costs the
router a new connection per request, about 1.4x its CPU per request
(loadtests/results/router_cpu.md). `radix-worker attach` runs beside an engine it did not
start, so it cannot turn the switch on itself: it checks once per upstream epoch, with
one request carrying an id, and says what to add where the answer did not echo it.

- vLLM: `vllm serve ... --enable-request-id-headers` (its `XRequestIdMiddleware` answers
  every request with the `X-Request-Id` it was sent, or a new one);
- SGLang: no switch (its HTTP server adds only the API-key and metrics middlewares), so
  the router opens a connection per request to it; putting a proxy that echoes the
  header in front of it (e.g. nginx `add_header X-Request-Id $http_x_request_id`)
  restores pooling.
"""

from __future__ import annotations

import os

REQUEST_ID_HEADER = "x-request-id"

FIX = {
    "vllm": "restart it with `vllm serve ... --enable-request-id-headers`",
    "sglang": (
        "SGLang has no switch for it; put a proxy in front that echoes the header "
        "(nginx: `add_header X-Request-Id $http_x_request_id always;`)"
    ),
}


def probe_id() -> str:
    """A fresh id to send with the check (a plain token, as routers send)."""
    return "attach-echo-" + os.urandom(8).hex()


def echo_advice(engine: str, base_url: str) -> str:
    """The warning for an upstream whose answer did not echo the id it was sent."""
    fix = FIX.get(engine, "make it echo the x-request-id header it is sent")
    return (
        f"upstream {base_url} does not echo x-request-id: routers open a new connection "
        f"per request to it (about 1.4x their CPU per request); {fix}"
    )
