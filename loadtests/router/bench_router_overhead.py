"""Router overhead: the same requests straight to a zero-cost sim worker and through the
router, side by side in one run (and `router-fleet-size`, FLEET_SIZE below: router CPU
per request as its worker table grows).

    python -m loadtests router-overhead [--requests 600] [--concurrency 32] [--seconds 8]
    python -m loadtests router-overhead --before-ref REF [--rounds 4]

Processes: a Redis-free sim worker (prefill and decode cost 0), the router
(`python -m router serve --worker-url ...`, the default cache_aware policy), and this
client. Latency is measured at concurrency 1 with direct and routed requests
interleaved (so drift hits both alike); throughput is a closed loop of `--concurrency`
clients for `--seconds` each way. Streamed time to first byte is measured the same way.

`--before-ref REF`: the router's CPU per request at git commit REF against this tree's,
side by side in one run: REF's files are checked out into a temporary folder, both
routers front the same worker, and `--rounds` closed-loop rounds alternate between them
(so drift on a shared machine hits both alike). CPU is each router process's own
utime + stime over the requests it served.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from loadtests.kit import Command, checkout, cpu_seconds, pct
from loadtests.load.cluster import ROOT, serve_router, sim_worker
from shared.procs import free_port

SYSTEM = "You are a helpful assistant. Answer briefly. " * 40


def body(i: int, stream: bool = False) -> dict:
    return {"prompt": SYSTEM + f"question {i}", "max_tokens": 4, "stream": stream}


async def one(session: aiohttp.ClientSession, url: str, payload: dict) -> float:
    start = time.perf_counter()
    async with session.post(url, json=payload) as r:
        if payload["stream"]:
            await r.content.readany()  # first byte
            elapsed = time.perf_counter() - start
            await r.read()
            return elapsed
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - start


async def latency(
    session: aiohttp.ClientSession, direct: str, routed: str, n: int, stream: bool
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(n):
        order = (
            [("direct", direct), ("router", routed)]
            if i % 2
            else [("router", routed), ("direct", direct)]
        )
        for name, url in order:
            out[name].append(await one(session, url + "/v1/completions", body(i, stream)))
    return out


async def throughput(
    session: aiohttp.ClientSession, url: str, concurrency: int, seconds: float, pids: dict[str, int]
) -> tuple[float, dict[str, float]]:
    """Requests/s, and CPU ms per request of each process in `pids`."""
    done = 0
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    end = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < end:
            await one(session, url + "/v1/completions", body(i))
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    rate = done / (time.perf_counter() - start)
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) * 1000 / done for name, pid in pids.items()}
    return rate, cpu


async def bench(args: argparse.Namespace, direct: str, routed: str, pids: dict[str, int]) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await latency(session, direct, routed, 50, False)  # warm up both paths
        lat = await latency(session, direct, routed, args.requests, False)
        ttfb = await latency(session, direct, routed, args.requests // 3, True)
        rps_direct, _ = await throughput(session, direct, args.concurrency, args.seconds, pids)
        rps_router, cpu = await throughput(session, routed, args.concurrency, args.seconds, pids)
        rps = {"direct": rps_direct, "router": rps_router}
    ms = 1000.0
    print(f"\nRouter overhead, {args.requests} requests at concurrency 1 (interleaved), "
          f"{args.concurrency} concurrent for {args.seconds}s, on {os.cpu_count()} cores\n")  # fmt: skip
    print("| metric | direct | through router | added | ratio |")
    print("|---|---|---|---|---|")
    for label, data in (("latency", lat), ("stream first byte", ttfb)):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            d, r = pct(data["direct"], q) * ms, pct(data["router"], q) * ms
            print(f"| {label} {name} (ms) | {d:.3f} | {r:.3f} | {r - d:+.3f} | {r / d:.2f}x |")
    mean_d, mean_r = statistics.mean(lat["direct"]) * ms, statistics.mean(lat["router"]) * ms
    print(
        f"| latency mean (ms) | {mean_d:.3f} | {mean_r:.3f} | {mean_r - mean_d:+.3f} | {mean_r / mean_d:.2f}x |"
    )
    print(
        f"| max requests/s | {rps['direct']:.0f} | {rps['router']:.0f} | | {rps['router'] / rps['direct']:.2f}x |"
    )
    print(f"\nCPU per routed request: router process {cpu['router']:.3f} ms, "
          f"worker process {cpu['worker']:.3f} ms (load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    added = (pct(lat["router"], 0.5) - pct(lat["direct"], 0.5)) * ms
    print(f"\np50 overhead {added:.3f} ms (target <= 1 ms): {'met' if added <= 1.0 else 'NOT met'}")


async def before_after(
    args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]
) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    cpu: dict[str, list[float]] = {name: [] for name in urls}
    rps: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in urls.values():  # warm up both
            for i in range(50):
                await one(session, url + "/v1/completions", body(i))
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                rate, per = await throughput(
                    session, urls[name], args.concurrency, args.seconds, {name: pids[name]}
                )
                cpu[name].append(per[name])
                rps[name].append(rate)
    print(f"\nRouter CPU per request, {args.before_ref} (before) vs this tree (after): "
          f"{args.rounds} alternating rounds of {args.concurrency} concurrent for "
          f"{args.seconds}s, on {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print("| router | CPU ms / request, each round | median | requests/s, median |")
    print("|---|---|---:|---:|")
    for name in urls:
        rounds = ", ".join(f"{c:.3f}" for c in cpu[name])
        print(f"| {name} | {rounds} | {statistics.median(cpu[name]):.3f} | "
              f"{statistics.median(rps[name]):.0f} |")  # fmt: skip
    ratio = statistics.median(cpu["after"]) / statistics.median(cpu["before"])
    print(f"\nafter / before CPU per request: {ratio:.2f}x")
    # Below saturation each request passes at once: what the fleet queue adds to a
    # streamed first byte, at concurrency 1, the two routers interleaved.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        lat = await latency(session, urls["before"], urls["after"], args.requests, True)
    before, after = statistics.median(lat["direct"]), statistics.median(lat["router"])
    print(f"stream first byte p50, {args.requests} each, interleaved: before "
          f"{before * 1e3:.2f} ms, after {after * 1e3:.2f} ms: {(after - before) * 1e3:+.2f} ms")  # fmt: skip


def main_before_after(args: argparse.Namespace) -> None:
    wport = free_port()
    ports = {"before": free_port(), "after": free_port()}
    flags = ["--policy", args.policy, "--worker-url", f"http://127.0.0.1:{wport}"]
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="router-before-")))
        roots = {"before": stack.enter_context(checkout(args.before_ref)), "after": ROOT}
        stack.callback(sim_worker(wport, logs).stop)
        pids = {}
        for name, port in ports.items():
            child = serve_router(name, port, logs, flags, roots[name])
            stack.callback(child.stop)
            pids[name] = child.pid
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        asyncio.run(before_after(args, urls, pids))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--before-ref", help="git commit to compare this tree's router CPU against")
    p.add_argument("--rounds", type=int, default=4, help="with --before-ref: rounds each")


def main(args: argparse.Namespace) -> None:
    if args.before_ref:
        main_before_after(args)
        return
    wport, rport = free_port(), free_port()
    flags = ["--policy", args.policy, "--worker-url", f"http://127.0.0.1:{wport}"]
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="router-overhead-")))
        worker = sim_worker(wport, logs)
        stack.callback(worker.stop)
        routed = serve_router("router", rport, logs, flags)
        stack.callback(routed.stop)
        pids = {"router": routed.pid, "worker": worker.pid}
        asyncio.run(bench(args, f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{rport}", pids))


# -- router-fleet-size ------------------------------------------------------------------
SYSTEMS = [f"System prompt {k}: you are a careful assistant. " * 30 for k in range(8)]


def loopback(k: int) -> str:
    """The k-th address of 127.0.0.0/8, skipping .0 and .255 (k = 0 is 127.0.0.1)."""
    a, b = divmod(k, 254)
    return f"127.0.{a}.{b + 1}"


def write_config(path: Path, n: int, port: int) -> Path:
    urls = "".join(f"  - http://{loopback(k)}:{port}\n" for k in range(n))
    path.write_text(f"worker_urls:\n{urls}")
    return path


def fleet_body(i: int) -> dict:
    return {
        "model": "sim",  # what OpenAI clients always send
        "prompt": SYSTEMS[i % len(SYSTEMS)] + f"question {i}",
        "max_tokens": 4,
    }


async def closed_loop(url: str, concurrency: int, seconds: float, pid: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as r:  # learn each worker's model
            assert r.status == 200, r.status
        for i in range(200):  # warm-up: connections, trees
            async with session.post(url + "/v1/completions", json=fleet_body(i)) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
        latencies: list[float] = []
        end = time.perf_counter() + seconds
        cpu_before = cpu_seconds(pid)

        async def loop(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=fleet_body(i)) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - start)
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds(pid) - cpu_before
    n = len(latencies)
    return {"cpu_us": cpu / n * 1e6, "rps": n / elapsed, "p50_ms": pct(latencies, 0.5) * 1e3}


def run_router(
    name: str, tree: Path, config: Path, logs: Path, concurrency: int, seconds: float
) -> dict[str, float]:
    child = serve_router(name, free_port(), logs, ["--config", str(config)], tree)
    try:
        return asyncio.run(closed_loop(child.url, concurrency, seconds, child.pid))
    finally:
        child.stop()


def run_together(
    trees: dict[str, Path], config: Path, logs: Path, concurrency: int, seconds: float
) -> dict[str, dict[str, float]]:
    """Every router of `trees` under its own closed loop, all at the same time."""
    with ExitStack() as stack:
        started = {}
        for name, tree in trees.items():
            started[name] = serve_router(name, free_port(), logs, ["--config", str(config)], tree)
            stack.callback(started[name].stop)

        async def both() -> list[dict[str, float]]:
            return await asyncio.gather(
                *(closed_loop(c.url, concurrency, seconds, c.pid) for c in started.values())
            )

        return dict(zip(started, asyncio.run(both()), strict=True))


def fleet_size_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,64,256,1000")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--before-ref", default="b102ab7")
    p.add_argument("--together", action="store_true", help="run before and after at the same time")


def fleet_size_main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    wport = free_port()
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-size-")))
        before = stack.enter_context(checkout(args.before_ref))
        # 0.0.0.0: every loopback address of the router's static list reaches it
        stack.callback(sim_worker(wport, tmp, host="0.0.0.0").stop)
        for j, n in enumerate(sizes):
            config = write_config(tmp / f"workers{n}.yaml", n, wport)
            order = [("before", before), ("after", ROOT)]
            result = {}
            if args.together:
                result = run_together(dict(order), config, tmp, args.concurrency, args.seconds)
            else:
                for name, tree in order if j % 2 == 0 else order[::-1]:
                    result[name] = run_router(
                        name, tree, config, tmp, args.concurrency, args.seconds
                    )
            for name, _ in order:
                print(f"  {n:>5} workers {name:>6}: {result[name]}", flush=True)
            rows.append((n, result["before"], result["after"]))
    print(f"\nRouter CPU per request vs fleet size (closed loop, {args.concurrency} clients, "
          f"{args.seconds:.0f} s each{', together' if args.together else ''}; before = {args.before_ref}; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f})\n")  # fmt: skip
    print("| workers | CPU µs/req before | CPU µs/req after | before / after "
          "| req/s before | req/s after | p50 ms before | p50 ms after |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, b, a in rows:
        print(f"| {n} | {b['cpu_us']:.0f} | {a['cpu_us']:.0f} | {b['cpu_us'] / a['cpu_us']:.2f}x "
              f"| {b['rps']:.0f} | {a['rps']:.0f} | {b['p50_ms']:.2f} | {a['p50_ms']:.2f} |")  # fmt: skip


FLEET_SIZE = Command(
    """Router CPU per request vs fleet size, before and after the maintained routable view,
