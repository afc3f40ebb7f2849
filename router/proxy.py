"""Forward one inference request to the worker the policy picks, and its answer back.

Attempt loop: select among routable workers not yet tried → send → on a failure
*before anything reached the client* (connect error, timeout, 5xx, a body cut short
while buffering) count a breaker failure and retry on another worker, up to
`max_retries` times with exponential backoff. Once the first byte of a stream went to
the client a failure cannot be retried: the stream ends with an SSE error event.

The proxy keeps no books: each try is a `Fleet.attempt` (the load it holds, the breaker
probe), and its outcome is told to the table (`succeeded`, or `failed` with a
`FailureKind`); the table updates the breaker, the counters and the policy's columns.

Streams are relayed chunk by chunk (`readany` → `write`, no buffering), so time to
first token through the router stays close to going direct. Every attempt is released
on exit whatever the exit (end, error, cancel, timeout).
The app runs with handler cancellation on, so a client that disconnects cancels the
handler, which closes the upstream connection and the worker sees the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.fleet import Attempt, Fleet
from router.metrics import Metrics, cached_tokens_from_json, cached_tokens_from_sse
from router.policy.base import Decision, Policy, RouteRequest
from router.sync import ReplicaSync
from router.workers import FailureKind, Worker
from shared.config import RouterConfig
from shared.errors import APIError, error_body
from shared.http import EVENT_STREAM, EventStreamResponse

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
     "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)  # fmt: skip
# Request headers a worker may see: an allow-list, so cookies, client credentials,
# Content-Encoding (the body goes on decoded) and whatever a client invents for a server
# behind the worker (`Metadata-Flavor`) stay at the router. The session header is added.
FORWARD_REQUEST = frozenset({"accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date", "set-cookie"}
SSE_TAIL_BYTES = 16384  # enough for the final usage chunk


def end_to_end_headers(
    headers: CIMultiDict[str] | dict[str, str], drop: frozenset[str]
) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, including any the Connection header names."""
    connection = headers.get("Connection")
    if connection:  # rare on keep-alive HTTP/1.1: only then build the extra set
        drop = drop | {t.strip().lower() for t in connection.split(",")}
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])


def worker_authorization(config: RouterConfig) -> str | None:
    """The Authorization value the router sends every worker (`worker_api_key`)."""
    return f"Bearer {config.worker_api_key}" if config.worker_api_key else None


def _encodable(value: str) -> bool:
    # aiohttp hands over non-UTF-8 header bytes surrogate-escaped; sending them on would
    # fail in the client with an error that is not a ClientError.
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Routed:
    """A validated request, ready to forward."""

    endpoint: str  # metrics label: chat | completions | generate
    path: str  # upstream path, e.g. /v1/chat/completions
    body: bytes  # forwarded unchanged
    text: str  # what the policy routes on
    session_key: str | None
    model: str | None


class _AttemptFailed(Exception):
    def __init__(self, message: str, kind: FailureKind, status: int = 502) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


