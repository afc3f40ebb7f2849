"""`GET /dashboard` and `GET /dashboard.json` in-process, over loopback, with fake workers.

The page in a real browser against a real fleet is tests/e2e/test_dashboard_browser.py.
"""

from __future__ import annotations

import base64
import re

from router.metrics import ReasonWindow
from tests.router.conftest import StartRouter, StartWorkers, url_of

BODY = {"prompt": "the same long system prompt " * 20, "max_tokens": 3}


def test_reason_window_counts_by_bucket_and_forgets_old_buckets() -> None:
    window = ReasonWindow(bucket_s=10, window_s=30)
    window.add("no_match", 0.0)
    window.add("cache_hit", 5.0)
    window.add("cache_hit", 12.0)
    snap = window.snapshot(25.0)
    assert [b["counts"] for b in snap["series"]] == [
        {"no_match": 1, "cache_hit": 1},
        {"cache_hit": 1},
        {},
    ]
    assert [b["age_s"] for b in snap["series"]] == [25.0, 15.0, 5.0]
    assert snap["totals"] == {"no_match": 1, "cache_hit": 2} and snap["window_s"] == 30
    window.add("balance", 41.0)  # bucket 4: bucket 0 (and 1) leave the window
    snap = window.snapshot(41.0)
    assert snap["totals"] == {"balance": 1} and len(snap["series"]) == 3
    assert sorted(window._counts) == [4]  # memory bounded: old buckets were dropped


async def test_page_is_self_contained(start_router: StartRouter) -> None:
    client = await start_router()
    r = await client.get("/dashboard")
    assert r.status == 200 and r.content_type == "text/html"
    html = await r.text()
    assert "dashboard.json" in html and "<script>" in html
    # Nothing fetched from elsewhere: no src/href attributes, no CSS imports or urls
    # (the SVG namespace string is a name, never fetched).
    assert not re.search(r"\b(src|href)\s*=|@import|url\(", html)
    assert "innerHTML" not in html  # fleet values are text, never markup
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]


async def test_data_follows_requests(fake_workers: StartWorkers, start_router: StartRouter) -> None:
    [(_, s1), (_, s2)] = await fake_workers("ok", "ok", cached_tokens=7)
    client = await start_router([url_of(s1), url_of(s2)])
    before = await (await client.get("/dashboard.json")).json()
    assert {w["url"] for w in before["workers"]} == {url_of(s1), url_of(s2)}
    assert before["fleet"]["requests_total"] == 0 and before["route_reasons"]["totals"] == {}
    assert before["fleet"]["breakers"] == {"closed": 2, "half_open": 0, "open": 0}
    assert before["fleet"]["hit_rate"] is None  # static workers send no heartbeats
    for _ in range(3):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    after = await (await client.get("/dashboard.json")).json()
    assert after["fleet"]["requests_total"] == 3
    assert after["fleet"]["actual_cached_tokens_total"] == 21  # 7 per response
    assert sum(after["route_reasons"]["totals"].values()) == 3
    assert "cache_hit" in after["route_reasons"]["totals"]  # the repeats found their worker
    row = after["workers"][0]
    assert row["state"] == "ready" and row["breaker"] == "closed"
    assert {"load", "waiting", "running", "kv_usage", "tree_chars", "requests_total"} <= set(row)
    assert sum(w["tree_chars"] for w in after["workers"]) > 0
    # The fleet queue per tenant and class (router/queue/stats.py): 3 standard requests.
    standard = after["queue"]["default"]["standard"]
    assert standard["served"] == 3 and standard["waiting"] == 0 and standard["refused"] == 0


async def test_behind_the_metrics_key_with_a_browser_prompt(start_router: StartRouter) -> None:
    client = await start_router(api_keys=("k1",), protect_metrics=True)
    for path in ("/dashboard", "/dashboard.json"):
        refused = await client.get(path)
        assert refused.status == 401
        assert refused.headers["WWW-Authenticate"].startswith("Basic")
        assert (await refused.json())["error"]["code"] == "invalid_api_key"
        wrong = base64.b64encode(b"me:nope").decode()
        assert (await client.get(path, headers={"Authorization": f"Basic {wrong}"})).status == 401
        basic = base64.b64encode(b"anyone:k1").decode()
        assert (await client.get(path, headers={"Authorization": f"Basic {basic}"})).status == 200
        assert (await client.get(path, headers={"Authorization": "Bearer k1"})).status == 200
    # Basic is accepted only where a browser navigates: the API still wants Bearer.
    basic = base64.b64encode(b"x:k1").decode()
    r = await client.get("/metrics", headers={"Authorization": f"Basic {basic}"})
    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"


async def test_open_without_protect_metrics(start_router: StartRouter) -> None:
    client = await start_router(api_keys=("k1",))
    assert (await client.get("/dashboard")).status == 200
    assert (await client.get("/dashboard.json")).status == 200
    assert (await client.get("/v1/models")).status == 401


def test_a_workers_host_tier_reaches_its_dashboard_row() -> None:
    """Heartbeat -> fleet table -> the row the page draws: usage, hits and bandwidth."""
    from router.fleet.table import Fleet
    from router.http.dashboard import _worker_row
    from shared.config import RouterConfig
    from shared.wire.registry import WorkerRecord

    class Hooks:
        def forget(self, worker_id: str) -> None: ...
        def answered(self, *_: object) -> None: ...

    fleet = Fleet(RouterConfig(), Hooks())  # type: ignore[arg-type]
    tiered = WorkerRecord(
        "w1", "http://127.0.0.1:9001", "m", "radix", 1.0, kv_capacity_tokens=1000,
        host_kv_capacity_tokens=8000, host_kv_used_tokens=2000, host_cached_tokens_total=300,
        host_load_bytes_per_s=2.5e10, kv_bytes_per_token=131072,
    )  # fmt: skip
    plain = WorkerRecord("w2", "http://127.0.0.1:9002", "m", "radix", 1.0, kv_capacity_tokens=1000)
    fleet.apply_registry({"w1": tiered, "w2": plain})
    row = _worker_row(fleet.workers["w1"], 0.0, {})
    assert row["host_kv_usage"] == 0.25 and row["host_cached_tokens_total"] == 300
    assert row["host_kv_capacity_tokens"] == 8000 and row["host_load_bytes_per_s"] == 2.5e10
    assert _worker_row(fleet.workers["w2"], 0.0, {})["host_kv_usage"] is None
