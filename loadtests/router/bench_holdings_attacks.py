"""`python -m loadtests holdings-attacks`: issue 30's attacks on a live router, measured.

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack
import redis

from loadtests.load.cluster import BenchFleet, WorkerSpec
from loadtests.refs import checkout, short
from shared.procs import http_json, wait_until
from shared.wire.kv_events import entry_fields

ATTACKS = ("rejoin", "model-flip", "tokenize", "oversized", "block-size")
BLOCK = 16  # the sim workers' KV event block size (worker config default)
PREFIX = "radixrouter:"
_TOKENS = [(i * 7) % 120 for i in range(7500 * 16)]  # one event's token ids (1 byte each)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="per attack")
    parser.add_argument("--oversized-mb", type=int, default=64, help="MB per oversized entry")
    parser.add_argument("--before-ref", default=None, help="also run this git ref's router")


def main(args: argparse.Namespace) -> int:
    from worker.models.tiny_model import make_tiny_model

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
    with BenchFleet() as f:
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


class Sampler:
    """/health every 50 ms (a slow answer delays the next ask: its latency is recorded)
    and the router's RSS, on a thread, while the attack runs."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.latencies_ms: list[float] = []
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            with contextlib.suppress(OSError):
                http_json(self.url + "/health", timeout=60)
            self.latencies_ms.append((time.perf_counter() - start) * 1000)
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
            time.sleep(0.05)


def honest_ok(url: str) -> str:
    try:
        _, data = http_json(url + "/workers", timeout=30)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"
    statuses = {w["worker_id"]: w.get("kv_events") for w in data["data"]}
    return ", ".join(f"{w}={statuses.get(w)}" for w in ("w0", "w1"))


def warmed_routes_to_w1(f: BenchFleet, url: str, salt: str, model: str) -> str:
    """A prompt sent straight to w1 (the router never saw it), then through the router."""
    prompt = f"{salt}: the warehouse inventory for aisle nine, pallet by pallet. " * 30
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    http_json(f.workers["w1"].url + "/v1/completions", "POST", body, timeout=30)
    time.sleep(1.0)  # its KV events reach the router's index
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers.get("x-radix-worker", "?")
