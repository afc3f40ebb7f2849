"""Fault scenarios where the bad peer is a client (`python -m loadtests faults`, with the
ones in loadtests/load/faults.py and the same table), and a worker credential's and a
client's attacks on the router's KV feed and tokenizer (`python -m loadtests
holdings-attacks`, HOLDINGS_ATTACKS below):

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

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import redis

from loadtests.kit import Command, checkout, short
from loadtests.load.cluster import Cluster, WorkerSpec, sim_cluster
from loadtests.load.traffic import SPEC, Options, Row, poll, row, with_load
from shared.procs import http_json, wait_until
from shared.wire.kv_events import entry_fields

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


# ---- holdings-attacks (issue 30) -------------------------------------------------------

ATTACKS = ("rejoin", "model-flip", "tokenize", "oversized", "block-size")
BLOCK = 16  # the sim workers' KV event block size (worker config default)
PREFIX = "radixrouter:"
_TOKENS = [(i * 7) % 120 for i in range(7500 * 16)]  # one event's token ids (1 byte each)


def attacks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="per attack")
    parser.add_argument("--oversized-mb", type=int, default=64, help="MB per oversized entry")
    parser.add_argument("--before-ref", default=None, help="also run this git ref's router")


def attacks_main(args: argparse.Namespace) -> int:
    from worker.models.tiny_model import make_tiny_model  # (torch: only when it runs)

    tokenizer = make_tiny_model(Path(tempfile.mkdtemp()), arch="qwen2")
    attacks = [a for a in args.attacks.split(",") if a]
    sides: list[tuple[str, Path | None]] = [("this checkout", None)]
    with contextlib.ExitStack() as stack:
        if args.before_ref:
            sides.insert(
                0, (short(args.before_ref), stack.enter_context(checkout(args.before_ref)))
            )
        rows = []
        for name, tree in sides:
            rows += run_side(name, tree, attacks, args, str(tokenizer))
    print("\n| router | attack | /health p50 ms | p99 ms | max ms | RSS before / peak / after MB "
          "| honest ok | warmed prompt to w1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['attack']} | {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} "
              f"| {r['rss0']:.0f} / {r['rss_peak']:.0f} / {r['rss1']:.0f} | {r['honest']} "
              f"| {r['routed']} |")  # fmt: skip
    return 0


def run_side(
    side: str, tree: Path | None, attacks: list[str], args: argparse.Namespace, tokenizer: str
) -> list[dict]:
    # The workers tokenize with the router's tokenizer (sim engine, the tiny model's
    # tokenizer): the index can only match where both sides make the same ids.
    spec = WorkerSpec(
        decode_ms=1.0, extra=("--log-level", "WARNING", "--kv-events", "--model", tokenizer)
    )
    rows = []
    with Cluster() as f:
        for wid in ("w0", "w1"):
            f.start_worker(wid, spec)
        settings = {"kv_events": True, "tokenizer": tokenizer, "access_log": False,
                    "max_body_bytes": 16 * 1024 * 1024, "log_level": "WARNING"}  # fmt: skip
        router = f.start_router(settings, tree=tree)
        assert f.redis is not None
        _, models = http_json(f.workers["w0"].url + "/v1/models")
        model = models["data"][0]["id"]  # the honest workers' (the attacker names it too)
        store = redis.Redis.from_url(f.redis.url, socket_timeout=300)
        for attack in attacks:
            with contextlib.suppress(TimeoutError):  # each attack from a settled fleet
                wait_until(lambda: honest_ok(router.url) == "w0=ok, w1=ok", 30)
            evil = Evil(store, model)
            rss0 = rss_mb(router.pid)
            error = ""
            with Sampler(router.url, router.pid) as sampler:
                try:
                    ATTACK[attack](evil, router.url, args)
                    deadline = time.monotonic() + args.seconds
                    while time.monotonic() < deadline:
                        evil.tick(attack)
                        time.sleep(1.0)
                except (redis.RedisError, OSError) as exc:  # the attack itself failed
                    error = f" (attack failed: {type(exc).__name__})"
            with contextlib.suppress(redis.RedisError):
                evil.leave()
            time.sleep(1.0)
            honest = honest_ok(router.url)
            try:
                routed = warmed_routes_to_w1(f, router.url, attack, model)
            except OSError as exc:
                routed = type(exc).__name__
            lat = sampler.latencies_ms or [float("nan")]
            q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
            row = {"side": side, "attack": attack, "p50": statistics.median(lat), "p99": q[98],
                   "max": max(lat), "rss0": rss0, "rss_peak": sampler.peak_mb,
                   "rss1": rss_mb(router.pid), "honest": honest + error, "routed": routed}  # fmt: skip
            print(json.dumps(row))
            rows.append(row)
    return rows


# ---- the attacker's credential ----------------------------------------------------------


class Evil:
    """A worker credential: its own hash and its own stream, nothing else."""

    def __init__(self, store: redis.Redis, model: str, wid: str = "evil") -> None:
        self.store, self.wid = store, wid
        self.epoch, self.model, self.seq, self.flips = time.time(), model, 0, 0
        self.block_size = BLOCK

    @property
    def stream(self) -> str:
        return f"{PREFIX}kvevents:{self.wid}"

    def beat(self) -> None:
        record = {"worker_id": self.wid, "url": "http://127.0.0.1:9", "model": self.model,
                  "engine": "sim", "epoch": repr(self.epoch), "kv_capacity_tokens": "1000000",
                  "kv_block_size": str(self.block_size)}  # fmt: skip
        key = f"{PREFIX}worker:{self.wid}"
        with self.store.pipeline(transaction=True) as pipe:
            pipe.delete(key)  # a rejoin: DEL and rewrite of its own hash
            pipe.hset(key, mapping=record)
            pipe.pexpire(key, 5000)
            pipe.execute()

    def write(self, events: list) -> None:
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        self.store.xadd(self.stream, entry_fields(self.wid, self.epoch, self.seq, payload))  # type: ignore[arg-type]
        self.seq += 1

    def flood(self, entries: int) -> None:
        """`entries` batches of ~4 MB: 160k blocks of 16 tokens each (2M in 13)."""
        for n in range(entries):
            events: list = [{"type": "AllBlocksCleared"}] if self.seq == 0 else []
            for e in range(20):
                base = (n * 20 + e) * 7500 + int(self.epoch * 1000) % 10**9 * 10**6
                hashes = list(range(base, base + 7500))
                events.append({"type": "BlockStored", "block_hashes": hashes,
                               "parent_block_hash": None if e == 0 else base - 1,
                               "token_ids": [base % 100_000 + 200, *_TOKENS[1:]],
                               "block_size": BLOCK, "lora_id": None, "medium": "GPU"})  # fmt: skip
            self.write(events)

    def tick(self, attack: str) -> None:
        if attack in ("rejoin", "model-flip"):
            self.epoch, self.seq = time.time(), 0  # a new epoch: sequence from 0
            if attack == "model-flip":
                self.flips += 1
                self.model = f"flip-{self.flips}"
            self.beat()
            self.flood(2)
        elif attack in ("oversized", "block-size"):
            self.beat()  # stay a member

    def leave(self) -> None:
        self.store.delete(f"{PREFIX}worker:{self.wid}", self.stream)


def rejoin(evil: Evil, url: str, args: argparse.Namespace) -> None:
    evil.beat()
    evil.flood(13)


def oversized(evil: Evil, url: str, args: argparse.Namespace) -> None:
    evil.beat()
    time.sleep(1.0)  # followed first
    big = b"\x00" * (args.oversized_mb * 1024 * 1024)
    with evil.store.pipeline(transaction=True) as pipe:  # one MULTI
        for seq in range(8):
            pipe.xadd(evil.stream, entry_fields(evil.wid, evil.epoch, seq, big))  # type: ignore[arg-type]
        pipe.execute()


def block_size(evil: Evil, url: str, args: argparse.Namespace) -> None:
    evil.beat()
    evil.write([{"type": "AllBlocksCleared"},
                {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [5], "block_size": 1, "lora_id": None, "medium": "GPU"}])  # fmt: skip


def tokenize(evil: Evil, url: str, args: argparse.Namespace) -> None:
    body = json.dumps({"model": evil.model, "prompt": "lorem ipsum dolor " * 580_000,
                       "max_tokens": 1}).encode()  # fmt: skip

    def send() -> None:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=120).read()

    for _ in range(3):
        threading.Thread(target=send, daemon=True).start()


ATTACK: dict[str, Callable[[Evil, str, argparse.Namespace], None]] = {
    "rejoin": rejoin, "model-flip": rejoin, "tokenize": tokenize, "oversized": oversized,
    "block-size": block_size,
}  # fmt: skip


# ---- what is measured ---------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# The sampler runs in a process of its own: as a thread of the benchmark it shared the
# attacker's GIL, and msgpack packing a 4 MB entry holds it for 50-170 ms, so /health
# looked that slow whatever the router did (p99 150-450 ms under the rejoin attacks).
_SAMPLER = r"""
import json, sys, time, urllib.request
from pathlib import Path