side by side in one run.

    python -m loadtests router-fleet-size [--sizes 1,64,256,1000] [--seconds 6]
        [--concurrency 16] [--before-ref b102ab7] [--together]

One zero-cost sim worker process listens on 0.0.0.0; the router gets N static workers
`http://127.0.a.b:PORT`, distinct loopback addresses that all reach that one process, so
each is its own worker id (the router's table, breakers, loads and prefix trees see N
workers) while the serving cost stays one cheap process. For each N, a router built
from `--before-ref` (a temporary worktree: the code before the
change) and one from this working tree run the same closed loop, in alternating order.
Measured: the router process's utime + stime from /proc over the loop, divided by the
requests it answered. With `--together`, both routers run at the same time, each with its
own closed loop of `--concurrency` clients, so both see the same contention moment by
moment (on a shared machine, runs one after the other differ by ±30% from the load of
the minute alone). Before the loop, `GET /v1/models` lets the router learn every
worker's model (what a registry heartbeat reports), and a warm-up fills the trees.
""",
    fleet_size_arguments,
    fleet_size_main,
)


# -- router-pieces ----------------------------------------------------------------------
# Run in each side's own tree with `python -c` (only APIs both sides have): each piece of
# the request path timed in CPU time, min of `repeats` runs of `n` calls, as JSON.
_PIECES = r"""
import asyncio, gc, json, sys, time
from router.http.app import create_app
from router.http.state import CONFIG, FLEET, QUEUE
from router.holdings.prediction import RouteRequest
from shared.config import RouterConfig
from shared.wire.protocol import routing_text

