"""The app's edge: auth, limits, admission, bad input, admin API, models, docs, metrics."""

from __future__ import annotations

import asyncio

from router.http.state import FLEET, QUEUE
from tests.router.conftest import StartRouter, StartWorkers, url_of
from tests.waiting import wait_until

BODY = {"prompt": "hello", "max_tokens": 2}


async def test_client_keys_and_separate_admin_key(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], api_keys=("k1", "k2"), admin_key="adm")
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    assert (
        await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    ).status == 401
    assert (
        await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k2"})
    ).status == 200
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer k1"})).status == 200
    assert (await client.get("/health")).status == 200 and (
        await client.get("/metrics")
    ).status == 200
    # A client key is not an admin key.
    add = {"url": "http://127.0.0.1:9"}
    assert (
        await client.post("/workers", json=add, headers={"Authorization": "Bearer k1"})
    ).status == 401
    r = await client.post("/workers", json=add, headers={"Authorization": "Bearer adm"})
    assert r.status == 201 and (await r.json())["worker_id"] == "127.0.0.1:9"
    r = await client.delete("/workers/127.0.0.1:9", headers={"Authorization": "Bearer adm"})
    assert r.status == 200
    r = await client.delete("/workers/127.0.0.1:9", headers={"Authorization": "Bearer adm"})
    assert r.status == 404 and (await r.json())["error"]["code"] == "worker_not_found"


async def test_admin_api_disabled_without_key_and_metrics_protectable(
    start_router: StartRouter,
) -> None:
    client = await start_router(protect_metrics=True, api_keys=("k",))
    assert (await client.post("/workers", json={"url": "http://127.0.0.1:9"})).status == 403
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/metrics", headers={"Authorization": "Bearer k"})).status == 200
    assert (await client.get("/openapi.json")).status == 200


async def test_admin_refuses_bad_worker_urls(start_router: StartRouter) -> None:
    client = await start_router(admin_key="adm")
    auth = {"Authorization": "Bearer adm"}
    for bad in ("file:///etc/passwd", "http://h", "http://u:p@h:1", 5, None):
        r = await client.post("/workers", json={"url": bad}, headers=auth)
        assert r.status == 400, bad
        assert (await r.json())["error"]["param"] == "url"
    assert client.server.app[FLEET].workers == {}


async def test_bad_input_answered_at_the_edge(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(w, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)])
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"\xff\xfe{}", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"prompt": 5}', 400, "invalid_value"),
        (b'{"prompt": "x", "max_tokens": -1}', 400, "invalid_value"),
        (b'{"prompt": "x", "max_tokens": 100000000}', 400, "invalid_value"),
        (b'{"max_tokens": 1}', 400, "invalid_value"),
        # vLLM's rule for its prefix-cache salt: a non-empty string when given
        (b'{"prompt": "x", "cache_salt": ""}', 400, "invalid_value"),
        (b'{"prompt": "x", "cache_salt": 7}', 400, "invalid_value"),
    ]
    for raw, status, code in cases:
        r = await client.post(
            "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status == status, raw
        err = (await r.json())["error"]
        assert err["code"] == code and err["message"] and "type" in err and "param" in err
    r = await client.post("/v1/chat/completions", json={"messages": []})
    assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
    salted = {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}
    r = await client.post("/v1/chat/completions", json=salted)
    assert r.status == 400 and (await r.json())["error"]["param"] == "cache_salt"
    await client.get("/v1/models")  # the router learns the static worker's model
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert w.seen == 0  # nothing bad reached the worker


async def test_huge_body_is_413(fake_workers: StartWorkers, start_router: StartRouter) -> None:
    [(w, server)] = await fake_workers("ok")
    client = await start_router([url_of(server)], max_body_bytes=1000)
    r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"
    assert w.seen == 0


async def test_full_queue_is_429_with_retry_after(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_w, server)] = await fake_workers("hang")
    client = await start_router([url_of(server)], max_concurrent=1, max_queue=1, queue_timeout=0.3)
    first = asyncio.create_task(client.post("/v1/completions", json=BODY))
    admission = client.server.app[QUEUE]
    await wait_until(lambda: admission.active == 1)
    queued = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await wait_until(lambda: admission.waiting == 1)
    r = await client.post("/v1/completions", json=BODY)  # queue full
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    assert (await r.json())["error"]["type"] == "rate_limit_error"
    r = await asyncio.wait_for(queued, 5)  # waited past queue_timeout
    assert r.status == 429 and "Retry-After" in r.headers
    first.cancel()
    await wait_until(lambda: admission.active == 0)
    assert admission.active == 0 and admission.waiting == 0


async def test_models_health_workers_openapi_metrics(
    fake_workers: StartWorkers, start_router: StartRouter
) -> None:
    [(_, s1), (_, s2)] = await fake_workers("ok", "ok")
    client = await start_router([url_of(s1), url_of(s2)])
    models = await (await client.get("/v1/models")).json()
    assert sorted(m["id"] for m in models["data"]) == ["model-w0", "model-w1"]
    health = await client.get("/health")
    assert health.status == 200 and (await health.json())["workers"] == 2
    assert (await client.post("/v1/completions", json={**BODY, "model": "model-w1"})).status == 200
    workers = (await (await client.get("/workers")).json())["data"]
    by_url = {w["url"]: w for w in workers}
    assert by_url[url_of(s2)]["requests_total"] == 1 and by_url[url_of(s1)]["requests_total"] == 0
    assert {
        "load",
        "in_flight",
        "breaker",
        "epoch",
        "tree",
        "predicted_cached_tokens_total",
    } <= set(workers[0])
    # Believed in full: its answers bore out the predictions (router/holdings/claims.py).
    assert {w["claims_believed"] for w in workers} == {1.0}
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
    text = await (await client.get("/metrics")).text()
    assert 'radix_router_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert "radix_router_workers_routable 2.0" in text


async def test_unknown_route_and_method_are_openai_errors(start_router: StartRouter) -> None:
    client = await start_router()
    r = await client.get("/nope")
    assert r.status == 404 and "error" in await r.json()
    r = await client.get("/v1/completions")
    assert r.status == 405 and "error" in await r.json()


async def test_the_fleet_queue_ticks_once() -> None:
    """One fleet-queue task per app: a second (a cleanup context listed twice) refreshed
    the seats twice a tick, so with replicas each floor window slid past at twice the
    rate its length was computed for."""
    from aiohttp import web

    from router.http.app import create_app
    from shared.config import RouterConfig

    runner = web.AppRunner(create_app(RouterConfig(worker_urls=("http://127.0.0.1:9",))))
    await runner.setup()
    try:
        ticking = [t for t in asyncio.all_tasks() if t.get_name() == "fleet-queue"]
        assert len(ticking) == 1
    finally:
        await runner.cleanup()
