"""The live fleet page in a real browser: Debian's headless Chromium, driven by Playwright
for Python, against a real sim fleet (Redis, three `python -m worker serve --engine sim`
processes, `python -m router serve`), with `protect_metrics` on.

The browser logs in the way a person would (the page answers 401 with a Basic challenge,
the browser sends the key), the page lists the workers, and its numbers move while
requests flow. A screenshot is saved in the test's folder, and also to
$RADIX_DASHBOARD_SCREENSHOT when set (that is how docs/dashboard.png was made).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster
from loadtests.load.traffic import prompt
from shared.procs import http_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CHROMIUM = "/usr/bin/chromium"
# Playwright never downloads a browser here: it drives the system one, offline.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
KEY = "dashboard-test-key"
WORKERS = 3


@pytest.fixture
def fleet() -> Cluster:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser: Debian's chromium is not installed at {CHROMIUM}")
    # Decode cost keeps requests in flight long enough for load to show.
    fleet = sim_cluster(WORKERS, WorkerSpec(decode_ms=15.0, prefill_us=20.0, heartbeat_s=0.2))
    try:
        fleet.start_router(
            {"api_keys": KEY, "protect_metrics": True, "balance_abs_threshold": 4},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        yield fleet
    finally:
        fleet.close()


class Traffic:
    """`clients` threads sending shared-prefix completions until stopped."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.url, self.statuses = url, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,)) for c in range(clients)]

    def _run(self, client: int) -> None:
        i = client
        while not self._stop.is_set():
            status, _ = http_json(
                self.url + "/v1/completions", "POST", prompt(i, tokens=12, groups=5),
                headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
            )  # fmt: skip
            self.statuses.append(status)
            i += len(self._threads)

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def number(text: str) -> int:
    return int(text.replace(",", "")) if text.replace(",", "").isdigit() else -1