n, repeats = int(sys.argv[1]), int(sys.argv[2])
gc.disable()  # a collection landing in one side's loop is not what is measured
completion = {"model": "sim", "prompt": "x" * 1800 + " question 1", "max_tokens": 4}
chat = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hi " * 100}], "max_tokens": 4}
app = create_app(RouterConfig(worker_urls=("http://127.0.0.1:9",), access_log=False))
fleet, queue = app[FLEET], app[QUEUE]
tenant, request = queue.tenants.of_headers({}), RouteRequest("x")
wid = next(iter(fleet.workers))
worker = fleet.workers[wid]

try:  # what the handler calls for a body of plain values, where the tree has it (h38-body)
    from shared.wire.plain_body import plain_routing
except ImportError:
    plain_routing = lambda endpoint, body: None

def model():
    for _ in range(n):
        plain_routing("completions", completion) or routing_text("completions", completion)

def chat_model():
    for _ in range(n):
        plain_routing("chat", chat) or routing_text("chat", chat)

def seat():  # as the handler does it, and the answer's head hook after it
    if hasattr(queue, "served"):  # (h36-books: `arrive` and `served`, one call each)
        for _ in range(n):
            ticket = queue.arrive(tenant, "standard", request)
            ticket.sit(wid)
            queue.served(ticket, 200)
            queue.answered(ticket, 200)
        return
    for _ in range(n):
        ticket = queue.ticket(tenant, "standard", request)
        queue.pass_now(ticket)
        ticket.sit(wid)
        queue.answered(ticket, 200)
        queue.done(ticket)
        queue.answered(ticket, 200)