class _UpstreamErrors:
    """A failure talking to the worker before the client saw a byte: retryable.

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
            raise _AttemptFailed(f"worker {wid} timed out", FailureKind.TIMEOUT, 504) from None
        if isinstance(e, aiohttp.ClientError):
            message = f"{self.what.format(wid)}: {type(e).__name__}"
            raise _AttemptFailed(message, self.kind) from None


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        policy: Policy,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        sync: ReplicaSync | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.policy = policy
        self.session = session
        self.metrics = metrics
        self.clock = clock
        # No total: a stream may last as long as it keeps sending. request_timeout bounds
        # each wait for bytes (the first byte of a buffered answer, or the next chunk), so a
        # hung worker is caught without cutting a healthy long stream.
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout, sock_read=config.request_timeout
        )
        self._forward = FORWARD_REQUEST | {config.session_header.lower()}
        self._worker_auth = worker_authorization(config)
        # Router replicas sharing decisions (router/sync.py); None on a lone router.
        self.sync = sync

    def _select(self, routed: Routed, tried: list[str]) -> tuple[Worker, Decision] | None:
        now = self.clock()
        # The fleet keeps this view current as workers, breakers and loads change, so a
        # request costs no pass over the fleet in Python (a one-off copy only on retries).
        sync = self.sync
        remote = sync.remote_inflight() if sync is not None else None
        view = self.fleet.view(now, routed.model, exclude=tried, remote=remote)
        if not view:
            return None
        decision = self.policy.select(RouteRequest(routed.text, routed.session_key), view, now)
        if sync is not None:
            sync.publish(decision.worker_id, routed.text)
        self.metrics.decision(decision.reason)
        return self.fleet.workers[decision.worker_id], decision

    async def forward(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        if routed.model and not self.fleet.knows_model(routed.model):
            raise APIError(
                404,
                f"model {routed.model!r} is not served by this fleet",
                param="model",
                code="model_not_found",
            )
        tried: list[str] = []
        failure: _AttemptFailed | None = None
        for attempt in range(self.config.max_retries + 1):
            picked = self._select(routed, tried)
            if picked is None:
                break
            worker, decision = picked
            try:
                return await self._attempt(request, routed, worker, decision)
            except _AttemptFailed as e:
                failure = e
                tried.append(worker.worker_id)
                if attempt < self.config.max_retries:
                    self.metrics.retries.inc()
                    await asyncio.sleep(self.config.retry_backoff * (2**attempt))
        if failure is None:
            raise APIError(
                503,
                "no healthy worker is available",
                code="no_workers",
                headers={"Retry-After": "1"},
            )
        raise APIError(
            failure.status,
            f"all {len(tried)} attempts failed; last: {failure}",
            code="upstream_error",
        )

    def _request_headers(self, request: web.Request) -> CIMultiDict[str]:
        forward = self._forward
        headers = CIMultiDict(
            [(k, v) for k, v in request.headers.items() if k.lower() in forward and _encodable(v)]
        )
        headers["Content-Type"] = "application/json"  # the body was parsed as JSON
        if self._worker_auth is not None:
            headers["Authorization"] = self._worker_auth
        elif self.config.forward_authorization and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    def _response_headers(
        self, upstream: aiohttp.ClientResponse, worker: Worker, d: Decision
    ) -> CIMultiDict[str]:
        headers = end_to_end_headers(upstream.headers, RESPONSE_DROP)
        headers["x-radix-worker"] = worker.worker_id
        headers["x-radix-route-reason"] = d.reason
        headers["x-radix-matched-chars"] = str(d.matched_chars)
        return headers

    async def _attempt(
        self, request: web.Request, routed: Routed, worker: Worker, decision: Decision
    ) -> web.StreamResponse:
        with self.fleet.attempt(worker, self.clock()) as attempt:
            try:
                return await self._send(request, routed, attempt, decision)
            except _AttemptFailed as e:
                self.fleet.failed(attempt, e.kind, self.clock())
                raise

    async def _send(
        self, request: web.Request, routed: Routed, attempt: Attempt, decision: Decision
    ) -> web.StreamResponse:
        worker = attempt.worker
        with _UpstreamErrors(worker, "cannot reach worker {}", FailureKind.CONNECT):
            upstream = await self.session.post(
                worker.url + routed.path, data=routed.body,
                headers=self._request_headers(request), timeout=self.timeout,
            )  # fmt: skip
        done = False
        try:
            if upstream.status >= 500:
                message = f"worker {worker.worker_id} answered {upstream.status}"
                raise _AttemptFailed(message, FailureKind.UPSTREAM_5XX)
            if upstream.content_type == EVENT_STREAM:
                resp = await self._relay_stream(request, upstream, attempt, decision)
            else:
                resp = await self._relay_buffered(upstream, attempt, decision)
            done = True
            return resp
        finally:
            # Anything but a complete relay (error, cancel) must drop the connection, so
            # the worker sees the request abandoned instead of a pooled half-read socket.
            if done:
                upstream.release()
            else:
                upstream.close()

    async def _relay_buffered(
        self, upstream: aiohttp.ClientResponse, attempt: Attempt, decision: Decision
    ) -> web.Response:
        worker = attempt.worker
        with _UpstreamErrors(worker, "worker {} broke off", FailureKind.BROKEN):
            body = await upstream.read()
        cached = cached_tokens_from_json(body) if upstream.status == 200 else None
        self._succeeded(attempt, decision, cached)
        return web.Response(
            body=body,
            status=upstream.status,
            headers=self._response_headers(upstream, worker, decision),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        attempt: Attempt,
        decision: Decision,
    ) -> web.StreamResponse:
        worker = attempt.worker
        # The first chunk is read before anything goes to the client, so a worker that
        # fails before its first event is retried elsewhere like any failure before the
        # first byte, and the headers leave together with that chunk.
        with _UpstreamErrors(worker, "worker {} broke off", FailureKind.BROKEN):
            chunk = await upstream.content.readany()
        content = upstream.content
        resp = EventStreamResponse(
            status=upstream.status, headers=self._response_headers(upstream, worker, decision)
        )
        await resp.prepare(request)
        tail = b""
        broken: tuple[FailureKind, str] | None = None
        # Each chunk is written as soon as it is read; only the last one (the upstream has
        # already ended) waits to leave together with the end-of-stream marker.
        while chunk and not content.is_eof():
            try:
                await resp.write(chunk)
            except ConnectionError:
                return resp  # the client left; the caller closes the upstream
            tail = (tail + chunk)[-SSE_TAIL_BYTES:]
            try:
                chunk = await content.readany()
            except TimeoutError:
                chunk = b""
                broken = FailureKind.TIMEOUT, f"worker {worker.worker_id} timed out mid-stream"
            except aiohttp.ClientError as e:
                chunk = b""
                broken = (
                    FailureKind.BROKEN,
                    f"worker {worker.worker_id} broke off mid-stream: {type(e).__name__}",
                )
        if broken is None:
            self._succeeded(attempt, decision, cached_tokens_from_sse(tail + chunk))
        else:
            self.fleet.failed(attempt, broken[0], self.clock())
            event = json.dumps(error_body(502, broken[1], code="upstream_error"))
            chunk = f"data: {event}\n\n".encode()
        with contextlib.suppress(ConnectionError):  # the client left at the very end
            await resp.write_eof(chunk)
        return resp

    def _succeeded(self, attempt: Attempt, decision: Decision, cached: int | None) -> None:
        predicted = decision.matched_chars / self.config.tree_chars_per_token
        self.fleet.succeeded(attempt, predicted, cached)
        if cached is not None:
            self.metrics.observe_cached(attempt.worker.worker_id, predicted, cached)
