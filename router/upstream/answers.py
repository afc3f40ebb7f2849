"""What passes between the router and a worker, and what a worker's answer means.

Workers are peers, not trusted code: a worker (or whatever sits at a URL someone put in
Redis) chooses its status, headers and body. So:

- **Request headers** reaching a worker come from an allow-list: cookies, client
  credentials, `Content-Encoding` (the body goes on decoded) and whatever a client
  invents for a server behind the worker (`Metadata-Flavor`) stay at the router. The
  router's own `worker_api_key` is the only credential sent, unless
  `forward_authorization` passes the client's on (and no worker key is set).
- **Response headers** reaching a client come from an allow-list too: a worker once set
  `text/html` with a script, wildcard CORS with credentials, `WWW-Authenticate`,
  `Refresh` and HSTS, and all of it reached clients.
- **Content type** of an inference answer is `application/json` or `text/event-stream`;
  anything else is a broken worker (502, retried elsewhere). So is an answer with a
  `Content-Encoding`: the router asks for `identity` and relays bodies as they come.
- **Redirects** are never followed (the upstream client, `router/upstream/pool.py`,
  has no notion of them; `allow_redirects=False` on every aiohttp call): a worker
  answering 307 to a metadata address had the router fetch it with the client's body
  and return the result. A 3xx is a broken worker like any other odd status.
- **Size**: a buffered (non-streamed) answer is read to at most `max_response_bytes`
  (502 beyond; one 300 MB body took the router from 59 to 432 MB RSS).

Failure classes (`classify`), which decide retries and the breaker (`router/fleet/table.py`):

    connect error, timeout, 502/503/504, 3xx, other 5xx, bad type  → worker health:
        retry elsewhere, counts toward the worker's breaker
    503 with Retry-After, or an "overloaded" error; 429            → busy, not broken:
        retry elsewhere, no breaker; all busy → 503 + Retry-After to the client
    500                                                            → suspect: retry once
        elsewhere; a second 500 for the same request is the request's fault (stop,
        answer 500, no breaker); a success elsewhere makes it the worker's failure
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from router.fleet.workers import FailureKind, Worker
from router.upstream.connection import UpstreamBroken, WorkerConnection
from shared.config import RouterConfig
from shared.errors import APIError

FORWARD_REQUEST = frozenset({"accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
FORWARD_RESPONSE = frozenset({"content-type", "cache-control", "retry-after", "x-request-id"})
ANSWER_TYPES = frozenset({"application/json", "text/event-stream"})
MAX_ERROR_BYTES = 65536  # what is read of a busy worker's error body
MAX_RETRY_AFTER_S = 60


def worker_authorization(config: RouterConfig) -> str | None:
    """The Authorization value the router sends every worker (`worker_api_key`)."""
    return f"Bearer {config.worker_api_key}" if config.worker_api_key else None


def encodable(value: str) -> bool:
    """aiohttp hands over non-UTF-8 header bytes surrogate-escaped; they cannot be sent
    on. CR and LF never pass (its parser refuses them; this does not rely on that)."""
    if "\r" in value or "\n" in value:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() in FORWARD_RESPONSE])


class AttemptFailed(Exception):
    """One attempt failed before the client saw a byte; `kind` says whose fault."""

    def __init__(
        self,
        message: str,
        kind: FailureKind,
        status: int = 502,
        *,
        retry_after: int = 0,
        suspect: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status
        self.retry_after = retry_after  # busy: how long the worker asked to wait
        self.suspect = suspect  # a 500: the worker's fault or the request's, not known yet
        # The proxy's `Attempt` (router/fleet/table.py): whose verdict may wait.
        self.attempt: Any = None


def request_fault(workers: int) -> APIError:
    """The same request failed with 500 on two workers: the request, not the fleet, is at
    fault, so it is answered now and counted against no breaker (three such requests
    used to open every breaker and take the fleet to 503)."""
    return APIError(
        500, f"the request failed on {workers} workers (each answered 500); not retried",
        code="request_failed",
    )  # fmt: skip


class UpstreamErrors:
    """Turns a failure talking to the worker into an `AttemptFailed` (retryable).

    A plain class, not @contextmanager: it wraps every upstream await on the hot path.
    """

    __slots__ = ("kind", "what", "worker")

    def __init__(self, worker: Worker, what: str, kind: FailureKind) -> None:
        self.worker, self.what, self.kind = worker, what, kind

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: object
    ) -> None:
        wid = self.worker.worker_id
        if kind is not None and issubclass(kind, TimeoutError):
            raise AttemptFailed(f"worker {wid} timed out", FailureKind.TIMEOUT, 504) from None
        if isinstance(e, UpstreamBroken):
            message = f"{self.what.format(wid)}: {type(e).__name__}"
            raise AttemptFailed(message, self.kind) from None


def _retry_after(value: str | None) -> int:
    """Seconds from a Retry-After header (delta-seconds only); 0 when absent or odd."""
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return 0
    return min(MAX_RETRY_AFTER_S, math.ceil(seconds)) if math.isfinite(seconds) else 0


async def _says_overloaded(upstream: WorkerConnection) -> bool:
    try:
        body = await upstream.read_body()
        error = json.loads(body[:MAX_ERROR_BYTES]).get("error", {})
    except (ValueError, AttributeError, UpstreamBroken, TimeoutError):
        return False
    return isinstance(error, dict) and "overloaded" in (
        str(error.get("code")),
        str(error.get("type")),
    )


async def classify(upstream: WorkerConnection, worker: Worker) -> None:
    """Raise `AttemptFailed` unless `upstream` is an answer to relay (see the table above)."""
    status = upstream.status
    wid = worker.worker_id
    if status >= 500 or status == 429:
        retry_after = _retry_after(upstream.headers.get("Retry-After"))
        if status == 429 or (status == 503 and (retry_after or await _says_overloaded(upstream))):
            raise AttemptFailed(
                f"worker {wid} is busy ({status})", FailureKind.BUSY, 503,
                retry_after=max(1, retry_after),
            )  # fmt: skip
        if status == 500:
            raise AttemptFailed(
                f"worker {wid} answered 500", FailureKind.UPSTREAM_5XX, suspect=True
            )
        raise AttemptFailed(f"worker {wid} answered {status}", FailureKind.UPSTREAM_5XX)
    if status < 200 or 300 <= status < 400:
        raise AttemptFailed(f"worker {wid} answered {status}", FailureKind.BAD_ANSWER)
    if upstream.content_type not in ANSWER_TYPES:
        raise AttemptFailed(
            f"worker {wid} answered with content type {upstream.content_type[:60]!r}",
            FailureKind.BAD_ANSWER,
        )
    encoding = upstream.headers.get("Content-Encoding")  # type: ignore[union-attr]
    if encoding is not None and encoding.strip().lower() != "identity":
        raise AttemptFailed(
            f"worker {wid} answered with content encoding {encoding[:40]!r} (identity was asked)",
            FailureKind.BAD_ANSWER,
        )


async def read_capped(upstream: WorkerConnection, limit: int, worker: Worker) -> bytes:
    """The whole body of a buffered answer, at most `limit` bytes (AttemptFailed beyond;
    the connection stops reading at `max_response_bytes` whatever `limit` is)."""
    size = upstream.content_length
    if size is not None and size > limit:
        raise _too_big(worker, limit)
    try:
        with UpstreamErrors(worker, "worker {} broke off", FailureKind.BROKEN):
            body = await upstream.read_body()
    except AttemptFailed:
        if upstream.too_big:
            raise _too_big(worker, limit) from None
        raise
    if len(body) > limit:
        raise _too_big(worker, limit)
    return body


def _too_big(worker: Worker, limit: int) -> AttemptFailed:
    return AttemptFailed(
        f"worker {worker.worker_id} answer exceeds max_response_bytes ({limit})",
        FailureKind.BAD_ANSWER,
    )


# The key, then its integer value: workers put `usage` last, so the last occurrence is
# usage's. Quotes inside JSON strings are escaped, so the quoted key cannot come from text.
_CACHED_KEY = b'"cached_tokens"'
_CACHED_VALUE = re.compile(rb"\s*:\s*(\d+)")


def cached_tokens_from_json(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a JSON body, or None.

    Found by searching from the end instead of parsing the whole body: on the router's
    hot path a full `json.loads` of every answer cost more than the rest of this metric.
    """
    at = body.rfind(_CACHED_KEY)
    if at < 0 or body.rfind(b'"prompt_tokens_details"', 0, at) < 0:
        return None
    found = _CACHED_VALUE.match(body, at + len(_CACHED_KEY))
    return int(found[1]) if found else None


def cached_tokens_from_sse(tail: bytes) -> int | None:
    """The last `cached_tokens` reported in the tail of an SSE stream (the final usage chunk)."""
    at = tail.rfind(_CACHED_KEY)
    if at < 0:
        return None
    start = tail.rfind(b"\n", 0, at) + 1  # the event line holding the key
    end = tail.find(b"\n", at)
    line = tail[start : end if end >= 0 else len(tail)].strip()
    return cached_tokens_from_json(line) if line.startswith(b"data:") else None