def test_dashboard_lists_workers_and_follows_traffic(fleet: Cluster, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    assert fleet.router is not None
    url = fleet.router.url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(
                http_credentials={"username": "me", "password": KEY},
                viewport={"width": 1360, "height": 900},
            ).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            response = page.goto(url + "/dashboard")
            assert response is not None and response.status == 200
            page.wait_for_selector(f"#workers tbody tr >> nth={WORKERS - 1}", timeout=10_000)
            rows = page.locator("#workers tbody tr")
            assert sorted(rows.nth(i).get_attribute("data-worker") for i in range(WORKERS)) == [
                f"w{i}" for i in range(WORKERS)
            ]
            assert page.inner_text("#ready") == f"{WORKERS} / {WORKERS}"
            assert number(page.inner_text("#requests")) == 0
            assert page.inner_text("#hit-rate") == "–"

            with Traffic(url) as traffic:
                # The page's own polling must show the traffic: requests counted, the
                # workers' reported hit rate, and cache hits among the route reasons.
                page.wait_for_function(
                    "() => Number(document.getElementById('requests').textContent.replace(/,/g, '')) >= 40",
                    timeout=30_000,
                )
                page.wait_for_selector("#reasons-legend [data-reason=cache_hit]", timeout=10_000)
                page.wait_for_function(
                    "() => document.getElementById('hit-rate').textContent.endsWith('%')",
                    timeout=10_000,
                )
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
            assert traffic.statuses and set(traffic.statuses) == {200}
            # The predicted-vs-actual card says what its number means and which way is good,
            # and the number is predicted / actual as the JSON has them.
            help_text = page.inner_text("#pred-help")
            assert "1.00× is a perfect guess" in help_text and "over-predicts" in help_text
            fleet_json = page.evaluate(
                "async () => (await (await fetch('dashboard.json')).json()).fleet"
            )
            ratio = (
                fleet_json["predicted_cached_tokens_total"]
                / fleet_json["actual_cached_tokens_total"]
            )
            shown = float(page.inner_text("#pred-ratio").rstrip("×"))
            assert abs(shown - ratio) < 0.2, (shown, ratio)  # a poll apart
            assert "predicted" in page.inner_text("#pred-sub")
            # Both charts have axes with units.
            for chart, y_label in (
                ("reasons-chart", "decisions per 10 s"),
                ("hit-chart", "hit rate (%)"),
            ):
                labels = page.locator(f"#{chart} text.axis").all_text_contents()
                assert y_label in labels and any(t.startswith("time (") for t in labels), labels
                assert page.locator(f"#{chart} text.tick").count() >= 5
            assert float(page.inner_text("#hit-rate").rstrip("%")) > 0
            tree_cells = [rows.nth(i).locator("td").nth(11).inner_text() for i in range(WORKERS)]
            assert any(number(t) > 0 for t in tree_cells), tree_cells
            assert "live" in page.inner_text("#updated") and errors == []
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("RADIX_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["RADIX_DASHBOARD_SCREENSHOT"])


def test_a_rebuilding_workers_kv_index_cell_shows_its_progress(fleet: Cluster) -> None:
    """The `KV index` cell of a worker rebuilding after lost KV events (router/fleet/kv_feed.py)
    says so with its progress. The router's real data is served, with one worker's row
    set to rebuilding on the way to the page (no sim worker loses events on demand; the
    router side of it is tests/e2e/test_kv_gap_rebuild.py)."""
    from playwright.sync_api import Route, sync_playwright

    assert fleet.router is not None

    def rebuilding(route: Route) -> None:
        response = route.fetch()
        data = response.json()
        for row, rebuild in zip(
            data["workers"],
            [{"removed": 3, "needed": 8}, {"removed": 5, "needed": 0}],
            strict=False,
        ):
            row["kv_events"], row["kv_events_rebuild"] = "rebuilding", rebuild
        route.fulfill(response=response, json=data)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(
                http_credentials={"username": "me", "password": KEY}
            ).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/dashboard.json", rebuilding)
            page.goto(fleet.router.url + "/dashboard")
            page.wait_for_selector("#workers td:has-text('rebuilding 37%')", timeout=10_000)
            cell = page.locator("#workers td:has-text('rebuilding 37%')")
            assert "3 of 8 blocks removed" in (cell.get_attribute("title") or "")
            assert (
                page.locator("#workers td:has-text('rebuilding (pool size unknown)')").count() == 1
            )
            assert page.locator("#workers td:text-is('off')").count() == WORKERS - 2
            assert not errors, errors
        finally:
            browser.close()


def test_a_registry_outage_shows_a_banner_and_the_columns_explain_themselves(
    fleet: Cluster,
) -> None:
    """Redis stopped under a live fleet: the page says the router routes blind on its last
    known fleet, and the banner goes once Redis is back (issue 31)."""
    from playwright.sync_api import sync_playwright

    assert fleet.router is not None and fleet.redis is not None
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(
                http_credentials={"username": "me", "password": KEY}
            ).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(fleet.router.url + "/dashboard")
            page.wait_for_selector(f"#workers tbody tr >> nth={WORKERS - 1}", timeout=10_000)
            assert page.locator("#registry-banner").is_hidden()
            help_text = page.inner_text("#columns-help")
            assert "in flight" in help_text and "heartbeat" in help_text
            assert "since this router started" in page.inner_text("#requests-sub")
            fleet.redis.stop()
            try:
                page.wait_for_selector("#registry-banner:visible", timeout=20_000)
                banner = page.inner_text("#registry-banner")
                assert "unreachable since" in banner and "last known fleet" in banner, banner
                assert page.inner_text("#ready") == f"{WORKERS} / {WORKERS}"  # still routed
            finally:
                fleet.redis.start()
            page.wait_for_selector("#registry-banner", state="hidden", timeout=20_000)
            assert not errors, errors
        finally:
            browser.close()
