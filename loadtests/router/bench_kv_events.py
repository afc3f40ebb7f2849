"""Tree alone vs tree + KV events, live: 4 sim workers, the real router, divergence cases
(and `up-prediction`, UP_PREDICTION below: what `radix-router up` predicts cached).

    python -m loadtests kv-events [--sessions 32] [--turns 3] [--cases host,host_routed]

Each case runs the same conversations twice on the same fleet (caches flushed between),
once with the router's `kv_events` off (the prefix tree alone) and once on (the index of
what workers report, beside the tree's in-flight entries; `tokenizer: sim`):

    baseline    nothing diverges: every request goes through the router
    direct      a second client sends each conversation's first turn straight to a
                random worker (the router never sees it), then the rest go through it
    flush       every worker's cache is flushed after the first turns
    flush_half  w0's and w1's caches (half the cluster) are flushed after the first turns:
                with --shared-words, the shared head of every prompt is still held by
                the other two (the fairer flush: a prefix the tree's guess misses exists)
    restart     one worker restarts after the first turns (a new epoch: empty cache)
    capacities  workers' KV pools differ 8x (2 small, 2 large) and the working set
                overflows the small ones
    host        a host KV tier under small device pools (`--host-device-tokens`,
                `--host-cache-tokens`): first turns straight to a random worker as in
                "direct", and `--gap` s between rounds (users thinking: longer than the
                router's `kv_events_inflight`, so its in-flight tree entries are gone)
    host_routed the same fleet and gaps, every turn through the router

The host cases run a third mode, "events GPU only": the index counts host-held blocks
as misses (`kv_events_host_weight: 0`), as a router reading only the device's events.

Prints hit rate (cached / prompt tokens, from each answer's usage) and TTFT p50/p99 (to
the first streamed chunk) per case and mode. Sim workers pay `--prefill-us` per uncached
prompt token, so a miss costs real time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import openai

from loadtests.kit import Command, pct
from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.workloads import NATO_WORDS as WORDS
from shared.procs import Child, free_port, wait_until


@dataclass
class Result:
    prompt: int = 0
    cached: int = 0
    ttfts: list[float] | None = None
    workers: Counter[str] = field(default_factory=Counter)  # requests per worker (router's)

    @property
    def spread(self) -> float:
        """Max / mean requests per worker over the 4 workers (1.0: even)."""
        counts = [self.workers.get(f"w{i}", 0) for i in range(4)]
        return max(counts) / (sum(counts) / 4) if sum(counts) else 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    def pct(self, q: float) -> float:
        """The `q` quantile of TTFT, in ms."""
        return pct(self.ttfts or [0.0], q) * 1000


def system_prompt(rng: random.Random, s: int, words: int, shared: str = "") -> str:
    return f"{shared}Conversation {s}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def shared_head(words: int) -> str:
    """The same first `words` words for every conversation (empty for 0)."""
    rng = random.Random("shared head")
    return "".join(rng.choice(WORDS) + " " for _ in range(words))


async def one(client: openai.AsyncOpenAI, messages: list[dict], res: Result) -> str:
    start = time.perf_counter()
    first = None
    text = ""
    raw = await client.chat.completions.with_raw_response.create(
        model="sim", messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    res.workers[raw.headers.get("x-radix-worker", "direct")] += 1
    stream = raw.parse()
    async for chunk in stream:
        if first is None:
            first = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            res.prompt += chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            res.cached += (details.cached_tokens or 0) if details else 0
    res.ttfts.append(first or 0.0)  # type: ignore[union-attr]
    return text


async def run_case(
    cluster: Cluster, args: argparse.Namespace, case: str, between: Callable[[], None]
) -> Result:
    assert cluster.router is not None
    rng = random.Random(args.seed)
    router = openai.AsyncOpenAI(base_url=cluster.router.url + "/v1", api_key="x", max_retries=2)
    direct = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="x") for u in cluster.worker_urls]
    head = shared_head(args.shared_words)
    chats = [[{"role": "system", "content": system_prompt(rng, s, args.words, head)}]
             for s in range(args.sessions)]  # fmt: skip
    res, side = Result(ttfts=[]), Result(ttfts=[])
    gate = asyncio.Semaphore(args.concurrency)

    async def turn(s: int, k: int) -> None:
        chat = chats[s]
        chat.append({"role": "user", "content": f"Question {k} about {rng.choice(WORDS)}?"})
        async with gate:
            if case in ("direct", "host") and k == 0:  # the second client, to a worker
                answer = await one(rng.choice(direct), chat, side)
            else:
                answer = await one(router, chat, res)
        chat.append({"role": "assistant", "content": answer})

    await asyncio.gather(*(turn(s, 0) for s in range(args.sessions)))
    await asyncio.sleep(0.5)  # events reach the router
    between()
    await asyncio.sleep(0.5)
    for k in range(1, args.turns):
        if case in HOST_CASES:
            await asyncio.sleep(args.gap)  # the users think
        await asyncio.gather(*(turn(s, k) for s in range(args.sessions)))
    for c in (router, *direct):
        await c.close()
    return res


HOST_CASES = ("host", "host_routed")
MODES = {
    "tree": {},
    "tree+events": {"kv_events": True, "tokenizer": "sim"},
    "events GPU only": {"kv_events": True, "tokenizer": "sim", "kv_events_host_weight": 0.0},
}


def flush(cluster: Cluster) -> None:
    cluster.flush()


def wait_events(cluster: Cluster) -> None:
    time.sleep(1.0)  # the router rereads the fleet and the restarted worker's stream


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=600, help="system prompt words per session")
    p.add_argument(
        "--shared-words", type=int, default=0,
        help="words every conversation's system prompt starts with (a hot, replicated prefix)",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prefill-us", type=float, default=100.0)
    p.add_argument("--cache-tokens", type=int, default=60_000)
    p.add_argument("--cases", default="baseline,direct,flush,restart,capacities")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--host-device-tokens", type=int, default=8_000,
                   help="host cases: each worker's device KV pool")  # fmt: skip
    p.add_argument("--host-cache-tokens", type=int, default=60_000,
                   help="host cases: each worker's host KV tier")  # fmt: skip
    p.add_argument("--gap", type=float, default=3.0, help="host cases: seconds between rounds")


def main(args: argparse.Namespace) -> int:
    cases = args.cases.split(",")
    rows = []
    uniform = [args.cache_tokens] * 4
    mixed = [args.cache_tokens // 8] * 2 + [args.cache_tokens] * 2
    small = [args.host_device_tokens] * 4
    host = ("--host-cache-tokens", str(args.host_cache_tokens))
    for caps, tier, names in (
        (uniform, (), [c for c in cases if c != "capacities" and c not in HOST_CASES]),
        (mixed, (), [c for c in cases if c == "capacities"]),
        (small, host, [c for c in cases if c in HOST_CASES]),
    ):
        if not names:
            continue
        with Cluster() as cluster:
            for i, cap in enumerate(caps):
                spec = WorkerSpec(cache_tokens=cap, prefill_us=args.prefill_us, decode_ms=1.0,
                                  max_running=8, extra=("--kv-events", *tier))  # fmt: skip
                cluster.start_worker(f"w{i}", spec)
            for case in names:
                between = {
                    "flush": lambda f=cluster: flush(f),
                    "flush_half": lambda f=cluster: f.flush(only=("w0", "w1")),
                    "restart": lambda f=cluster: (f.restart_worker("w1"), wait_events(f)),
                }.get(case, lambda: None)
                modes = list(MODES) if case in HOST_CASES else ["tree", "tree+events"]
                for mode in modes:
                    settings: dict[str, object] = {"balance_abs_threshold": 4,
                                                   "tree_chars_per_token": 2.5, "access_log": False}  # fmt: skip
                    settings |= MODES[mode]
                    cluster.flush()
                    cluster.start_router(settings)
                    time.sleep(1.0)
                    r = asyncio.run(run_case(cluster, args, case, between))
                    rows.append((case, mode, r))
                    print(f"{case:11s} {mode:15s} hit {r.hit_rate:6.3f}  TTFT p50 "
                          f"{r.pct(0.5):7.1f} ms  p99 {r.pct(0.99):7.1f} ms  "
                          f"({len(r.ttfts or [])} requests, max/mean per worker "
                          f"{r.spread:.2f})", flush=True)  # fmt: skip
    print()
    print("| case | tree alone: hit / p50 / p99 | tree + events: hit / p50 / p99 | hit delta "
          "| events GPU only: hit / p50 / p99 |")  # fmt: skip
    print("|---|---|---|---|---|")
    by = {(c, m): r for c, m, r in rows}
    for case in dict.fromkeys(c for c, _, _ in rows):
        a, b = by[(case, "tree")], by[(case, "tree+events")]
        g = by.get((case, "events GPU only"))
        gpu = f"{g.hit_rate:.3f} / {g.pct(0.5):.0f} ms / {g.pct(0.99):.0f} ms" if g else "-"
        print(f"| {case} | {a.hit_rate:.3f} / {a.pct(0.5):.0f} ms / {a.pct(0.99):.0f} ms | "
              f"{b.hit_rate:.3f} / {b.pct(0.5):.0f} ms / {b.pct(0.99):.0f} ms | "
              f"{100 * (b.hit_rate - a.hit_rate):+.1f} pts | {gpu} |")  # fmt: skip
    return 0


# -- up-prediction -----------------------------------------------------------------------
def dashboard(url: str) -> dict:
    with urllib.request.urlopen(url + "/dashboard.json", timeout=10) as r:
        return json.loads(r.read())


def _ready(url: str) -> bool:
    try:
        return dashboard(url)["fleet"]["ready"] == 2
    except OSError:
        return False


def run(args: argparse.Namespace, kv_events: bool) -> tuple[float, float, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A Child (shared/procs.py): its own session and a log file, never an unread pipe
    # (a full one blocked `up`, which then outlived the bench); `stop` is SIGTERM, which
    # `up` answers by stopping its router and workers, then SIGKILL after the grace.
    with tempfile.TemporaryDirectory() as tmp:
        up = Child("up", ["router", "up", "--workers", "2", "--engine", args.engine,
                          "--port", str(port)] + ([] if kv_events else ["--no-kv-events"]),
                   url, Path(tmp) / "up.log").start()  # fmt: skip
        try:
            wait_until(lambda: _ready(url), 180, up, poll_s=0.5)
            client = openai.OpenAI(base_url=url + "/v1", api_key="x")
            model = client.models.list().data[0].id
            rng = random.Random(3)
            chats = [[{"role": "system", "content": f"Session {s}. " +
                       " ".join(rng.choice(WORDS) for _ in range(args.words))}]
                     for s in range(args.sessions)]  # fmt: skip
            for turn in range(args.turns):
                for chat in chats:
                    chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
                    r = client.chat.completions.create(model=model, messages=chat, max_tokens=8)
                    chat.append(
                        {"role": "assistant", "content": r.choices[0].message.content or ""}
                    )
                time.sleep(0.3)
            fleet = dashboard(url)["fleet"]
            return (fleet["predicted_cached_tokens_total"], fleet["actual_cached_tokens_total"],
                    fleet["hit_rate"] or 0.0)  # fmt: skip
        finally:
            up.stop(grace_s=30)


def up_prediction_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="sim")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--words", type=int, default=300)


def up_prediction_main(args: argparse.Namespace) -> int:
    for kv in (True, False):
        predicted, actual, hit = run(args, kv)
        print(f"up --engine {args.engine} kv_events {'on ' if kv else 'off'}: predicted "
              f"{predicted:,.0f} / actual {actual:,} cached tokens = {predicted / actual:.3f} "
              f"(hit rate {hit:.3f})", flush=True)  # fmt: skip
    return 0


UP_PREDICTION = Command(
    """Predicted vs actual cached tokens on a fresh `radix-router up`, with KV events on (its
default) and off, as a new user would run it.

    python -m loadtests up-prediction [--engine sim] [--sessions 12] [--turns 4]

Starts `python -m router up --workers 2` (then again with `--no-kv-events`), sends
multi-turn chats through it with the official client, and reads the dashboard's totals:
the tokens the router predicted cached on the chosen workers and what they reported.
""",
    up_prediction_arguments,
    up_prediction_main,
)
