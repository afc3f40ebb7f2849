"""Locust users that speak the OpenAI API to any compatible server (router or worker).

    python -m locust -f loadtests/load/locustfile.py --headless -u 32 -r 32 -t 60s \\
        --host http://127.0.0.1:8000 --workload shared_prefix --groups 8 --prompts-per-group 8 \\
        --records-file out/records.jsonl

Run it from the repository root with `python -m locust` (which puts the root on
`sys.path`, so `loadtests` imports), and `--headless` unless you want locust's web UI.

Each request streams over locust's HTTP client, with the SSE parsed as bytes arrive.
Locust's own tables hold only the real HTTP requests (one `POST` row per endpoint; its
times are milliseconds of whole requests, its counts requests). The LLM metrics are
not locust requests: they are printed when the test stops, in tables of their own
with a unit on every figure (loadtests/load/summary.py: TTFT, TPOT, ITL and E2E latency
in ms, throughput in req/s and tok/s, the cache hit rate), and written per request to
`--records-file` for the report. The hit rate is `usage.prompt_tokens_details.cached_tokens
/ prompt_tokens`, overall and per worker (the router names the worker in the
`x-radix-worker` header).

Arrivals: closed loop by default (each user sends its next request when the last one
ends); with `--request-rate R` open loop, a Poisson process of R requests per second
shared by all users (`-u` caps how many are in flight, vLLM's max_concurrency); a
Mooncake trace replays its own timestamps. The run stops by itself once the workload
has no more requests (or after `--max-requests`); with `-t/--run-time` the workload
starts over instead, until the time is up.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, TextIO

import gevent
import requests
from locust import HttpUser, constant, events, task
from locust.env import Environment
from locust.exception import StopUser

try:
    from loadtests.kit import add_workload_arguments, options_from_namespace
    from loadtests.load.records import (
        HitCounter,
        RequestRecord,
        error_text,
        read_stream,
        read_whole,
    )
    from loadtests.load.summary import summarize
    from loadtests.load.workloads import LLMRequest, Session, Workload
except ModuleNotFoundError as e:  # `locust -f` outside the repository root
    raise SystemExit(
        "loadtests is not importable: run this from the repository root as "
        "`python -m locust -f loadtests/load/locustfile.py ...`"
    ) from e

WORKER_HEADER = "x-radix-worker"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
log = logging.getLogger("loadtests")


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    add_workload_arguments(parser, env=True)
    parser.add_argument("--model", default="", env_var="LOCUST_MODEL", help="model name to send")
    parser.add_argument("--api-key", default="", env_var="LOCUST_API_KEY", help="bearer token")
    parser.add_argument("--no-stream", action="store_true", env_var="LOCUST_NO_STREAM")
    parser.add_argument(
        "--max-requests", type=int, default=0, env_var="LOCUST_MAX_REQUESTS",
        help="stop after this many requests (per locust process; 0: when the workload ends)",
    )  # fmt: skip
    parser.add_argument("--records-file", default="", env_var="LOCUST_RECORDS_FILE")
    parser.add_argument(
        "--request-rate", type=float, default=0.0, env_var="LOCUST_REQUEST_RATE",
        help="open loop: Poisson arrivals at this many requests/s (default: 0, closed loop)",
    )  # fmt: skip


@dataclass(frozen=True)
class UserOptions:
    model: str
    api_key: str
    stream: bool
    max_requests: int
    records_file: str
    request_rate: float = 0.0  # req/s, Poisson; 0: closed loop


class PoissonArrivals:
    """Open-loop send times: exponential gaps at `rate` per second, seeded (same run,
    same times), as offsets from the start of the test."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(f"{seed}:arrivals")
        self.t = 0.0

    def next(self) -> float:
        self.t += self.rng.expovariate(self.rate)
        return self.t


class RunState:
    """What the users of one locust process share during a test."""

    def __init__(self, workload: Workload, options: UserOptions) -> None:
        self.workload = workload
        self.options = options
        self.hits = HitCounter()
        self.done: list[RequestRecord] = []  # this process's records, for its tables
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        rate = options.request_rate
        self.arrivals = PoissonArrivals(rate, workload.options.seed) if rate > 0 else None
        self.sent = 0
        self.active_users = 0
        # Open for the whole test (closed at test_stop): one line per finished request.
        self.records: TextIO | None = None
        if options.records_file:
            self.records = open(options.records_file, "a")  # noqa: SIM115

    def take(self, session: Session) -> tuple[LLMRequest, float | None] | None:
        """The next request and when it is due (seconds from the start; None: now)."""
        if self.options.max_requests and self.sent >= self.options.max_requests:
            return None
        req = session.next_request()
        if req is None:
            return None
        self.sent += 1
        due = self.arrivals.next() if self.arrivals is not None else req.arrival_s
        return req, due

    def finish(self, record: RequestRecord) -> None:
        self.done.append(record)
        if record.ok:
            self.hits.add(record.worker, record.prompt_tokens, record.cached_tokens)
        if self.records is not None:
            self.records.write(record.to_json() + "\n")
            self.records.flush()

    def close(self) -> None:
        if self.records is not None:
            self.records.close()
            self.records = None