def table():
    now = time.monotonic()
    for _ in range(n):
        fleet.view(now, None, exclude=[])
        attempt = fleet.attempt(worker, now)
        fleet.succeeded(attempt, 0.0, None, 100, None, now)
        attempt.release()

# The upstream exchange and the proxy's request side, against a zero worker in its own
# process (its CPU is not this process's): the pool's post, read, release; and
# Proxy.forward for a buffered answer (select, attempt, exchange, relay, books).
import subprocess, socket, uvloop
from multidict import CIMultiDict
from router.http.state import METRICS, ROUTING
from router.upstream.pool import UpstreamPool
from router.upstream.proxy import Proxy, Routed
from shared.procs import free_port
from shared.serving.access_log import REQUEST_ID
port = free_port()
zero = subprocess.Popen([sys.executable, "-m", "loadtests.router.zero_worker", str(port)])
for _ in range(200):
    try:
        socket.create_connection(("127.0.0.1", port), 0.1).close()
        break
    except OSError:
        time.sleep(0.05)
url = f"http://127.0.0.1:{port}"
fleet.remove(wid)  # the app's one worker is the zero worker from here on
fleet.add_url(url, "static")
raw = json.dumps(completion).encode()
head = [("Content-Type", "application/json"), ("User-Agent", "bench")]

async def exchanges():
    pool = UpstreamPool(None, 5.0, 30.0, 1 << 20)
    for i in range(n):
        answer = await pool.post(url, "/v1/completions", head, raw, "rid-%d" % i)
        await answer.read_all()
        pool.release(url, answer)
    await pool.close()

def exchange():
    uvloop.run(exchanges())

from loadtests.router.zero_worker import COMPLETION as ZERO_COMPLETION
from router.upstream.connection import BufferBudget, WorkerConnection

class Quiet(asyncio.Transport):  # a connection's transport that takes the request
    def write(self, data): pass
    def is_closing(self): return False
    def get_extra_info(self, name, default=None): return default

# One whole answer read on a connection (`start` + `data_received`), by its head: the
# zero worker's; a vLLM-like one (Date fixed: it moves once a second); one with a header
# that changes every answer (a head that never repeats).
HEADS = {
    "zero": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-request-id: %(id)s\r\n"
            b"Content-Length: %(n)d\r\n\r\n",
    "vllm": b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 21:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-length: %(n)d\r\ncontent-type: application/json\r\nx-request-id: %(id)s\r\n\r\n",
    "changing": b"HTTP/1.1 200 OK\r\nx-trace: %(trace)s\r\nContent-Type: application/json\r\n"
                b"x-request-id: %(id)s\r\nContent-Length: %(n)d\r\n\r\n",
}

async def reads(kind):
    conn = WorkerConnection(30.0, 1 << 20, lambda c: None, BufferBudget(1 << 24))
    conn.connection_made(Quiet())
    body = ZERO_COMPLETION
    ids = ["%032x" % i for i in range(n)]
    answers = [HEADS[kind] % {b"id": i.encode(), b"n": len(body), b"trace": i[::-1].encode()}
               + body for i in ids]
    t0 = time.process_time()
    for rid, data in zip(ids, answers):
        conn.start(b"POST / HTTP/1.1\r\n\r\n", rid)
        conn.data_received(data)
        assert conn.complete and conn.echoed
        conn._chunks, conn.budget.used, conn._held, conn.busy = [], 0, 0, False  # as taken
    return (time.process_time() - t0) / n * 1e6

