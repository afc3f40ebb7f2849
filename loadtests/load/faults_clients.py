"""Fault scenarios where the bad peer is a client (`python -m loadtests faults`, with the
ones in loadtests/load/faults.py and the same table):

    slowloris     `--slow-clients` connections (≥ the router's max_concurrent 8) that
                  declare a body and trickle it a byte every 0.5 s, re-opened when
                  refused → time to recover: until the first is refused (408,
                  body_read_timeout 2 s); the steady load alongside must not notice
    stuck_reader  4 streams of 100,000 tokens whose clients never read, through a second
                  router (stream_write_timeout 2 s) that carries nothing else → time to
                  recover: from opening them until that router has none in flight (it
                  closed their upstreams); then, with those sockets still open, every
                  worker must be idle
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster
from loadtests.load.traffic import SPEC, Options, Row, poll, row, with_load
from shared.procs import http_json

BODY_READ_TIMEOUT_S = 2.0
STREAM_WRITE_TIMEOUT_S = 2.0
MAX_CONCURRENT = 8
# A stuck stream must outlast the buffers between worker and client (about 15k tokens
# of SSE fill them on loopback, measured in tests/e2e/test_slow_clients.py), so these
# workers decode fast and hold 100k-token answers in a 1M-token cache.
STUCK_TOKENS = 100_000
STUCK_SPEC = WorkerSpec(decode_ms=0.1, heartbeat_s=0.5, max_running=64, cache_tokens=1_000_000,
                        extra=("--max-model-len", "200000"))  # fmt: skip


async def _trickle(port: int, stop: asyncio.Event, refused: list[float]) -> None:
    """One slow client: a declared body sent a byte at a time; re-opened once refused."""
    while not stop.is_set():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")  # fmt: skip
        try:
            while not stop.is_set():
                writer.write(b" ")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1024), 0.5):
                        refused.append(time.monotonic())  # answered (408): open another
                        break
        except ConnectionError:
            refused.append(time.monotonic())
        finally:
            writer.close()


async def slowloris(o: Options) -> Row:
    slow = max(o.slow_clients, MAX_CONCURRENT)
    with sim_cluster(o.workers, SPEC) as cluster:
        router = cluster.start_router(
            {"max_concurrent": MAX_CONCURRENT, "body_read_timeout": BODY_READ_TIMEOUT_S}
        )
        port = int(router.url.rsplit(":", 1)[1])
        stop = asyncio.Event()
        refused: list[float] = []
        tasks: list[asyncio.Task[None]] = []

        async def fault() -> tuple[float, str]:
            start = time.monotonic()
            tasks.extend(asyncio.create_task(_trickle(port, stop, refused)) for _ in range(slow))
            rec = await poll(lambda: bool(refused), 30)
            await asyncio.sleep(o.before_s)  # the slow clients keep coming back meanwhile
            return rec, f"{slow} trickling clients for {time.monotonic() - start:.0f}s"

        try:
            outcomes, rec, note = await with_load(cluster, o, fault)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        note += f", max_concurrent {MAX_CONCURRENT}; {len(refused)} slow bodies refused (408)"
        return row("slowloris", cluster, outcomes, rec, note)


def _open_never_read(port: int, i: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": f"stuck reader {i}", "max_tokens": STUCK_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
    sock.setblocking(False)
    return sock


def _streaming(sock: socket.socket) -> bool:
    """Whether the stream's 200 arrived, looked at without reading it (MSG_PEEK)."""
    try:
        return sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"
    except BlockingIOError:
        return False


def _in_flight(router_url: str) -> int:
    _, body = http_json(router_url + "/workers")
    return sum(int(w["in_flight"]) for w in body["data"])


def _stats(cluster: Cluster, key: str) -> int:
    total = 0
    for child in cluster.workers.values():
        _, info = http_json(child.url + "/get_server_info")
        total += int(info["stats"][key])
    return total


async def stuck_reader(o: Options) -> Row:
    with sim_cluster(o.workers, STUCK_SPEC) as cluster:
        cluster.start_router()
        stuck = cluster.add_router("stuck", {"stream_write_timeout": STREAM_WRITE_TIMEOUT_S})
        port = int(stuck.url.rsplit(":", 1)[1])
        socks: list[socket.socket] = []

        async def fault() -> tuple[float, str]:
            start = time.monotonic()
            socks.extend(_open_never_read(port, i) for i in range(4))
            await poll(lambda: all(_streaming(s) for s in socks), 30)
            await poll(lambda: _in_flight(stuck.url) == 0, 60)
            return time.monotonic() - start, "4 streams never read"

        try:
            outcomes, rec, note = await with_load(cluster, o, fault)
            # With the stuck sockets still open: nothing runs, and the stuck streams made
            # only what filled the buffers (the rest of the tokens are what the load asked).
            idle = await asyncio.to_thread(_stats, cluster, "running")
            made = await asyncio.to_thread(_stats, cluster, "completion_tokens_total")
        finally:
            for sock in socks:
                sock.close()
        asked = sum(o.tokens for x in outcomes) + 4 * (2500 - o.tokens)  # the 4 long streams
        stuck_made = made - asked
        note += (f"; then workers running {idle}; the stuck streams generated {stuck_made:,} "
                 f"of {4 * STUCK_TOKENS:,} tokens before the abort")  # fmt: skip
        return row("stuck reader", cluster, outcomes, rec, note)


CLIENT_SCENARIOS = {"slowloris": slowloris, "stuck_reader": stuck_reader}