def run_state(environment: Environment) -> RunState:
    state = getattr(environment, "radix_run", None)
    if state is None:  # a user started without test_start (e.g. locust's library API)
        state = _start(environment)
    return state


def _start(environment: Environment) -> RunState:
    o = environment.parsed_options
    options = UserOptions(
        model=o.model, api_key=o.api_key, stream=not o.no_stream,
        max_requests=o.max_requests, records_file=o.records_file, request_rate=o.request_rate,
    )  # fmt: skip
    workload = options_from_namespace(o)
    # A run bounded by time repeats the workload: one that ran out first would end the
    # run early with fewer requests than the time asked for (locust's -t is a string).
    if getattr(o, "run_time", None) and not workload.loop:
        workload = dataclasses.replace(workload, loop=True)
    state = RunState(Workload(workload), options)
    environment.radix_run = state  # type: ignore[attr-defined]
    return state


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    _start(environment)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_: Any) -> None:
    state = getattr(environment, "radix_run", None)
    if state is not None:
        if state.done:  # with --processes each process has its share; the master none
            s = summarize(state.done)
            log.info("LLM serving metrics (locust's tables below: HTTP requests, times in ms):"
                     "\n%s\n\n%s", s.table(), s.worker_table())  # fmt: skip
        log.info("cache hit rate (cached_tokens / prompt_tokens):\n%s", state.hits.table())
        state.close()


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    # --processes: each worker process sends its counts since the last report; the master sums.
    def report(client_id: str, data: dict[str, Any], **__: Any) -> None:
        state = getattr(environment, "radix_run", None)
        if state is not None:
            data["radix_hits"] = state.hits.as_dict()
            state.hits = HitCounter()

    def receive(client_id: str, data: dict[str, Any], **__: Any) -> None:
        if "radix_hits" in data:
            run_state(environment).hits.merge(data["radix_hits"])

    environment.events.report_to_master.add_listener(report)
    environment.events.worker_report.add_listener(receive)


class OpenAIUser(HttpUser):
    """One simulated client: takes requests from its workload session and streams them."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.state = run_state(self.environment)
        self.session = self.state.workload.new_session()
        self.state.active_users += 1

    def on_stop(self) -> None:
        self.state.active_users -= 1

    def _done(self) -> None:
        # The last user out ends the run: every request has finished by then.
        if self.state.active_users <= 1 and self.environment.runner is not None:
            gevent.spawn_later(0, self.environment.runner.quit)
        raise StopUser()

    @task
    def send(self) -> None:
        taken = self.state.take(self.session)
        if taken is None:
            self._done()
            return
        req, due = taken
        if due is not None:
            gevent.sleep(max(0.0, self.state.t0 + due - time.monotonic()))
        record, reply = self._request(req)
        if due is not None:
            record = dataclasses.replace(record, due=self.state.wall0 + due)
        self.state.finish(record)
        if record.ok:
            self.session.on_reply(req, reply)

    def _request(self, req: LLMRequest) -> tuple[RequestRecord, str]:
        o = self.state.options
        body = req.body(o.model, o.stream)
        if not o.model:
            body.pop("model")
        headers = {"x-session-id": req.session_id} if req.session_id else {}
        if o.api_key:
            headers["authorization"] = f"Bearer {o.api_key}"
        name = PATHS[req.endpoint]
        wall, start = time.time(), time.perf_counter()
        with self.client.post(
            name, json=body, headers=headers, stream=o.stream, catch_response=True, name=name
        ) as resp:
            worker = resp.headers.get(WORKER_HEADER, "direct") if resp.headers else "direct"
            fail = lambda msg: self._fail(resp, wall, start, worker, req, msg)  # noqa: E731
            if resp.status_code != 200:
                return fail(f"HTTP {resp.status_code}: {error_text(resp)}"), ""
            try:
                result = read_stream(resp, start) if o.stream else read_whole(resp, start)
            except (requests.RequestException, ValueError, KeyError, TypeError) as e:
                return fail(f"{type(e).__name__}: {e}"), ""
            if result.error:
                return fail(result.error), ""
            resp.success()
        record = RequestRecord(
            start=wall, ok=True, e2e_s=result.end - start,
            ttft_s=None if result.first is None else result.first - start,
            itl_s=result.itl, itls_s=result.itls, prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens, output_tokens=result.output_tokens,
            worker=worker, tag=req.tag,
        )  # fmt: skip
        return record, result.text

    def _fail(
        self, resp: Any, wall: float, start: float, worker: str, req: LLMRequest, msg: str
    ) -> RequestRecord:
        resp.failure(msg)
        e2e = time.perf_counter() - start
        return RequestRecord(
            start=wall, ok=False, e2e_s=e2e, worker=worker, tag=req.tag, error=msg[:300]
        )
