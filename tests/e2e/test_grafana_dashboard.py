"""The chart's Grafana dashboard and alert rules query metrics the services really export.

The dashboard JSON must load with the fields Grafana needs (uid, title, schemaVersion,
panels with unique ids, a type, a grid position inside 24 columns, targets with a refId
and a PromQL expression). Then a live fleet (Redis, a sim worker, a router with a rate
limit) serves streamed and plain requests and a few refusals, and every metric name in
every panel and alert expression must appear in the router's or the worker's /metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest
import yaml

from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.traffic import call, prompt, session
from tests.helm.chart import CHART_DIR, merged, render

DASHBOARD = CHART_DIR / "dashboards" / "radix-router.json"
METRIC = re.compile(r"\b((?:radix|process)_[a-z0-9_]+)\b")
PANEL_TYPES = {"stat", "timeseries", "gauge", "table", "bargauge", "heatmap"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> dict[str, str]:
    """Where -> PromQL, for every dashboard panel target and every alert rule."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    values = merged(None, **{"observability.prometheusRule.enabled": True})
    (rule,) = render(values).of_kind("PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            out[f"alert {r['alert']}"] = r["expr"]
    return out


def test_dashboard_json_has_what_grafana_needs() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] + g["w"] <= 24, p["title"]
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for topic in ("kv cache", "hit rate", "predicted vs actual", "time to first token",
                  "time per output token", "breaker", "load per worker"):  # fmt: skip
        assert topic in titles, topic
    # The chart ships exactly this file, labelled for Grafana's sidecar.
    values = merged(None, **{"observability.grafanaDashboard.enabled": True})
    cm = render(values).get("ConfigMap", "rr-radix-router-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["radix-router.json"]) == d


def _names(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_query_names_a_metric_the_services_export() -> None:
    with Cluster() as fleet:
        worker = await asyncio.to_thread(fleet.start_worker, "w0", WorkerSpec(decode_ms=2.0))
        settings = {"rate_limit_per_key": 5, "rate_limit_burst": 10}
        router = await asyncio.to_thread(fleet.start_router, settings)
        async with session(30) as http:
            url = router.url + "/v1/completions"
            bodies = [{**prompt(i, tokens=8), "stream": i % 2 == 0} for i in range(24)]
            outcomes = await asyncio.gather(*(call(http, url, b) for b in bodies))
        statuses = {o.status for o in outcomes}
        assert 200 in statuses and 429 in statuses  # served, and refused by the limiter
        exported = _names(router.url) | _names(worker.url)
    missing = {
        where: sorted(set(METRIC.findall(expr)) - exported)
        for where, expr in queries().items()
        if set(METRIC.findall(expr)) - exported
    }
    assert not missing, yaml.safe_dump(missing)
    assert all(METRIC.findall(expr) for expr in queries().values())