def read_zero(): return uvloop.run(reads("zero"))
def read_vllm(): return uvloop.run(reads("vllm"))
def read_changing(): return uvloop.run(reads("changing"))

class Request(dict):
    headers = CIMultiDict({"Content-Type": "application/json", "User-Agent": "bench",
                           "Authorization": "Bearer x", "Accept": "*/*"})

async def forwards():
    pool = UpstreamPool(None, 5.0, 30.0, 1 << 20)
    proxy = Proxy(app[CONFIG], fleet, app[ROUTING], pool, app[METRICS])
    text = completion["prompt"]
    for i in range(n):
        request = Request()
        request[REQUEST_ID] = "rid-%d" % i
        routed = Routed("completions", "/v1/completions", raw, text, None, "sim")
        await proxy.forward(request, routed)
    await pool.close()

def forward():
    uvloop.run(forwards())

class Content:
    def __init__(self, body):
        self.body = body
    def is_eof(self):
        return True
    async def readexactly(self, n):
        return self.body

try:  # a body handed whole, where the tree's handler takes one (shared/serving/body.py)
    from shared.serving.body import WHOLE_BODY
except ImportError:
    WHOLE_BODY = None

class Posted(Request):  # what the router's fast server hands the handler (fast_server.py)
    def __init__(self, body):
        super().__init__()
        self.app, self.path, self.content, self.content_length = app, "/v1/completions", Content(body), len(body)
        if WHOLE_BODY is not None:
            self[WHOLE_BODY] = body

async def handles():
    from router.http.handlers import completions
    from router.upstream.proxy import PROXY
    pool = UpstreamPool(None, 5.0, 30.0, 1 << 20)
    app[PROXY] = Proxy(app[CONFIG], fleet, app[ROUTING], pool, app[METRICS])
    for i in range(n):
        request = Posted(raw)
        request[REQUEST_ID] = "rid-%d" % i
        await completions(request)
    await pool.close()

def handle():
    uvloop.run(handles())

# The whole request in one process, as `serve()` serves it (the app's runner set up,
# its cleanup contexts run), with no kernel in it: the own protocol handed a request's
# bytes (wrk's head, and the OpenAI client's 15 header lines), its edge, the handler, the
# proxy, its upstream connection to a zero worker in this process (ZeroWorker, joined by
# in-memory transports that hand each write over on the next loop pass: no sockets),
# and the answer framed and written to a transport that takes everything. Its CPU is
# the router's Python and the zero worker's (~2 us, the same on both sides).
from loadtests.router.zero_worker import ZeroWorker
from router.http.app import serving_protocol, serving_runner
from router.upstream.proxy import PROXY

prompt = b'{"model": "sim", "prompt": "hello there, a prompt of a few words to route", "max_tokens": 4}'
wrk_head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
openai_head = wrk_head + (
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"User-Agent: OpenAI/Python 1.50.0\r\nX-Stainless-Lang: python\r\n"
    b"X-Stainless-Package-Version: 1.50.0\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
    b"X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.7\r\n"
    b"Authorization: Bearer sk-x\r\nx-stainless-retry-count: 0\r\n")

class Pipe(asyncio.Transport):  # one end of an in-memory connection (None: writes dropped)
    def __init__(self, peer):
        super().__init__()
        self.peer = peer
    def write(self, data):
        if self.peer is not None:
            asyncio.get_running_loop().call_soon(self.peer.data_received, data)
    def is_closing(self): return False
    def get_write_buffer_size(self): return 0
    def get_extra_info(self, name, default=None): return ("127.0.0.1", 1) if name == "peername" else default
    def close(self): pass
    def abort(self): pass
    def pause_reading(self): pass
    def resume_reading(self): pass

class Client:  # the client's end: an answer written resolves `answered`
    answered = None
    def data_received(self, data):
        self.answered.set_result(None)