url, pid, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
latencies, peak = [], 0.0
while not stop.exists():
    start = time.perf_counter()
    try:
        urllib.request.urlopen(url + "/health", timeout=60).read()
    except OSError:
        pass
    latencies.append((time.perf_counter() - start) * 1000)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            peak = max(peak, int(line.split()[1]) / 1024)
    time.sleep(0.05)
print(json.dumps({"latencies_ms": latencies, "peak_mb": peak}))
"""


class Sampler:
    """/health every 50 ms (a slow answer delays the next ask: its latency is recorded)
    and the router's RSS, from a process of its own, while the attack runs."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.latencies_ms: list[float] = []
        self.peak_mb = 0.0
        self._dir = tempfile.TemporaryDirectory(prefix="sampler-")
        self._stop = Path(self._dir.name) / "stop"
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Sampler:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, self.url, str(self.pid), str(self._stop)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.touch()
        if self._proc is None:
            return
        out, _ = self._proc.communicate(timeout=120)
        self._dir.cleanup()
        if out.strip():
            got = json.loads(out)
            self.latencies_ms, self.peak_mb = got["latencies_ms"], got["peak_mb"]


def honest_ok(url: str) -> str:
    try:
        _, data = http_json(url + "/workers", timeout=30)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"
    statuses = {w["worker_id"]: w.get("kv_events") for w in data["data"]}
    return ", ".join(f"{w}={statuses.get(w)}" for w in ("w0", "w1"))


