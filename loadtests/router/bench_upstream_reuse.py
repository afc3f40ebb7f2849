"""What the upstream reuse rule costs when a worker does not echo request ids.

    python -m loadtests upstream-reuse [--seconds 8] [--connections 32]

The router reuses a keep-alive connection to a worker only after an answer that echoed
its `x-request-id` (router/upstream/transport.py): the project's worker echoes, a stock
engine may not, and then each request gets a fresh connection. Two minimal aiohttp
workers that answer a fixed completion at once, one echoing the id and one not, each
behind its own router (one process, the own client), side by side under wrk: req/s,
the router's CPU per request (utime+stime of its process / requests) and the upstream
connections it opened (`radix_router_upstream_connections_opened_total`).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

from loadtests.router.bench_router_wrk import LUA, spawn, stop, tree_cpu_s, wrk
from shared.procs import answers_health, free_port, wait_until

WORKER = """
import sys
from aiohttp import web
ECHO = sys.argv[2] == "echo"
BODY = b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok"}]}'
async def complete(request):
    await request.read()
    headers = {"Content-Type": "application/json"}
    if ECHO:
        headers["x-request-id"] = request.headers.get("x-request-id", "")
    return web.Response(body=BODY, headers=headers)
async def health(request):
    return web.json_response({"status": "ok"})
app = web.Application()
app.router.add_post("/v1/completions", complete)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def opened(router_url: str) -> int:
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^radix_router_upstream_connections_opened_total (\S+)", text, re.M)
    return int(float(found[1])) if found else -1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=8.0, help="wrk run per target, seconds")
    p.add_argument("--connections", type=int, default=32, help="wrk keep-alive connections")


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-reuse-") as d:
        tmp = Path(d)
        script = tmp / "post.lua"
        script.write_text(LUA)
        (tmp / "worker.py").write_text(WORKER)
        procs = []
        try:
            rows = []
            for mode in ("echo", "no-echo"):
                wport, rport = free_port(), free_port()
                worker = spawn(
                    [sys.executable, str(tmp / "worker.py"), str(wport), mode],
                    tmp / f"{mode}-w.log",
                )
                procs.append(worker)
                wait_until(lambda p=wport: answers_health(f"http://127.0.0.1:{p}"), 60, poll_s=0.2)
                router = spawn([sys.executable, "-m", "router", "serve", "--host", "127.0.0.1",
                                "--port", str(rport), "--worker-url", f"http://127.0.0.1:{wport}",
                                "--log-level", "WARNING"], tmp / f"{mode}-r.log")  # fmt: skip
                procs.append(router)
                url = f"http://127.0.0.1:{rport}"
                wait_until(lambda u=url: answers_health(u), 60, poll_s=0.2)
                rows.append((mode, url, router.pid))
            print(
                "| worker | req/s | p50 (ms) | p99 (ms) | router CPU ms / request | connections opened / request | non-2xx |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|")
            for mode, url, pid in rows:
                wrk(url + "/v1/completions", 1, args.connections, script)  # warm-up
                before_conns, cpu0 = opened(url), tree_cpu_s(pid)
                r = wrk(url + "/v1/completions", args.seconds, args.connections, script)
                cpu = (tree_cpu_s(pid) - cpu0) * 1e3 / max(1, r["done"])
                conns = (opened(url) - before_conns) / max(1, r["done"])
                print(f"| {mode} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {cpu:.3f} | "
                      f"{conns:.2f} | {r['non2xx']} |", flush=True)  # fmt: skip
        finally:
            for proc in procs:
                stop(proc)
    return 0