async def serves(head):
    config = RouterConfig(worker_urls=(url,), access_log=False)
    runner = await serving_runner(create_app(config))
    pool = runner.app[PROXY].pool
    conn, worker = pool._protocol(), ZeroWorker(True)
    conn.connection_made(Pipe(worker))
    worker.connection_made(Pipe(conn))
    pool._origin(url).idle.append(conn)  # the pool's one kept connection to the worker
    protocol = serving_protocol(runner, config)()
    client = Client()  # what is awaited is the answer's write: any version of the protocol
    protocol.connection_made(Pipe(client))
    data = head + b"Content-Length: %d\r\n\r\n%s" % (len(prompt), prompt)
    loop = asyncio.get_running_loop()
    for _ in range(50):  # warm: first-call imports and caches are not a request's
        client.answered = loop.create_future()
        protocol.data_received(data)
        await client.answered
    t0 = time.process_time()  # the requests alone: the app's set-up and cleanup not timed
    for _ in range(n):
        client.answered = loop.create_future()
        protocol.data_received(data)
        await client.answered
    spent = time.process_time() - t0
    assert pool.connects == 0  # every request went over the in-memory connection
    protocol.connection_lost(None)
    await runner.cleanup()
    return spent / n * 1e6

def serve_wrk():
    return uvloop.run(serves(wrk_head))

def serve_openai():
    return uvloop.run(serves(openai_head))

import random
from loadtests.load.workloads import NATO_WORDS
from shared.tokens.prompt_tokens import PromptTokens

tokens = PromptTokens.load("sim")
chats_seed = [0]

def conversation(seed):  # 16 chats of ~2k-token system prompts, turn by turn

    rng = random.Random(seed)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(NATO_WORDS) for _ in range(700))}] for s in range(16)]
    for turn in range(25):
        for chat in chats:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(NATO_WORDS)}?"})
            yield turn, list(chat)
            chat.append({"role": "assistant", "content": " ".join(rng.choices(NATO_WORDS, k=12))})

def turn_keys():  # a later turn's keys, first ask (as the index asks); tokenizing untimed

    spent, asked = 0.0, 0
    while asked < min(n, 800):
        chats_seed[0] += 1
        for turn, chat in conversation(chats_seed[0]):
            ids = tokens.chat(chat)
            t0 = time.process_time()
            ids.block_keys(16)
            if turn:
                spent += time.process_time() - t0
                asked += 1
    return spent / asked * 1e6

def turn_tokens():  # a later turn's prompt ids (render, split, pieces), first ask

    spent, asked = 0.0, 0
    while asked < min(n, 800):
        chats_seed[0] += 1
        for turn, chat in conversation(chats_seed[0]):
            t0 = time.process_time()
            tokens.chat(chat)
            if turn:
                spent += time.process_time() - t0
                asked += 1
    return spent / asked * 1e6

pieces = [model, chat_model, seat, table, turn_tokens, turn_keys, exchange, read_zero,
          read_vllm, read_changing, forward, handle, serve_wrk, serve_openai]
try:  # the own protocol's answers (router/http/fast_answer.py), where the tree has them
    from aiohttp import web
    from aiohttp.base_protocol import BaseProtocol
    from multidict import CIMultiDict
    from router.http.edge import hot_routes
    from router.http.fast_answer import FAST, FastReply
    from router.http import fast_server
    from shared.serving.access_log import REQUEST_ID
    from shared.serving.http import DeadlineStream
except ImportError:
    pass
else:
    class Sink(asyncio.Transport):  # takes every write, never pauses
        def write(self, data): pass
        def is_closing(self): return False
        def get_write_buffer_size(self): return 0

    answer = b'{"id": "x", "choices": [{"text": "abc"}], "usage": {"prompt_tokens": 10}}'
    worker_head = [("Content-Type", "application/json"), ("x-request-id", "r" * 32),
                   ("x-radix-worker", "w0"), ("x-radix-route-reason", "cache_hit"),
                   ("x-radix-matched-chars", "1800")]
    events = [b"data: {\"choices\": [{\"text\": \"t%d \"}]}\n\n" % i for i in range(5)]

    async def answers(way, stream):
        handler, match = hot_routes(app)["/v1/completions"]
        hooks = tuple(h for a in match.apps for h in a.on_response_prepare)
        protocol = BaseProtocol(asyncio.get_running_loop())
        sink = Sink()
        protocol.connection_made(sink)
        try:  # the route's part in its request class, where the tree has them
            from router.http.fast_server import route_request_class
            requests = route_request_class("/v1/completions", handler, match, hooks)
            new = lambda: requests(CIMultiDict(), b"{}", protocol)
        except ImportError:  # the route as a tuple, with its hooks' plain calls if any
            try:
                from router.http.fast_answer import now_hooks
                route = (handler, match, hooks, now_hooks(hooks))
            except ImportError:
                route = (handler, match, hooks)
            new = lambda: fast_server.FastRequest(
                "/v1/completions", CIMultiDict(), b"{}", route, protocol, sink)
        for _ in range(n):
            request = new()
            request[REQUEST_ID] = "r" * 32
            headers = CIMultiDict(worker_head)
            if stream and way == "aiohttp":  # as the proxy streamed before
                resp = DeadlineStream(request, 10.0, status=200, headers=headers)
                await resp.prepare(request)
                for event in events:
                    await resp.write(event)
                await resp.write_eof(b"data: [DONE]\n\n")
            elif stream:
                resp = FAST.stream(request, 200, headers, 10.0)
                await resp.prepare(request)
                for event in events:
                    await resp.write(event)
                await resp.write_eof(b"data: [DONE]\n\n")
                await FAST.finish(request, resp)
            elif way == "aiohttp":  # web.Response, prepared and written by aiohttp
                resp = web.Response(body=answer, status=200, headers=headers)
                await resp.prepare(request)
                await resp.write_eof()
            else:
                await FAST.finish(request, FastReply(200, headers, answer))

    def answer_aiohttp(): asyncio.run(answers("aiohttp", False))
    def answer_own(): asyncio.run(answers("own", False))
    def stream_aiohttp(): asyncio.run(answers("aiohttp", True))
    def stream_own(): asyncio.run(answers("own", True))
    pieces += [answer_aiohttp, answer_own, stream_aiohttp, stream_own]

