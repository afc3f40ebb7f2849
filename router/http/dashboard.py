"""`GET /dashboard`: a live page of the fleet, and `GET /dashboard.json`, the data it polls.

The page (`router/http/dashboard.html`) is one self-contained file: no build step, no script
or font fetched from elsewhere, so it works on an air-gapped cluster. It asks for
`dashboard.json` once a second and draws what it gets. The JSON is one snapshot:

- each worker as `GET /workers` describes it (state, breaker, load, queue, KV usage
  of the device pool and of its host tier, requests, failures, prefix-tree size);
- the fleet's hit rate, from the cumulative `cached_tokens` / prompt tokens the workers
  report in their heartbeats (what the engines actually reused, not the router's guess);
- the router's guess next to it: cached tokens its trees predicted vs the cached tokens
  workers returned on the responses it proxied;
- routing decisions by reason over the last minutes (`router.metrics.ReasonWindow`);
- the registry's state (`reachable`, `unreachable since <time>` with the error, or
  `none` without Redis): the page shows a banner while the fleet is routed blind;
- the fleet queue per tenant and class (router/queue/stats.py): waiting, wait, served,
  SLO attainment, refused.

Both paths sit with `/metrics` behind `protect_metrics` (router/http/auth.py). A browser
cannot send a Bearer header on navigation, so for these two paths the key is also
accepted as the password of HTTP Basic auth and a refusal asks for it
(`WWW-Authenticate: Basic`): the browser prompts once, then sends it on every poll.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

from aiohttp import web

from router.fleet.discovery import iso
from router.http.state import CLOCK, DISCOVERY, FLEET, KV_FEED, METRICS, POLICY, QUEUE
from router.upstream.proxy import echo_of

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard.json"
PATHS = frozenset({PAGE_PATH, DATA_PATH})


@cache
def _page() -> bytes:
    return Path(__file__).with_name("dashboard.html").read_bytes()


def _worker_row(worker: Any, now: float, tree: dict[str, Any]) -> dict[str, Any]:
    row = worker.describe(now)
    capacity = row["kv_capacity_tokens"] or 0
    row["kv_usage"] = row["kv_used_tokens"] / capacity if capacity else None
    host = row["host_kv_capacity_tokens"] or 0
    row["host_kv_usage"] = row["host_kv_used_tokens"] / host if host else None
    row["tree_chars"] = tree.get("tree_chars", 0)
    if row["draining"]:
        row["state"] = "draining"
    elif row["breaker"] == "open":
        row["state"] = "down"
    elif row["breaker"] == "half_open":
        row["state"] = "probing"
    else:
        row["state"] = "ready"
    return row


def snapshot(app: web.Application) -> dict[str, Any]:
    now = app[CLOCK]()
    trees = app[POLICY].worker_stats()
    workers = list(app[FLEET].workers.values())
    rows = [_worker_row(w, now, trees.get(w.worker_id, {})) for w in workers]
    feed = app.get(KV_FEED)
    for row in rows:  # ok: routed on its KV-event index; else why the tree stands in
        row["kv_events"] = feed.status_of(row["worker_id"]) if feed is not None else None
        rebuild = feed.rebuild_of(row["worker_id"]) if feed is not None else None
        row["kv_events_rebuild"] = (
            None if rebuild is None else {"removed": rebuild.removed, "needed": rebuild.needed}
        )
        row["request_id_echo"] = echo_of(app, row["url"])
    prompt = sum(w.report.prompt_tokens_total for w in workers)
    cached = sum(w.report.cached_tokens_total for w in workers)
    predicted = sum(r["predicted_cached_tokens_total"] for r in rows)
    actual = sum(r["actual_cached_tokens_total"] for r in rows)
    breakers = Counter(r["breaker"] for r in rows)
    return {
        "workers": rows,
        "fleet": {
            "workers": len(rows),
            "ready": sum(1 for r in rows if r["state"] == "ready"),
            "requests_total": sum(r["requests_total"] for r in rows),
            "failures_total": sum(r["failures_total"] for r in rows),
            "prompt_tokens_total": prompt,
            "cached_tokens_total": cached,
            "host_cached_tokens_total": sum(w.report.host_cached_tokens_total for w in workers),
            "hit_rate": cached / prompt if prompt else None,
            "predicted_cached_tokens_total": predicted,
            "actual_cached_tokens_total": actual,
            "breakers": {s: breakers.get(s, 0) for s in ("closed", "half_open", "open")},
        },
        "route_reasons": app[METRICS].reasons.snapshot(now),
        "queue": app[QUEUE].stats.snapshot(),
        "registry": _registry(app),
        # Request counts live in this process: a restarted router starts them from 0,
        # so the page labels them with this time (the workers' token totals survive).
        "router_started": iso(app[METRICS].started_wall),
    }


def _registry(app: web.Application) -> dict[str, str]:
    discovery = app.get(DISCOVERY)
    if discovery is None:
        return {"state": "none", "error": ""}
    return {"state": discovery.state, "url": discovery.url, "error": discovery.last_error}


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=_page(),
        content_type="text/html",
        charset="utf-8",
        # Nothing may be loaded from elsewhere, inline script and style only.
        headers={
            "Content-Security-Policy": "default-src 'none'; connect-src 'self'; "
            "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:",
            "Cache-Control": "no-store",
        },
    )


async def data(request: web.Request) -> web.Response:
    return web.json_response(snapshot(request.app), headers={"Cache-Control": "no-store"})
