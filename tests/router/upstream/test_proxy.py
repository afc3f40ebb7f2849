"""The proxy over loopback: relay, retries, breaker, timeouts, streams, the load guard."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.http.state import FLEET, METRICS
from router.upstream.proxy import PROXY, SSE_TAIL_BYTES
from shared.redis_server import free_port
from tests.router.conftest import StartRouter, StartWorkers, url_of
from tests.router.raw_upstream import RawUpstream, request_id
from tests.waiting import ManualClock, wait_until

BODY = {"prompt": "hello there", "max_tokens": 3}


class OtherReplicas:
    """Stands in for `DecisionSync` (router/holdings/sync.py, tested over real Redis in
    test_sync.py): here only the load other replicas report matters, set by the test."""

    def __init__(self) -> None:
        self.remote: dict[str, int] = {}
        self.published: list[tuple[str, str]] = []
        self.started = self.stopped = False

    def publish(self, worker_id: str, text: str) -> None:
        self.published.append((worker_id, text))

    def remote_inflight(self) -> dict[str, int]:
        return self.remote

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


def in_flight(client: TestClient) -> dict[str, int]:
    return {w.worker_id: w.in_flight for w in client.server.app[FLEET].workers.values()}


async def test_non_stream_relay_headers_and_cached_metric(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)])
    r = await client.post(
        "/v1/completions",
        json=BODY,
        headers={"Authorization": "Bearer secret", "X-Request-Id": "t1"},
    )
    assert r.status == 200
    data = await r.json()
    assert data["worker"] == "w0" and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert r.headers["x-radix-worker"] == f"127.0.0.1:{server.port}"
    # An empty tree: nothing matched. The same text again matches all of it.
    assert (r.headers["x-radix-route-reason"], r.headers["x-radix-matched-chars"]) == (
        "no_match",
        "0",
    )
    assert "X-Upstream" not in r.headers  # not on the response allow-list
    assert "Keep-Alive" not in r.headers  # hop-by-hop stripped on the way back
    sent = w.headers_seen[-1]
    sent = {k.lower(): v for k, v in sent.items()}
    assert "authorization" not in sent and sent.get("x-request-id") == "t1"
    worker = next(iter(client.server.app[FLEET].workers.values()))
    assert worker.actual_cached_tokens_total == 7
    assert in_flight(client) == {worker.worker_id: 0}
    again = await client.post("/v1/completions", json=BODY)
    assert again.headers["x-radix-matched-chars"] == str(len(BODY["prompt"]))


async def test_authorization_forwarded_only_when_configured(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], forward_authorization=True)
    r = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer up"})
    assert r.status == 200 and w.headers_seen[-1]["Authorization"] == "Bearer up"


async def test_stream_relayed_unchanged_with_final_usage(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_w, server)] = await fake_workers("ok", cached_tokens=11)
    client = await start_router([url_of(server)])
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    text = (await r.read()).decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:5]] == [f"t{i} " for i in range(5)]
    assert events[-1] == "[DONE]"
    worker = next(iter(client.server.app[FLEET].workers.values()))
    assert worker.actual_cached_tokens_total == 11
    metrics = client.server.app[METRICS].render().decode()
    assert "radix_router_actual_cached_tokens_total" in metrics


async def test_a_long_streams_final_usage_is_read_from_its_tail(
    start_router: StartRouter, raw_upstreams: Any
) -> None:
    """The proxy keeps only the stream's last SSE_TAIL_BYTES or so (whole chunks) for the
    usage event: a stream of ~100 KB whose usage event arrives before its last read
    (`[DONE]` after a pause) still reports its cached tokens."""

    class LongStream(RawUpstream):
        async def answer(self, conn: int, n: int, head: bytes, body: bytes,
                         writer: asyncio.StreamWriter) -> bool:  # fmt: skip
            def chunk(data: bytes) -> None:
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))

            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nx-request-id: %s\r\n\r\n"
                         % request_id(head))  # fmt: skip
            for i in range(2000):
                chunk(b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i)
                if i % 20 == 0:  # in many reads, so the tail is many chunks
                    await writer.drain()
                    await asyncio.sleep(0.001)
            usage = {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 13}}}
            chunk(b"data: %s\n\n" % json.dumps(usage).encode())
            await writer.drain()
            await asyncio.sleep(0.2)  # the usage event is read before the last chunk
            chunk(b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            return False

    worker = await raw_upstreams(LongStream())
    client = await start_router([worker.url])
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    text = (await r.read()).decode()
    assert r.status == 200 and len(text) > 4 * SSE_TAIL_BYTES and text.endswith("[DONE]\n\n")
    fleet_worker = next(iter(client.server.app[FLEET].workers.values()))
    assert fleet_worker.actual_cached_tokens_total == 13


async def test_retry_on_503_and_refused_connection_loses_nothing(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(bad, s_bad), (good, s_good)] = await fake_workers("fail503", "ok")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = await start_router(
        [url_of(s_bad), dead, url_of(s_good)], policy="round_robin", max_retries=2, retry_backoff=0.0,
        breaker_failures=100,
    )  # fmt: skip
    results = await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(30)))
    statuses = [r.status for r in results]
    assert statuses == [200] * 30
    assert good.completed == 30 and bad.seen > 0
    assert all(v == 0 for v in in_flight(client).values())


async def test_breaker_opens_on_hung_worker_and_others_unaffected(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(hung, s_hung), (_good, s_good)] = await fake_workers("hang", "ok")
    client = await start_router(
        [url_of(s_hung), url_of(s_good)], policy="round_robin", request_timeout=0.3,
        breaker_failures=2, breaker_cooldown=60, retry_backoff=0.0,
    )  # fmt: skip
    for _ in range(6):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 200
    assert hung.seen == 2  # then the breaker kept it out of routing
    workers = (await (await client.get("/workers")).json())["data"]
    states = {w["url"]: w["breaker"] for w in workers}
    assert states[url_of(s_hung)] == "open" and states[url_of(s_good)] == "closed"
    assert all(v == 0 for v in in_flight(client).values())


async def test_all_attempts_fail_gives_an_openai_error(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, s1), (_, s2)] = await fake_workers("fail503", "fail503")
    client = await start_router([url_of(s1), url_of(s2)], max_retries=5, retry_backoff=0.0)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 502
    err = (await r.json())["error"]
    assert "2 attempts failed" in err["message"] and err["type"] == "server_error"


async def test_worker_4xx_passes_through_without_retry(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server), (other, s2)] = await fake_workers("bad_request", "ok")
    client = await start_router([url_of(server), url_of(s2)], policy="round_robin")
    statuses = [(await client.post("/v1/completions", json=BODY)).status for _ in range(2)]
    assert sorted(statuses) == [200, 400] and w.seen == 1 and other.seen == 1


async def test_stream_broken_midway_ends_with_error_event(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("break_midstream")
    client = await start_router([url_of(server)])
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status == 200
    text = (await asyncio.wait_for(r.read(), 10)).decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "t0 "
    assert "error" in json.loads(events[-1])
    assert all(v == 0 for v in in_flight(client).values())


async def test_client_disconnect_cancels_upstream_and_releases_guard(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("hang")
    client = await start_router([url_of(server)])
    task = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await wait_until(lambda: sum(in_flight(client).values()) == 1 and w.seen == 1)
    task.cancel()  # the client goes away
    await wait_until(lambda: w.cancelled == 1 and sum(in_flight(client).values()) == 0)
    assert w.cancelled == 1 and in_flight(client) == {f"127.0.0.1:{server.port}": 0}


async def test_stream_client_disconnect_releases_guard(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("slow_stream", stream_chunks=50)
    client = await start_router([url_of(server)])
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    await r.content.readline()  # the first event arrived
    assert sum(in_flight(client).values()) == 1
    r.close()
    await wait_until(lambda: sum(in_flight(client).values()) == 0)
    assert w.completed == 0


async def test_no_workers_is_503_and_health_follows(start_router: StartRouter) -> None:
    client = await start_router()
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status == 503 and (await r.json())["error"]["code"] == "no_workers"
    assert (await client.get("/health")).status == 503


async def test_breaker_half_opens_and_closes_when_the_worker_recovers(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("fail503")
    clock = ManualClock()
    client = await start_router(
        [url_of(server)], clock=clock, breaker_failures=2, breaker_cooldown=0.2, max_retries=0
    )
    assert [(await client.post("/v1/completions", json=BODY)).status for _ in range(2)] == [
        502,
        502,
    ]
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 503 and w.seen == 2  # open: not even tried
    w.mode = "ok"
    clock.advance(0.19)
    assert (await client.post("/v1/completions", json=BODY)).status == 503  # still open
    clock.advance(0.01)  # cooldown over: one probe goes through and closes it
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert [w_.breaker.state(0) for w_ in client.server.app[FLEET].workers.values()] == ["closed"]


def test_only_allow_listed_response_headers_pass() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    from router.upstream.answers import response_headers

    incoming = CIMultiDict(
        [("Connection", "keep-alive, X-Private"), ("X-Private", "1"), ("Keep-Alive", "timeout=5"),
         ("Transfer-Encoding", "chunked"), ("Content-Length", "5"), ("Set-Cookie", "s=1"),
         ("Access-Control-Allow-Origin", "*"), ("Refresh", "0; url=x"), ("WWW-Authenticate", "Basic"),
         ("Strict-Transport-Security", "max-age=1"), ("Content-Type", "application/json"),
         ("Retry-After", "2"), ("Cache-Control", "no-cache")]
    )  # fmt: skip
    out = response_headers(CIMultiDictProxy(incoming))
    assert list(out.items()) == [
        ("Content-Type", "application/json"),
        ("Retry-After", "2"),
        ("Cache-Control", "no-cache"),
    ]
    # The proxy's own copy of the rule (inlined there, a call less an answer) keeps the
    # same headers in the same order, then the router's three.
    from types import SimpleNamespace

    from router.upstream.proxy import Proxy

    mine = (("x-radix-worker", "w1"), ("x-radix-route-reason", "cache_hit"), ("x-radix-matched-chars", "7"))  # fmt: skip
    proxied = Proxy._response_headers(
        None,  # type: ignore[arg-type]
        SimpleNamespace(headers=CIMultiDictProxy(incoming)),  # type: ignore[arg-type]
        SimpleNamespace(worker_id="w1"),  # type: ignore[arg-type]
        SimpleNamespace(reason="cache_hit", matched_chars=7),  # type: ignore[arg-type]
    )
    assert list(proxied.items()) == list(response_headers(incoming, *mine).items())


def test_allowed_names_decide_as_the_rule_and_stay_bounded() -> None:
    """`AllowedNames` (the allow-lists' name cache) says what `lower() in allowed` says,
    in any case, for any name; adversarial: a peer that sends ever new names, or long
    ones, cannot grow it past `MAX_NAMES`, nor keep a name over `MAX_NAME_CHARS`."""
    from router.upstream.answers import (
        FORWARD_RESPONSE,
        MAX_NAME_CHARS,
        MAX_NAMES,
        AllowedNames,
    )

    names = AllowedNames(FORWARD_RESPONSE)
    for name in ("Content-Type", "CONTENT-TYPE", "content-type", "Set-Cookie", "X-Request-Id"):
        for _ in range(2):  # looked up, then remembered: the same answer
            assert names[name] is (name.lower() in FORWARD_RESPONSE), name
    for i in range(3 * MAX_NAMES):
        assert names[f"X-Flood-{i}"] is False
        assert len(names) <= MAX_NAMES
    long = "Retry-After" + "x" * MAX_NAME_CHARS
    fresh = AllowedNames(FORWARD_RESPONSE)
    assert fresh[long] is False and fresh["retry-AFTER"] is True and long not in fresh
    assert len(fresh) == 1


async def test_half_open_breaker_lets_exactly_one_probe_through(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("fail503", stream_chunks=3, chunk_delay=0.2)
    clock = ManualClock()
    client = await start_router(
        [url_of(server)], clock=clock, breaker_failures=1, breaker_cooldown=0.2, max_retries=0
    )
    assert (await client.post("/v1/completions", json=BODY)).status == 502  # opens
    w.mode = "ok"
    clock.advance(0.2)  # cooldown over: the fleet's view takes it back by time alone
    probe = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert probe.status == 200 and w.seen == 2
    # While the probe streams, the worker takes no other request.
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 503 and w.seen == 2
    await asyncio.wait_for(probe.read(), 10)  # the probe succeeds: closed again
    assert (await client.post("/v1/completions", json=BODY)).status == 200 and w.seen == 3


async def test_a_worker_naming_no_model_sensibly_names_none(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    """Static workers are asked their model; an answer of the wrong shape names none
    (it made the router's own /v1/models answer 500), and the worker still serves."""
    workers = await fake_workers("ok", "ok", "ok")
    answers = [{"data": 5}, {"data": [{"id": "x" * 300}, {"id": "bad\nname"}]}, [1, 2]]
    for (w, _), answer in zip(workers, answers, strict=True):
        w.models_answer = answer
    client = await start_router([url_of(s) for _, s in workers], policy="round_robin")
    r = await client.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"] == []
    assert (await client.post("/v1/completions", json=BODY)).status == 200


async def test_requests_naming_a_model_reach_only_its_workers(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w0, s0), (w1, s1)] = await fake_workers("ok", "ok")
    client = await start_router([url_of(s0), url_of(s1)], policy="round_robin")
    models = await (await client.get("/v1/models")).json()  # asks each static worker once
    assert sorted(m["id"] for m in models["data"]) == ["model-w0", "model-w1"]
    for _ in range(4):
        r = await client.post("/v1/completions", json={**BODY, "model": "model-w1"})
        assert r.status == 200 and (await r.json())["worker"] == "w1"
    assert w0.seen == 0 and w1.seen == 4
    r = await client.post("/v1/completions", json={**BODY, "model": "nobody"})
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    # A name is at most 256 characters: the 404 quotes no more of a longer one.
    r = await client.post("/v1/completions", json={**BODY, "model": "n" * 100_000})
    error = (await r.json())["error"]
    assert r.status == 404 and error["code"] == "model_not_found" and len(error["message"]) < 512
    unnamed = [await client.post("/v1/completions", json=BODY) for _ in range(2)]
    assert sorted([(await r.json())["worker"] for r in unnamed]) == ["w0", "w1"]


async def test_admin_changes_and_replica_load_reach_routing_at_once(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w0, s0), (w1, s1)] = await fake_workers("ok", "ok")
    replicas = OtherReplicas()
    client = await start_router([url_of(s0)], replicas, policy="least_load", admin_key="adm")
    admin = {"Authorization": "Bearer adm"}
    r = await client.post("/workers", json={"url": url_of(s1), "worker_id": "b"}, headers=admin)
    assert r.status == 201
    # Another replica has 5 requests in flight to the static worker: least load is "b".
    replicas.remote = {f"127.0.0.1:{s0.port}": 5}
    for _ in range(3):
        assert (await (await client.post("/v1/completions", json=BODY)).json())["worker"] == "w1"
    replicas.remote = {"b": 5}  # the next sync round (a new mapping): the static one is least
    assert (await (await client.post("/v1/completions", json=BODY)).json())["worker"] == "w0"
    assert (await client.delete("/workers/b", headers=admin)).status == 200
    replicas.remote = {}
    for _ in range(2):
        assert (await (await client.post("/v1/completions", json=BODY)).json())["worker"] == "w0"
    assert w1.seen == 3 and w0.seen == 3
    assert len(replicas.published) == 6 and replicas.started and replicas.stopped is False


