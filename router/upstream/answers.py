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

    connect error, broken framing, 502/503/504, 3xx, other 5xx,    → worker health:
    bad type, a timeout on a stream                                  retry elsewhere,
                                                                     counts toward the
                                                                     worker's breaker
    503 with Retry-After, or an "overloaded" error; 429            → busy, not broken:
        retry elsewhere, no breaker; all busy → 503 + Retry-After to the client
    500; on a non-streamed request a timeout (request_timeout) or → suspect: retry once
    an answer over max_response_bytes                                elsewhere
        A second such failure for the same request is the request's fault: stop, answer
        500 / 504 `request_timeout` / 502 `response_too_large` naming the limit, charge
        no breaker (`request_timeout: 2` and three long generations used to open every
        breaker). A success elsewhere makes the suspect the worker's failure.
    the router's own max_buffered_answer_bytes full                → 503 overloaded,
        no retry, no breaker
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict, CIMultiDictProxy

from router.fleet.workers import FailureKind, Worker
from router.upstream.limits import ForeignAnswer, UpstreamBroken
from shared.config import RouterConfig
from shared.serving import json_codec
from shared.serving.errors import APIError

if TYPE_CHECKING:
    from router.upstream.transport import Answer

FORWARD_REQUEST = frozenset({"accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
FORWARD_RESPONSE = frozenset({"content-type", "cache-control", "retry-after", "x-request-id"})
ANSWER_TYPES = frozenset({"application/json", "text/event-stream"})
MAX_ERROR_BYTES = 65536  # what is read of a busy worker's error body
MAX_RETRY_AFTER_S = 60


MAX_NAMES = 256  # header names an `AllowedNames` remembers
MAX_NAME_CHARS = 64  # a longer name is looked up each time, never kept


class AllowedNames(dict[str, bool]):
    """Header name as sent -> whether an allow-list holds it (case-insensitive): the
    name's `lower()` and set lookup once, not per header per request. Names come from
    clients and workers, so at most `MAX_NAMES` of at most `MAX_NAME_CHARS` are kept;
    any other is looked up each time."""

    def __init__(self, allowed: frozenset[str]) -> None:
        super().__init__()
        self.allowed = allowed

    def __missing__(self, name: str) -> bool:
        keep = name.lower() in self.allowed
        if len(self) < MAX_NAMES and len(name) <= MAX_NAME_CHARS:
            self[name] = keep
        return keep


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


def response_headers(
    headers: CIMultiDict[str] | CIMultiDictProxy[str], *extra: tuple[str, str]
) -> CIMultiDict[str]:
    """The worker's headers a client may see (`FORWARD_RESPONSE`, in the worker's order),
    then `extra` (the router's own): one multidict built in one call."""
    kept = [(k, v) for k, v in headers.items() if k.lower() in FORWARD_RESPONSE]
    kept += extra
    return CIMultiDict(kept)


RESPONSE_NAMES = AllowedNames(FORWARD_RESPONSE)  # `response_headers`' rule, name by name


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
        limit: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status
        self.retry_after = retry_after  # busy: how long the worker asked to wait
        # A 500, a timeout or an oversized answer (non-streamed): the worker's fault or the
        # request's, not known until another worker answers the same request.
        self.suspect = suspect
        self.limit = limit  # the config key a suspect ran into, if any
        # The proxy's `Attempt` (router/fleet/table.py): whose verdict may wait.
        self.attempt: Any = None
        # Broken by another answer's bytes before this one's was read (ForeignAnswer):
        # the proxy resends once on a fresh connection to the same worker.
        self.foreign = False


def request_fault(workers: int, failure: AttemptFailed, config: RouterConfig) -> APIError:
    """The same request failed the same way on two workers (a 500, request_timeout, or
    max_response_bytes): the request, not the fleet, is at fault, so it is answered now
    and counted against no breaker (three such requests used to open every breaker and
    take the fleet to 503)."""
    if failure.limit == "request_timeout":
        return APIError(
            504, f"the request took longer than request_timeout ({config.request_timeout:g} s) "
            f"on {workers} workers; not retried", code="request_timeout",
        )  # fmt: skip
    if failure.limit == "max_response_bytes":
        return APIError(
            502, f"the answer is larger than max_response_bytes ({config.max_response_bytes}) "
            f"on {workers} workers; not retried", code="response_too_large",
        )  # fmt: skip
    return APIError(
        500, f"the request failed on {workers} workers (each answered 500); not retried",
        code="request_failed",
    )  # fmt: skip


def over_budget(config: RouterConfig) -> APIError:
    """The router holds `max_buffered_answer_bytes` of answers already: its own limit,
    neither the worker's fault nor the request's (no breaker, no retry)."""
    return APIError(
        503, "the router is holding max_buffered_answer_bytes "
        f"({config.max_buffered_answer_bytes}) of answers; retry later",
        code="overloaded", headers={"Retry-After": "1"},
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
        if isinstance(e, (TimeoutError, UpstreamBroken)):
            raise attempt_failed(e, self.worker, self.what, self.kind) from None


def attempt_failed(
    e: TimeoutError | UpstreamBroken, worker: Worker, what: str, kind: FailureKind
) -> AttemptFailed:
    """What a timeout or a broken connection while talking to `worker` is (`what`: the
    message, `{}` the worker's id; `kind`: a broken one's FailureKind)."""
    wid = worker.worker_id
    if isinstance(e, TimeoutError):
        return AttemptFailed(f"worker {wid} timed out", FailureKind.TIMEOUT, 504)
    failed = AttemptFailed(f"{what.format(wid)}: {type(e).__name__}", kind)
    failed.foreign = isinstance(e, ForeignAnswer)
    return failed


def _retry_after(value: str | None) -> int:
    """Seconds from a Retry-After header (delta-seconds only); 0 when absent or odd."""
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return 0
    return min(MAX_RETRY_AFTER_S, math.ceil(seconds)) if math.isfinite(seconds) else 0


async def _says_overloaded(upstream: Answer) -> bool:
    try:
        body = await upstream.read_all()
        error = json_codec.loads(body[:MAX_ERROR_BYTES]).get("error", {})
    except (ValueError, AttributeError, UpstreamBroken, TimeoutError):
        return False
    return isinstance(error, dict) and "overloaded" in (
        str(error.get("code")),
        str(error.get("type")),
    )


def answer_fine(upstream: Answer) -> bool:
    """A 2xx of an answer type with no content coding: `classify` has nothing to say (the
    proxy's common case, without a coroutine)."""
    return (
        200 <= upstream.status < 300
        and upstream.content_type in ANSWER_TYPES
        and "Content-Encoding" not in upstream.headers  # type: ignore[operator]
    )


async def classify(upstream: Answer, worker: Worker) -> None:
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


async def read_capped(upstream: Answer, config: RouterConfig, worker: Worker) -> bytes:
    """The whole body of a buffered answer, at most `max_response_bytes` (a suspect
    AttemptFailed beyond; the transport stops reading there), within `request_timeout`
    of the send (a suspect timeout). A body that ended with the connection must be
    whole JSON: a close cut it short otherwise (a 200 with half an answer)."""
    limit = config.max_response_bytes
    size = upstream.content_length
    if size is not None and size > limit:
        raise _too_big(worker, limit)
    try:  # (`UpstreamErrors`' mapping, by one except: no context manager per answer)
        body = await upstream.read_all()
    except (TimeoutError, UpstreamBroken) as error:
        if upstream.over_budget:
            raise over_budget(config) from None
        if upstream.too_big:
            raise _too_big(worker, limit) from None
        failed = attempt_failed(error, worker, "worker {} broke off", FailureKind.BROKEN)
        if failed.kind is FailureKind.TIMEOUT:
            failed.suspect, failed.limit = True, "request_timeout"
        raise failed from None
    if len(body) > limit:
        raise _too_big(worker, limit)
    # (`size is None` first: a length rules out a close-delimited body, without a call)
    if size is None and upstream.close_delimited and upstream.content_type == "application/json":
        try:
            json_codec.loads(body)
        except ValueError:
            raise AttemptFailed(
                f"worker {worker.worker_id} closed the connection mid-answer (not whole JSON)",
                FailureKind.BROKEN,
            ) from None
    return body


def _too_big(worker: Worker, limit: int) -> AttemptFailed:
    return AttemptFailed(
        f"worker {worker.worker_id} answer exceeds max_response_bytes ({limit})",
        FailureKind.BAD_ANSWER, suspect=True, limit="max_response_bytes",
    )  # fmt: skip


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
