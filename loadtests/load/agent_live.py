"""`python -m loadtests agent --live`: the agent workload through a local sim fleet.

Each side gets a fresh fleet (Redis, `--workers` sim workers with `--cache-tokens` each,
one cache_aware router, or two replicas with sync for the last side), started from this
checkout, or for the today side from `--before-ref REF` (workers and router both: today's
router and engine). The same sessions (loadtests/load/agents.py) are replayed through the
official openai client, one thread per session and per sibling, tool gaps slept
(divided by `--speedup`); TTFT is the first streamed chunk, the cached tokens come from
the final usage chunk, the worker from `x-radix-worker`.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from openai import OpenAI

from loadtests import refs
from loadtests.load.agents import AgentOptions, AgentSession, agent_sessions
from loadtests.load.cluster import BenchFleet, WorkerSpec
from shared.procs import http_json


def _call(client: OpenAI, model: str, text: str, extra: dict[str, object], max_tokens: int):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body=extra,
        temperature=0,
    )  # fmt: skip
    worker = raw.headers.get("x-radix-worker", "?")
    ttft, cached, prompt, answer = None, 0, 1, []
    for chunk in raw.parse():
        if ttft is None:
            ttft = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].delta.content:
            answer.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    return worker, ttft or 0.0, cached, prompt, "".join(answer)


def replay(urls: list[str], options: AgentOptions) -> dict[str, float]:
    """Every session, each in its own thread; the figures agent_bench reports."""
    clients = [
        OpenAI(base_url=u + "/v1", api_key="agents", max_retries=2, timeout=120) for u in urls
    ]
    _, body = http_json(urls[0] + "/v1/models")
    model = body["data"][0]["id"]
    lock = threading.Lock()
    calls: list[tuple[int, float, int, int]] = []  # (step index, ttft, cached, prompt)
    jct: list[float] = []
    sib = [0, 0]  # siblings, siblings on their first sibling's worker
    turn = [0]
    t0 = time.perf_counter()

    def session(s: AgentSession) -> None:
        time.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
        first = time.perf_counter()
        n = 0
        with ThreadPoolExecutor(options.fanout_max) as pool:
            while not s.done:
                texts = s.next_step()
                with lock:
                    picks = [clients[(turn[0] + i) % len(clients)] for i in range(len(texts))]
                    turn[0] += len(texts)
                outs = list(pool.map(
                    lambda ct: _call(ct[0], model, ct[1], s.extra_body(), options.output_tokens),
                    zip(picks, texts, strict=True),
                ))  # fmt: skip
                with lock:
                    calls.extend((n, o[1], o[2], o[3]) for o in outs)
                    if len(outs) > 1:
                        sib[0] += len(outs) - 1
                        sib[1] += sum(o[0] == outs[0][0] for o in outs[1:])
                s.on_answers(texts, [o[4] for o in outs])
                n += 1
                if not s.done:
                    time.sleep(s.gap_s())
        with lock:
            jct.append(time.perf_counter() - first)

    agents = agent_sessions(options)
    with ThreadPoolExecutor(len(agents)) as pool:
        list(pool.map(session, agents))
    later = [(c, p) for i, _, c, p in calls if i > 0]
    return {
        "hit_after_first": float(np.mean([c / p for c, p in later])) if later else 0.0,
        "jct_mean_s": float(np.mean(jct)),
        "ttft_p50_ms": float(np.percentile([t for _, t, _, _ in calls], 50)) * 1e3,
        "ttft_p99_ms": float(np.percentile([t for _, t, _, _ in calls], 99)) * 1e3,
        "siblings_colocated": sib[1] / sib[0] if sib[0] else 1.0,
        "calls": len(calls),
    }


def _side(
    args: argparse.Namespace, options: AgentOptions, pins: bool, replicas: int,
    tree: Path | None,
) -> dict[str, float]:  # fmt: skip
    extra = ("--log-level", "WARNING")
    if pins:
        ttl = options.gap_max_s / options.speedup
        extra += ("--pin-budget", str(args.pin_budget), "--pin-max-ttl-s", str(ttl))
    spec = WorkerSpec(
        decode_ms=args.decode_ms, prefill_us=args.prefill_us, cache_tokens=args.cache_tokens,
        heartbeat_s=0.5, max_running=args.max_running, extra=extra,
    )  # fmt: skip
    fleet = BenchFleet()
    try:
        for i in range(args.workers):
            fleet.start_worker(f"w{i}", spec, wait=False, tree=tree)
        settings: dict[str, object] = {"policy": "cache_aware", "log_level": "WARNING"}
        if replicas > 1:
            settings |= {"sync": True, "sync_flush_interval": 0.01}
        urls = [fleet.start_router(settings, tree=tree).url]
        for r in range(1, replicas):
            urls.append(fleet.add_router(f"router-{r}", settings, tree=tree).url)
        return replay(urls, options)
    finally:
        fleet.close()


def run_live(args: argparse.Namespace, options: AgentOptions) -> int:
    today = replace(options, keys=False, pin_ttl_s=0.0)
    ttl = options.gap_max_s / options.speedup
    pinned = replace(options, keys=True, pin_ttl_s=ttl)
    rows: list[tuple[str, dict[str, float]]] = []
    if args.before_ref:
        with refs.checkout(args.before_ref) as tree:
            label = f"today ({refs.short(args.before_ref)})"
            rows.append((label, _side(args, today, False, 1, tree)))
    else:
        rows.append(("today (this tree, keys and pins off)", _side(args, today, False, 1, None)))
    rows.append(("keys+pins", _side(args, pinned, True, 1, None)))
    rows.append(("keys+pins, 2 replicas", _side(args, pinned, True, 2, None)))
    keys = ["hit_after_first", "jct_mean_s", "ttft_p50_ms", "ttft_p99_ms", "siblings_colocated"]
    print("| side | calls | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for label, row in rows:
        print(f"| {label} | {row['calls']} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    base, best = rows[0][1], rows[1][1]
    print(f"\nkeys+pins / today: JCT {best['jct_mean_s'] / base['jct_mean_s']:.2f}x")
    return 0