# The route decision alone (router/routing.py: the room's prediction, cache_aware's pick,
# the tree told) on 8 workers: `route_same` wrk's one prompt again and again, `route_mix`
# 4,096 prompts over 8 shared system prompts (a match, then a new leaf or a refresh).
import random as _random
from router.fleet.view import FleetView
from router.policy import build_routing
route_ids = [f"w{i}" for i in range(8)]
route_view = FleetView(route_ids, capacities=[1_000_000] * 8)
route_same = RouteRequest("hello there, a prompt of a few words to route", model="sim")
route_reqs = [RouteRequest(f"system prompt {i % 8} " * 20 + f"question {i}", model="sim")
              for i in range(4096)]

def route_same_prompt():
    select = build_routing(RouterConfig(), _random.Random(1)).select
    for i in range(n):
        select(route_same, route_view, 1.0 + i)

def route_mixed():
    select = build_routing(RouterConfig(), _random.Random(1)).select
    for i in range(n):
        select(route_reqs[i & 4095], route_view, 1.0 + i)

pieces += [route_same_prompt, route_mixed]

out = {}
only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else None
for piece in pieces if only is None else [p for p in pieces if p.__name__ in only]:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        own = piece()
        best = min(best, own if own is not None else (time.process_time() - t0) / n * 1e6)
    out[piece.__name__] = best
