"""Forward one inference request to the worker the policy picks, and its answer back.

Attempt loop: select among routable workers not yet tried → send → on a failure
*before anything reached the client* retry on another worker, up to `max_retries`
times with exponential backoff (a failure caused by another answer's bytes on the
connection, `ForeignAnswer`, is first sent once more to the same worker on a fresh
connection: the request was innocent, and a one-worker fleet has no other to try); what a worker's answer means (broken, busy, or a 500
that may be the request's fault) and what may pass in either direction is
`router/upstream/answers.py`. Once the first byte of a stream went to the client a failure
cannot be retried: the stream ends with an SSE error event.

The proxy keeps no books: each try is a `Fleet.attempt` (the load it holds, the breaker
probe), and its outcome is told to the table (`succeeded` with what the answer reported,
or `failed` with a `FailureKind`); the table updates the breaker, the counters and the
policy's columns, and tells the holdings room what the answer said of the cache. A
whole buffered answer's success also ends its try in that one call (`release=True`: no
await is left before the answer leaves); a stream's try ends after its last write.

Answers leave through the request's `Responder` (router/upstream/responder.py):
aiohttp's response objects, or the router's own framing where its own protocol took the
request; the relay does not know which. Streams are relayed chunk by chunk (`readany` →
`write`, no buffering), so time to first token through the router stays close to going
direct. A write the client does
not take within `stream_write_timeout` ends the stream and closes the upstream
connection, so the worker frees the request's slot and KV (a client that never read
held both for as long as it stayed connected). Every attempt is released whatever the
exit. With handler cancellation on, a client that disconnects cancels the handler,
which closes the upstream connection: the worker sees the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import Counter

from router.fleet.table import Attempt, Fleet
from router.fleet.workers import FailureKind, Worker
from router.holdings import sessions
from router.holdings.calibration import prompt_tokens_from
from router.holdings.prediction import RouteRequest
from router.holdings.sessions import SessionTable
from router.holdings.sync import ReplicaSync
from router.policy.base import Decision
from router.routing import Routing
from router.upstream.answers import (
    FORWARD_REQUEST,
    RESPONSE_NAMES,
    AllowedNames,
    AttemptFailed,
    UpstreamErrors,
    answer_fine,
    attempt_failed,
    cached_tokens_from_json,
    cached_tokens_from_sse,
    classify,
    encodable,
    read_capped,
    request_fault,
    worker_authorization,
)
from router.upstream.limits import UpstreamBroken
from router.upstream.responder import AIOHTTP, RESPONDER, StreamReply, responder_of
from router.upstream.transport import Answer, Transport
from shared.config import RouterConfig
from shared.serving import json_codec
from shared.serving.access_log import REQUEST_ID, fresh_request_id
from shared.serving.errors import APIError, error_body
from shared.serving.http import EVENT_STREAM
from shared.wire.protocol import PIN_KEY_HEADER
from shared.wire.registry import MAX_NAME_CHARS
from shared.wire.service_class import with_priority

SSE_TAIL_BYTES = 16384  # enough for the final usage chunk


def _event_end(data: bytes) -> int:
    """Where the last whole SSE event in `data` ends (0: none ends in it)."""
    if data.endswith(b"\n\n"):  # the usual case: a chunk of whole events
        return len(data)
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class Routed:
    """A validated request, ready to forward (read-only by convention). A slots class: a
    frozen dataclass set each of its eight fields through `object.__setattr__`, 3.0 us
    per request against 0.6 us here (timeit)."""

    __slots__ = (
        "body", "cache_key", "endpoint", "model", "namespace", "path", "pin_ttl", "priority",
        "prompt_cache_key", "route", "session_key", "stream",
        "tokens",
    )  # fmt: skip

    def __init__(
        self, endpoint: str, path: str, body: bytes, text: str, session_key: str | None,
        model: str | None, tokens: Sequence[int] | None = None, stream: bool = False,
        priority: int | None = None,
        namespace: str = "",
        render: Callable[[], str] | None = None,
    ) -> None:  # fmt: skip
        self.endpoint = endpoint  # metrics label: chat | completions | generate
        self.path = path  # upstream path, e.g. /v1/chat/completions
        self.body = body  # forwarded unchanged
        self.session_key = session_key
        self.model = model
        self.tokens = tokens  # the worker's prompt ids (router `tokenizer` set)
        self.stream = stream  # the client asked for a stream (a timeout is then the worker's)
        # Its class's engine priority, for a worker that schedules by the body's
        # `priority` (WorkerRecord.priority_scheduling: an attached vLLM); None: the body
        # has its own `priority`, or names no class.
        self.priority = priority
        self.namespace = namespace  # its cache namespace (router/holdings/namespace.py)
        # What the policy and the fleet queue read of it: built once, shared by the
        # queue's ticket and every try's decision (`Proxy._select`).
        # `text`, or `render` for a chat routed on its ids (RouteRequest says why).
        self.route = RouteRequest(text, session_key, tokens, model or "", namespace, render)
        # The tenant-namespaced digest of `prompt_cache_key` (router/holdings/sessions.py).
        self.cache_key: bytes | None = None
        self.pin_ttl = 0.0  # its `cache_pin_ttl` (the session rule's rule 3)
        self.prompt_cache_key: str | None = None  # as the client sent it (pins: cache_key)

    @property
    def text(self) -> str:
        """What the policy routes on (rendered at the first read where it was deferred)."""
        return self.route.text


class Seating(Protocol):
    """The request's seat in the fleet queue (router/queue/fleet_queue.py `Seat`): the
    workers its first try may not use (no free seat), and where its tries sit."""

    exclude: Collection[str]

    def sit(self, worker_id: str) -> None: ...


class ProxyMetrics(Protocol):
    """What the proxy reports (`router.metrics.Metrics` is one)."""

    retries: Counter  # attempts retried on another worker
    foreign_retries: Counter  # requests resent on a fresh connection after ForeignAnswer

    def decision(self, reason: str, now: float | None = None) -> None: ...

    def observe_cached(self, worker_id: str, predicted_tokens: float, actual: int) -> None: ...


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        routing: Routing,
        pool: Transport,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
        sync: ReplicaSync | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.routing = routing  # the holdings room and the policy (router/routing.py)
        # Keep-alive connections to workers; its timeouts come from the config: no total,
        # a stream may last as long as it keeps sending, but each wait for bytes (the head
        # of an answer, or the next chunk) is bounded by request_timeout, so a hung worker
        # is caught without cutting a healthy long stream.
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        # x-request-id is sent once, below
        self._forward = AllowedNames(
            (FORWARD_REQUEST | {config.session_header.lower()}) - {"x-request-id"}
        )
        self._worker_auth = worker_authorization(config)
        # The same for every request: built once (`_request_head`).
        self._fixed_head = [("Content-Type", "application/json")]
        if self._worker_auth is not None and encodable(self._worker_auth):
            self._fixed_head.append(("Authorization", self._worker_auth))
        self._client_auth = self._worker_auth is None and config.forward_authorization
        # Router replicas sharing decisions (router/holdings/sync.py); None on a lone router.
        self.sync = sync
        # prompt_cache_key -> worker (router/holdings/sessions.py), shared with the replicas.
        self.sessions = SessionTable(
            config.session_table_max, config.session_ttl, replicas=sync is not None
        )
        if sync is not None:
            sync.on_session = self.sessions.learn
        self._releases: set[asyncio.Task[None]] = set()  # pins released on moved sessions
        # Pin releases by outcome: released (2xx), refused (answered otherwise: a worker
        # without the route, 404, or an error), failed (no answer).
        self.pin_releases = {"sent": 0, "refused": 0, "failed": 0}

    def _select(self, routed: Routed, tried: list[str]) -> tuple[Worker, Decision] | None:
        now = self.clock()
        # The fleet keeps this view current as workers, breakers and loads change, so a
        # request costs no pass over the fleet in Python (a one-off copy only on retries).
        view = self.fleet.view(now, routed.model, exclude=tried)
        if not view.ids:
            return None
        request = routed.route
        if routed.cache_key is None:
            decision = self.routing.select(request, view, now)
        else:  # a prompt_cache_key session (router/holdings/sessions.py)
            config = self.config
            decision, placed, left = sessions.select(
                self.sessions, self.routing, request, view, now, routed.cache_key,
                config.balance_abs_threshold, config.balance_rel_threshold,
                pin_ttl=routed.pin_ttl,
            )  # fmt: skip
            if self.sync is not None and (placed or routed.pin_ttl > 0):
                # The other replicas learn where it is and how long its context is held.
                self.sync.publish_session(
                    decision.worker_id, routed.cache_key, routed.pin_ttl, placed
                )
            old = self.fleet.workers.get(left) if left is not None else None
            if old is not None and routed.prompt_cache_key is not None:
                self._release_pin(old.url, routed.prompt_cache_key, routed.cache_key)
        self.metrics.decision(decision.reason, now)
        return self.fleet.workers[decision.worker_id], decision

    def _release_pin(self, url: str, key: str, session: bytes) -> None:
        """The session moved off the worker at `url`: release its pin there (``POST
        /release_pin``, worker/engine/pins.py) in the background, named as it was pinned
        (PIN_KEY_HEADER: the tenant's `session`). Best effort: a pin the call does not
        reach runs out at its TTL."""

        async def release() -> None:
            head = [("Content-Type", "application/json"), (PIN_KEY_HEADER, session.hex())]
            if self._worker_auth is not None:
                head.append(("Authorization", self._worker_auth))
            body = json_codec.dumps({"prompt_cache_key": key})
            try:
                answer = await self.pool.post(url, "/release_pin", head, body, "release-pin")
                await answer.read_all()
                self.pool.release(url, answer)
                self.pin_releases["sent" if 200 <= answer.status < 300 else "refused"] += 1
            except (OSError, TimeoutError, UpstreamBroken):
                self.pin_releases["failed"] += 1

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def forward(
        self, request: web.Request, routed: Routed, seat: Seating | None = None
    ) -> web.StreamResponse:
        if routed.model and not self.fleet.knows_model(routed.model):
            raise APIError(
                404,
                f"model {routed.model[:MAX_NAME_CHARS]!r} is not served by this fleet",
                param="model",
                code="model_not_found",
            )
        fleet, config, pool = self.fleet, self.config, self.pool
        if routed.cache_key is None and (seat is None or not seat.exclude):
            # The common request, no session and a seat anywhere: `_select(routed, ())`
            # inlined, a call less.
            now = self.clock()
            view = fleet.view(now, routed.model, exclude=())
            if not view.ids:  # (not `len(view)`: a call less)
                raise _no_workers()
            decision = self.routing.select(routed.route, view, now)
            self.metrics.decision(decision.reason, now)
            worker = fleet.workers[decision.worker_id]
        else:
            picked = None
            if seat is not None and seat.exclude:
                # The first try goes where the queue has a seat for it.
                picked = self._select(routed, [*seat.exclude])
            if picked is None:
                picked = self._select(routed, ())
            if picked is None:
                raise _no_workers()
            worker, decision = picked
            now = self.clock()
        # Every try in one loop, the try and its exchange inlined (one coroutine per
        # request, not four: forward, attempt, retry, exchange). The retry books, made at
        # the first failure (no allocation for the common request): the workers whose try
        # failed, and the tries that got a 500, a timeout or an oversized answer: the
        # worker's fault, or the request's? (each carries its attempt, and the limit it
        # ran into: None for a 500)
        tried: list[str] | None = None
        suspects: list[AttemptFailed] | None = None
        busy_for = 0  # the longest Retry-After of the busy workers
        tries = 0  # the retries so far
        while True:
            if seat is not None:
                seat.sit(worker.worker_id)
            # One try on `worker`: one exchange, resent once on a fresh connection when
            # another answer's bytes broke it before anything reached the client (issue 31:
            # 0.4-8.8% of innocent requests got 502 on a one-worker fleet); the resend's
            # failure is the try's. Its attempt is released whatever the exit (a whole
            # buffered answer's success releases it with its books: `_succeeded`).
            # The decision's instant (a clock reading less on the common request): the
            # breaker's cooldown is read at the choice that the attempt carries out.
            attempt = fleet.attempt(worker, now)
            failure: AttemptFailed | None = None
            fresh = False
            while True:  # the exchange; a second pass is the resend (`fresh`)
                try:
                    body = routed.body
                    if routed.priority is not None and worker.report.priority_scheduling:
                        body = with_priority(body, routed.priority)
                    head = self._request_head(request)
                    if routed.cache_key is not None:  # the worker pins the session, not the text
                        head.append((PIN_KEY_HEADER, routed.cache_key.hex()))
                    # The `x-request-id` sent to the worker: the request's id
                    # (shared/serving/access_log.py), so one id names it in both services'
                    # logs. The transport checks its echo before a connection is reused.
                    wire_id = request.get(REQUEST_ID) or fresh_request_id()
                    try:
                        upstream = await pool.post(
                            worker.url, routed.path, head, body, wire_id, fresh
                        )
                    except (TimeoutError, UpstreamBroken) as e:
                        raise _unreached(e, worker, routed) from None
                    try:
                        if not answer_fine(upstream):  # the common case costs no coroutine
                            await classify(upstream, worker)
                        if upstream.content_type == EVENT_STREAM:
                            response = await self._relay_stream(
                                request, upstream, attempt, decision, routed
                            )
                        else:  # a buffered answer, relayed here
                            # Whole and within max_response_bytes already (the common
                            # answer): taken without `read_capped`'s and `read_all`'s
                            # coroutines; else as they rule.
                            size = upstream.content_length
                            answer = None
                            if size is not None and size <= config.max_response_bytes:
                                answer = upstream.whole()
                            if answer is None:
                                answer = await read_capped(upstream, config, worker)
                            # The books, and the try released with them (no await before
                            # the answer leaves: nothing can tell the two orders apart).
                            if upstream.status == 200:
                                cached = cached_tokens_from_json(answer)
                                self._succeeded(attempt, decision, routed, answer, cached, True)
                            else:
                                self._succeeded(attempt, decision, routed, b"", None, True)
                            headers = self._response_headers(upstream, worker, decision)
                            # (`responder_of` inlined)
                            response = request.get(RESPONDER, AIOHTTP).answer(
                                upstream.status, headers, answer
                            )
                    except BaseException:
                        # Anything but a complete relay (error, cancel) must drop the
                        # connection, so the worker sees the request abandoned instead of
                        # a pooled half-read socket.
                        upstream.close()
                        raise
                    pool.release(worker.url, upstream)
                except AttemptFailed as e:
                    if e.foreign and not fresh:
                        self.metrics.foreign_retries.inc()
                        fresh = True
                        continue
                    e.attempt = attempt
                    if not e.suspect:  # a suspect's verdict waits for the next worker's answer
                        fleet.failed(attempt, e.kind, self.clock())
                    failure = e
                except BaseException:
                    attempt.release()
                    raise
                if not attempt.released:
                    attempt.release()
                break
            if failure is None:
                if suspects and response.status < 400:
                    # Another worker answered what the suspect failed: the suspect's failure.
                    for suspect in suspects:
                        fleet.failed(suspect.attempt, suspect.kind, self.clock())  # type: ignore[arg-type]
                return response
            # The tries after a failure: each on a worker not yet tried, up to
            # `max_retries` more, with exponential backoff.
            if tried is None or suspects is None:
                tried, suspects = [], []
            tried.append(worker.worker_id)
            if failure.suspect:
                same = sum(1 for s in suspects if s.limit == failure.limit)
                if same:  # a second worker failed the same way: the request's fault
                    raise request_fault(same + 1, failure, config) from None
                suspects.append(failure)
            busy_for = max(busy_for, failure.retry_after)
            if tries >= config.max_retries:
                break
            self.metrics.retries.inc()
            await asyncio.sleep(config.retry_backoff * (2**tries))
            tries += 1
            picked = self._select(routed, tried)
            if picked is None:
                break
            worker, decision = picked
            now = self.clock()
        # Here after a failure only: `tried` is made.
        if failure.kind is FailureKind.BUSY:
            raise APIError(
                503, f"all {len(tried)} workers tried are busy; retry later",
                code="overloaded", headers={"Retry-After": str(busy_for)},
            )  # fmt: skip
        raise APIError(
            failure.status,
            f"all {len(tried)} attempts failed; last: {failure}",
            code="upstream_error",
        )

    def _request_head(self, request: web.Request) -> list[tuple[str, str]]:
        """The header lines sent to the worker (allow-listed; Host, the body's framing and
        the request id are the transport's)."""
        forward = self._forward
        incoming = request.headers
        lines = []
        for k, v in incoming.items():  # a loop, not a comprehension: one call less
            if forward[k] and encodable(v):
                lines.append((k, v))
        lines += self._fixed_head  # the body was parsed as JSON; the worker key, if any
        if self._client_auth:
            auth = incoming.get("Authorization")
            if auth is not None and encodable(auth):
                lines.append(("Authorization", auth))
        return lines

    def _response_headers(self, upstream: Answer, worker: Worker, d: Decision) -> CIMultiDict[str]:
        """`response_headers(upstream.headers, <the router's three>)` (router/upstream/answers.py:
        the worker's allow-listed headers in its order, then the router's), inlined: two
        calls less an answer (tests/router/upstream/test_proxy.py holds the two to one)."""
        kept = []
        names = RESPONSE_NAMES
        for k, v in upstream.headers.items():
            if names[k]:
                kept.append((k, v))
        kept += (
            ("x-radix-worker", worker.worker_id),
            ("x-radix-route-reason", d.reason),
            ("x-radix-matched-chars", str(d.matched_chars)),
        )
        return CIMultiDict(kept)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: Answer,
        attempt: Attempt,
        decision: Decision,
        routed: Routed,
    ) -> StreamReply:
        worker = attempt.worker
        # The first chunk is read before anything goes to the client, so a worker that
        # fails before its first event is retried elsewhere like any failure before the
        # first byte, and the headers leave together with that chunk.
        with UpstreamErrors(worker, "worker {} broke off", FailureKind.BROKEN):
            chunk = await upstream.readany()
        content = upstream
        headers = self._response_headers(upstream, worker, decision)
        resp = responder_of(request).stream(
            request, upstream.status, headers, self.config.stream_write_timeout
        )
        await resp.prepare(request)
        # The stream's last SSE_TAIL_BYTES or more, as the chunks written: joined once at
        # the end (a copy of the whole tail per chunk cost ~0.7 us a chunk past 16 KB).
        tail: deque[bytes] = deque()
        kept = 0
        held = b""  # the start of an event not yet whole: it leaves once it is
        broken: tuple[FailureKind, str] | None = None
        # Each chunk is written as soon as it is read (whole events: a partial one waits
        # for its end, so an error event never lands inside it); only the last one (the
        # upstream has already ended) waits to leave together with the end-of-stream marker.
        while chunk and not content.is_eof():
            if held:
                chunk = held + chunk
            cut = _event_end(chunk)
            held = chunk[cut:]
            out = chunk[:cut] if held else chunk
            if out:
                try:
                    await resp.write(out)
                except ConnectionError:
                    # The client left, or did not read within the deadline (the stream
                    # aborted it): drop the upstream too, so the worker sees the request
                    # abandoned and frees its slot and KV at once.
                    upstream.close()
                    return resp
                tail.append(out)
                kept += len(out)
                while kept - len(tail[0]) >= SSE_TAIL_BYTES:
                    kept -= len(tail.popleft())
            try:
                chunk = await content.readany()
            except TimeoutError:
                chunk = b""
                broken = FailureKind.TIMEOUT, f"worker {worker.worker_id} timed out mid-stream"
            except UpstreamBroken as e:
                chunk = b""
                broken = FailureKind.BROKEN, f"worker {worker.worker_id} broke off mid-stream: {e}"
        last = held + chunk
        cut = _event_end(last)
        if broken is None and cut < len(last):
            # The stream ended (its connection closed) mid-event: cut short, not done.
            broken = FailureKind.BROKEN, f"worker {worker.worker_id} ended the stream mid-event"
        if broken is None:
            answer = b"".join(tail)[-SSE_TAIL_BYTES:] + last
            self._succeeded(attempt, decision, routed, answer, cached_tokens_from_sse(answer))
        else:
            self.fleet.failed(attempt, broken[0], self.clock())
            event = json_codec.dumps(error_body(502, broken[1], code="upstream_error"))
            last = last[:cut] + b"data: %s\n\n" % event  # the partial event dropped
        with contextlib.suppress(ConnectionError):  # the client left, or stalled, at the end
            await resp.write_eof(last)
        return resp

    def _succeeded(
        self, attempt: Attempt, decision: Decision, routed: Routed, answer: bytes,
        cached: int | None, release: bool = False,
    ) -> None:  # fmt: skip
        """Tell the table the try succeeded (`release`: and that it ended, in the same
        call: a whole buffered answer)."""
        predicted = decision.predicted_tokens
        worker = attempt.worker
        chars, prompt_tokens = 0, None
        if predicted is None:  # no prompt ids: the worker's chars per token, as learned so far
            # (`chars_per_token(worker, default)`, written here: a call less an answer)
            predicted = decision.matched_chars / (
                worker.chars_per_token or self.config.tree_chars_per_token
            )
            if routed.tokens is None:  # its answer teaches the ratio (calibration.py)
                chars, prompt_tokens = len(routed.route.text), prompt_tokens_from(answer)
        self.fleet.succeeded(
            attempt, predicted, cached, chars, prompt_tokens, self.clock(), release
        )
        if cached is not None:
            self.metrics.observe_cached(attempt.worker.worker_id, predicted, cached)


def _unreached(e: TimeoutError | UpstreamBroken, worker: Worker, routed: Routed) -> AttemptFailed:
    """The try's failure when the worker's answer head never came (`e`: the pool's)."""
    failed = attempt_failed(e, worker, "cannot reach worker {}", FailureKind.CONNECT)
    if failed.kind is FailureKind.TIMEOUT and not routed.stream:
        # No head within request_timeout: a hung worker, or a request that takes
        # longer than the limit anywhere. The next worker's answer decides.
        failed.suspect, failed.limit = True, "request_timeout"
    return failed


def _no_workers() -> APIError:
    return APIError(
        503, "no healthy worker is available", code="no_workers", headers={"Retry-After": "1"}
    )


PROXY = web.AppKey("proxy", Proxy)  # set up in the app's cleanup_ctx (needs the loop)


def echo_of(app: web.Application, url: str) -> dict[str, object] | None:
    """Whether the worker at `url` echoes `x-request-id`, and what not echoing costs
    (router/upstream/echo.py); None before any request went to it."""
    proxy = app.get(PROXY)
    status = proxy.pool.echo.get(url) if proxy is not None else None
    return None if status is None else status.describe()