def warmed_routes_to_w1(f: Cluster, url: str, salt: str, model: str) -> str:
    """A prompt sent straight to w1 (the router never saw it), then through the router."""
    prompt = f"{salt}: the warehouse inventory for aisle nine, pallet by pallet. " * 30
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    http_json(f.workers["w1"].url + "/v1/completions", "POST", body, timeout=30)
    time.sleep(1.0)  # its KV events reach the router's index
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers.get("x-radix-worker", "?")


HOLDINGS_ATTACKS = Command(
    """Issue 30's attacks on a live router, measured.

    python -m loadtests holdings-attacks --seconds 8 --before-ref main


A real Redis server, two honest sim workers publishing KV events (`worker serve
--kv-events`) and a real router process (`router serve`, `kv_events` on, a real HF
tokenizer: the tiny Qwen2 one made locally). One worker credential (`evil`: it writes
only its own heartbeat hash and its own stream, as the README's ACL allows) and one API
client then attack, one attack at a time, for `--seconds` each:

    rejoin      13 entries of ~4 MB (2M blocks), then every second DEL + rewrite of its
                hash with a new epoch, and two more 4 MB entries in it
    model-flip  the same, its model field changed every second
    tokenize    three concurrent 10 MB prompts, again and again (any API key can)
    oversized   8 entries of --oversized-mb MB each, in one MULTI
    block-size  its heartbeat names the model's block size, its events block size 1, first

While each runs, `/health` is asked every 50 ms (its latency: p50, p99, max) and the
router's RSS read from /proc (before, peak, after). After it: whether both honest
workers are still `ok` on their index (`/workers`), and whether a prompt warmed on w1
directly (not through the router) is routed to w1. `--before-ref REF` runs the same on
the router of that git ref first, side by side. The numbers go in
loadtests/results/holdings_bounds.md.
""",
    attacks_arguments,
    attacks_main,
)
