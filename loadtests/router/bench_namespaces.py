"""Cache namespaces: predicted hits an engine that honours them then serves as misses.

    python -m loadtests namespaces [--groups 6] [--questions 4] [--workers-per-model 4]
    python -m loadtests namespaces --live [--before-ref main] [--workers 4]

The workload: the same prompts (shared system prompts, a few questions each) under every
namespace of 3 models x 4 tenants (three `cache_salt`s and one unsalted) x 2 chat
templates (the model's own, and `chat_template_kwargs` that change the rendering), in a
random order. Each model has its own workers (a worker serves one model, as in the
fleet). Every request goes through the router's real holdings room and `cache_aware`
policy (router/routing.py), twice, side by side on the same stream:

- ``today``: the request's namespace ignored (what the router did before issue 30: it
  keyed a prompt by its text alone);
- ``keyed``: the request's namespace from its salt and template (router/holdings/namespace.py),
  as a router that renders chats keys it (a `tokenizer` set; routing on text, it keys no
  template).

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from contextlib import ExitStack

import aiohttp

from loadtests.load.cluster import BenchFleet, WorkerSpec
from loadtests.options import HelpFormatter
from loadtests.refs import checkout, short
from router.fleet.view import FleetView
from router.holdings.namespace import DEFAULT, namespace_of
from router.holdings.prediction import RouteRequest
from router.policy import build_routing
from shared.config import RouterConfig

MODELS = ("base", "lora-a", "lora-b")
SALTS = (None, "tenant-1", "tenant-2", "tenant-3")
TEMPLATES = (None, {"enable_thinking": False})
CHARS_PER_TOKEN = 4.0


def common(a: str, b: str) -> int:
    """Chars two prompts share from the start (the engine's hit, before blocks)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def workload(groups: int, questions: int, seed: int) -> list[tuple[str, str, object, object]]:
    """(text, model, salt, template kwargs) for every prompt under every namespace."""
    rng = random.Random(seed)
    systems = ["".join(rng.choices("abcdefgh ", k=400)) for _ in range(groups)]
    prompts = [s + f" question {q}: " + "x" * 20 for s in systems for q in range(questions)]
    out = [(p, m, s, t) for p in prompts for m in MODELS for s in SALTS for t in TEMPLATES]
    rng.shuffle(out)
    return out


def run_arm(keyed: bool, stream: list, per_model: int, seed: int) -> dict[str, float]:
    routing = build_routing(RouterConfig(tree_chars_per_token=CHARS_PER_TOKEN), random.Random(seed))
    views = {m: FleetView([f"{m}-w{i}" for i in range(per_model)]) for m in MODELS}
    engine: dict[tuple[str, object], list[str]] = {}  # (worker, engine key) -> prompts
    predicted = wasted = engine_hit = prompt_tokens = 0.0
    false_requests = predicted_requests = 0
    for step, (text, model, salt, kwargs) in enumerate(stream):
        namespace = namespace_of(model, salt, None, kwargs) if keyed else DEFAULT  # type: ignore[arg-type]
        request = RouteRequest(text, model=model, namespace=namespace)
        decision = routing.select(request, views[model], float(step))
        key = (decision.worker_id, (model, salt, repr(kwargs)))
        held = engine.setdefault(key, [])
        cached = max((common(text, h) for h in held), default=0) / CHARS_PER_TOKEN
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.add_argument("--groups", type=int, default=6, help="system prompts")
    parser.add_argument("--questions", type=int, default=4, help="questions per system prompt")
    parser.add_argument("--workers-per-model", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", action="store_true", help="sim workers and real routers")
    parser.add_argument("--before-ref", default="main", help="--live: the router to compare")
    parser.add_argument("--workers", type=int, default=4, help="--live: sim workers")


async def drive_live(url: str, stream: list) -> dict[str, int]:
    """The chats one at a time through `url`; the router's predictions against the
    worker's cached tokens."""
    out = {"requests": 0, "predicted": 0, "false": 0, "false_chars": 0, "cached": 0}
    async with aiohttp.ClientSession() as http:
        for text, _model, salt, kwargs in stream:
            body: dict[str, object] = {
                "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            }  # fmt: skip
            if salt is not None:
                body["cache_salt"] = salt
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            async with http.post(url + "/v1/chat/completions", data=json.dumps(body),
                                 headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                data = await r.json()
                assert r.status == 200, data
                matched = int(r.headers.get("x-radix-matched-chars", "0"))
            details = data["usage"].get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
            out["requests"] += 1
            out["cached"] += cached
            if matched > 0:
                out["predicted"] += 1
                if cached == 0:
                    out["false"] += 1
                    out["false_chars"] += matched
    return out


def main_live(args: argparse.Namespace) -> int:
    stream = [(t, m, s, k) for t, m, s, k in workload(args.groups, args.questions, args.seed)
              if m == MODELS[0]]  # fmt: skip
    ref = short(args.before_ref)
    print(f"live: {len(stream)} chats (1 model x {len(SALTS)} tenants x {len(TEMPLATES)} "
          f"templates), {args.workers} sim workers, one at a time\n")  # fmt: skip
    print("| router | requests predicted a hit | of them answered with 0 cached tokens | "
          "predicted chars on those | cached tokens, all requests |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    with ExitStack() as stack:
        before = stack.enter_context(checkout(args.before_ref))
        fleet = stack.enter_context(BenchFleet())
        for i in range(args.workers):
            fleet.start_worker(f"w{i}", WorkerSpec(decode_ms=0.0, heartbeat_s=1.0))
        settings = {"access_log": False}
        for name, tree in ((f"{ref} (before)", before), ("this tree", None)):
            router = fleet.add_router(name.split()[0].replace("@", ""), settings, tree=tree)
            fleet.flush()
            r = asyncio.run(drive_live(router.url, stream))
            share = r["false"] / r["predicted"] if r["predicted"] else 0.0
            print(f"| {name} | {r['predicted']} of {r['requests']} | {r['false']} "
                  f"({share:.1%}) | {r['false_chars']:,} | {r['cached']:,} |", flush=True)  # fmt: skip
            router.stop()
    return 0


def main(args: argparse.Namespace) -> int:
    if args.live:
        return main_live(args)
    stream = workload(args.groups, args.questions, args.seed)
    print(f"{len(stream)} requests: {args.groups * args.questions} prompts x "
          f"{len(MODELS)} models x {len(SALTS)} tenants x {len(TEMPLATES)} templates, "
          f"{args.workers_per_model} workers per model\n")  # fmt: skip
    print("| router | predicted hit tokens | of them on requests the engine served with 0 "
          "cached | requests predicted a hit, then 0 cached | engine cached tokens | "
          "predicted / cached | engine hit rate |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name, keyed in (("today (namespace ignored)", False), ("keyed", True)):
        r = rows[name] = run_arm(keyed, stream, args.workers_per_model, args.seed)
        share = r["wasted"] / r["predicted"] if r["predicted"] else 0.0
        print(f"| {name} | {r['predicted']:,.0f} | {r['wasted']:,.0f} ({share:.1%}) | "
              f"{r['false_requests']} of {r['predicted_requests']} | {r['cached']:,.0f} | "
              f"{r['predicted'] / r['cached']:.2f} | {r['hit_rate']:.3f} |")  # fmt: skip
    return 0