@pytest.mark.parametrize("status, outcome", [(200, "sent"), (404, "refused"), (500, "refused")])
async def test_a_pin_release_is_counted_by_the_workers_answer(
    fake_workers: StartWorkers, start_router: StartRouter, status: int, outcome: str
) -> None:
    """A session that moves has its pin released on the worker it left (POST
    /release_pin, `_release_pin`). A worker that answers 404 (a version without the
    route) or 500 released nothing: counted as refused, not sent. Here a session moves
    when its first worker answers 503 and the retry places it on the other."""
    released: list[dict] = []
    moves = 0  # sessions that started on the busy worker and moved off it

    async def fail(request: web.Request) -> web.Response:
        nonlocal moves
        moves += 1
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def release(request: web.Request) -> web.Response:
        released.append(await request.json())
        return web.json_response({"released": status == 200}, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", fail)
    if status != 404:  # 404: a worker that has no such route
        app.router.add_post("/release_pin", release)
    busy = TestServer(app, host="127.0.0.1")
    await busy.start_server()
    try:
        [(_, server)] = await fake_workers("ok")
        client = await start_router([url_of(busy), url_of(server)], breaker_failures=1000)
        proxy = client.server.app[PROXY]
        for i in range(40):  # new sessions, each placed on either worker: some move
            body = {**BODY, "prompt": f"{i} session's own text", "prompt_cache_key": f"s{i}"}
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200, await r.text()
            await wait_until(lambda: sum(proxy.pin_releases.values()) == moves)
            if moves == 2:
                break
        assert proxy.pin_releases == {"sent": 0, "refused": 0, "failed": 0, outcome: 2}
        assert len(released) == (2 if status != 404 else 0)
        scrape = await (await client.get("/metrics")).text()
        assert f'radix_router_pin_releases_total{{outcome="{outcome}"}} 2.0' in scrape
    finally:
        await busy.close()


async def test_a_repeated_head_forwards_its_lines_and_only_its_own_per_request_ones(
    start_router: StartRouter, raw_upstreams: Any
) -> None:
    """One connection repeating one head (the own protocol hands each request the same
    headers object, router/http/fast_head.py): each request's own lines (the session's
    pin key, the request id) are its own, the allow-listed ones the same each time."""
    seen: list[list[bytes]] = []  # the forwarded heads' lines

    class Heads(RawUpstream):
        async def answer(self, conn: int, n: int, head: bytes, body: bytes,
                         writer: asyncio.StreamWriter) -> bool:  # fmt: skip
            seen.append(head.lower().split(b"\r\n")[1:-2])
            data = b'{"choices": [{"index": 0, "text": "x"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nx-request-id: %s\r\n\r\n%s"
                         % (len(data), request_id(head), data))  # fmt: skip
            return False

    upstream = Heads()
    worker = await raw_upstreams(upstream)
    client = await start_router([worker.url])
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        for key in ("k1", "k2", "k1"):  # the same length: the same head
            body = json.dumps({**BODY, "prompt_cache_key": key}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"X-Custom: kept-out\r\nUser-Agent: t/1\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
    finally:
        writer.close()

    def named(lines: list[bytes], name: bytes) -> list[bytes]:
        return [line for line in lines if line.startswith(name + b":")]

    assert len(seen) == 3
    pins = [named(lines, b"x-radix-pin-key") for lines in seen]
    assert [len(p) for p in pins] == [1, 1, 1] and pins[0] == pins[2] != pins[1]
    ids = [named(lines, b"x-request-id") for lines in seen]
    assert [len(i) for i in ids] == [1, 1, 1] and len({i[0] for i in ids}) == 3
    for lines in seen:
        assert named(lines, b"user-agent") == [b"user-agent: t/1"]
        assert not named(lines, b"x-custom")
        assert named(lines, b"content-type") == [b"content-type: application/json"]
