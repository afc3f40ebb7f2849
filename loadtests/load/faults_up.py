"""The `up_kill` fault scenario: a worker killed under `radix-router up`.

`up` supervises its children (router/up/local_fleet.py, router/up/restarts.py): the killed
worker is reported in one line and restarted on its port after a backoff, and the router
routes around it meanwhile. The row's time to recover is kill → the new process (a new
epoch) is in the router's `/workers` with a closed breaker; the note says whether `up`
kept running, what it printed about the exit, and how many requests the new process
answered in the `after_s` of load that follow.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from loadtests.load.cluster import ROOT
from loadtests.load.faults_kit import Options, Row, cut_note, load_around, poll
from shared.procs import free_port, http_json, wait_until


def _workers(url: str) -> dict[str, dict[str, Any]]:
    try:
        return {w["worker_id"]: w for w in http_json(url + "/workers", timeout=2)[1]["data"]}
    except (OSError, TypeError, KeyError):
        return {}


async def up_kill(o: Options) -> Row:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "router", "up", "--engine", "sim", "--workers", str(o.workers),
            "--port", str(port), "--start-timeout", "90", "--sim-decode-ms-per-token", "3"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                          env=env, text=True, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    assert up.stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        await asyncio.to_thread(
            wait_until, lambda: any("Press Ctrl-C" in ln for ln in lines) or up.poll() is not None,
            120,
        )  # fmt: skip
        if up.poll() is not None:
            raise RuntimeError("radix-router up did not start:\n" + "".join(lines))
        pid = int(next(ln for ln in lines if "worker-0 (pid" in ln).split("(pid ")[1].split(")")[0])

        async def fault() -> tuple[float, str]:
            epoch = _workers(url)["worker-0"]["epoch"]
            os.killpg(pid, signal.SIGKILL)
            start = time.monotonic()

            def back() -> bool:
                w0 = _workers(url).get("worker-0")
                return w0 is not None and w0["epoch"] != epoch and w0["breaker"] == "closed"

            await poll(back, 60)
            return time.monotonic() - start, ""

        # Fresh prefixes: no tree matches them, so the new (empty) worker-0 gets its share
        # (with shared prefixes the cache-aware rule keeps them where they are cached).
        def fresh(i: int) -> dict[str, Any]:
            return {"prompt": f"{i} fresh text " * 10, "max_tokens": o.tokens}

        outcomes, rec, _ = await load_around(url, o, fault, fresh)
        # The new process counts from 0: what it generated is all after its comeback.
        tokens = _metric(_workers(url)["worker-0"]["url"], "radix_worker_completion_tokens_total")
        report = next((ln.strip() for ln in lines if ln.startswith("worker-0 exited")), "none")
        note = (f"up still running: {up.poll() is None}; it printed: `{report[:90]}…`; "
                f"the new worker-0 then generated {tokens:.0f} tokens" + cut_note(outcomes))  # fmt: skip
        retried = _metric(url, "radix_router_retries_total")
        return Row("worker SIGKILL under up", len(outcomes), sum(x.ok for x in outcomes),
                   retried, rec, note)  # fmt: skip
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def _metric(url: str, name: str, label: str = "") -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


UP_SCENARIOS = {"up_kill": up_kill}