zero.kill()
print(json.dumps(out))
"""
PIECE_NAMES = {
    "model": "request body checked, a completion (plain_routing, else routing_text)",
    "chat_model": "request body checked, a chat (plain_routing, else routing_text)",
    "route_same_prompt": "route decision, 8 workers, one prompt again (Routing.select)",
    "route_mixed": "route decision, 8 workers, 4,096 prompts over 8 prefixes",
    "seat": "fleet queue, a free seat, the handler's calls: arrive, sit, served, answered",
    "table": "fleet table: view, attempt, succeeded, release",
    "turn_tokens": "tokenizer: a later chat turn's prompt ids (PromptTokens.chat, first ask)",
    "turn_keys": "KV index: a later chat turn's block keys (first ask)",
    "exchange": "upstream pool: post, read_all, release (zero worker)",
    "read_zero": "one answer read on a connection, the zero worker's head",
    "read_vllm": "the same, a vLLM-like head (5 lines, Date fixed)",
    "read_changing": "the same, a head with a header that changes every answer",
    "forward": "Proxy.forward, a buffered answer (zero worker)",
    "handle": "the completions handler: body, model, queue, forward, metrics (zero worker)",
    "serve_wrk": "the whole request as served, wrk's head (own protocol .. answer written)",
    "serve_openai": "the same, the OpenAI client's head (15 header lines)",
    # Both ways in one tree (router/http/fast_answer.py; absent from older trees): the
    # own protocol's request, its answer written to a transport that takes everything.
    "answer_aiohttp": "a buffered answer by aiohttp's Response + StreamWriter (as before)",
    "answer_own": "a buffered answer framed by the own protocol (FastReply, one write)",
    "stream_aiohttp": "a 6-chunk stream by aiohttp's DeadlineStream (as before)",
    "stream_own": "a 6-chunk stream framed by the own protocol (FastStream)",
}


def pieces_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=20000, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side, min kept")
    p.add_argument("--rounds", type=int, default=3, help="sides run alternately this often")
    p.add_argument("--before-ref", default="", help="also time the pieces of this git ref")
    p.add_argument("--only", default="", help="these pieces alone (comma-separated names)")


def pieces_main(args: argparse.Namespace) -> int:
    import json
    import subprocess
    import sys

    with ExitStack() as stack:
        sides = {"this tree": ROOT}
        if args.before_ref:
            before = stack.enter_context(checkout(args.before_ref))
            sides = {f"@{args.before_ref}": before, "this tree": ROOT}
        seen: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
        for r in range(args.rounds):
            for name, tree in list(sides.items())[:: 1 if r % 2 == 0 else -1]:
                out = subprocess.run(
                    [sys.executable, "-c", _PIECES, str(args.calls), str(args.repeats), args.only],
                    cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                for piece, us in json.loads(out.stdout).items():
                    seen[name].setdefault(piece, []).append(us)
    names = list(sides)
    print(f"CPU µs per call (min of {args.repeats} runs of {args.calls} calls; the range over "
          f"{args.rounds} alternating rounds)\n")  # fmt: skip
    print("| piece | " + " | ".join(names) + (" | after / before |" if len(names) == 2 else " |"))
    print("|---|" + "---:|" * (len(names) + (len(names) == 2)))
    for piece, title in PIECE_NAMES.items():
        if not any(piece in seen[n] for n in names):
            continue  # not run (`--only`)
        cells = [
            f"{min(seen[n][piece]):.2f}-{max(seen[n][piece]):.2f}" if piece in seen[n] else "-"
            for n in names
        ]
        if len(names) == 2:
            both = all(piece in seen[n] for n in names)
            a, b = (min(seen[n][piece]) for n in names) if both else (0, 0)  # least disturbed
            cells.append(f"{b / a:.2f}x" if both else "-")
        print(f"| {title} | " + " | ".join(cells) + " |")
    this = seen[names[-1]]
    for kind in ("answer", "stream"):
        if f"{kind}_own" in this:
            own, before = (min(this[f"{kind}_{w}"]) for w in ("own", "aiohttp"))
            print(f"\n{kind}, this tree: own / aiohttp's = {own / before:.2f}x")
    return 0


ROUTER_PIECES = Command(
    """The request path's pieces in process, CPU time per call, before and after.

    python -m loadtests router-pieces [--before-ref main] [--calls 20000] [--repeats 5]
        [--rounds 3] [--only serve_wrk,serve_openai]

Each side (this tree, and the router's code at `--before-ref` from a temporary
checkout) runs in its own process, the sides alternating `--rounds` times: the request
model (`routing_text` of a 1,800-char completion body and of a two-message chat body),
the fleet queue's path for a request that finds a free seat (its ticket, admission, the
seat taken, the answer's first byte told twice as the router tells it, the seat given
back), and the fleet table's per-try books (the view, attempt, succeeded, release) on a
router app built by `create_app` with one static worker; and the block keys the KV index
asks of a later turn of a ~2k-token chat (16 chats turn by turn, the sim tokenizer; the
first ask, right after the turn's ids are built; at most 800 turns a run). Against the
zero-cost worker (loadtests/router/zero_worker.py, in its own process, so its CPU is not
counted): the upstream pool's exchange (post, read the body, release), `Proxy.forward`
of a buffered completion (select, attempt, exchange, relay, the books), and the whole
completions handler as the router's fast server calls it (body, request model, queue,
forward, metrics; the server's parsing and the response's writing are not in it). The
whole request as `serve()` serves it, in one process and with no kernel in it
(`serve_wrk`, `serve_openai`): the app's runner set up, the own protocol handed wrk's
request bytes (or the OpenAI client's, 15 header lines), the edge, the handler, the
proxy over an in-memory connection to a zero worker in the same process (its ~2 us
counted on both sides), and the answer written to a transport that takes everything;
the pieces that cross the kernel swing by more than one micro-cut, these do not. Where
the tree has router/http/fast_answer.py, the answer's writing both ways in this tree: a
buffered answer by aiohttp's Response and StreamWriter (as before) and by the own
protocol's one write, a 6-chunk stream by DeadlineStream and by FastStream, each on a
`FastRequest` to a transport that takes everything (`own / aiohttp's` printed). The
garbage collector is off while it times; each figure is the least of `--repeats` runs,
and `after / before` compares each side's least disturbed run. Where a cut is too small
for wrk to resolve (loadtests/results/router_cpu.md), this measures it.
""",
    pieces_arguments,
    pieces_main,
)
