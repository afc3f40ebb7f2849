"""The `agent` workload: sessions of tool-calling calls, as plain data any driver replays.

A session is what a coding agent sends for one task. Its distributions (the defaults; one
token a word in the simulator):

- starting context: `context_min`..`context_max` words, uniform (default 10k-30k): the
  system prompt, the tool schemas and the repository context a coding agent opens
  with (Claude Code, Codex and OpenHands start at 10-30k tokens). Distinct per session
  (nothing shared across sessions: the conservative case for a cache);
- calls: `calls_min`..`calls_max` a session, uniform (default 8-24; a fan-out counts as
  one). Call 1 is the starting context and a user turn; each later call is the whole
  context so far plus the last answer and the output of the tool it asked for;
- tool output: `tool_min`..`tool_max` words appended each call (0.5-8k, the issue's
  range), log-uniform (`tool_dist`; most outputs are a file or a grep, few a whole test
  log: mean 2.7k) or uniform (mean 4.25k);
- tool gaps: log-normal, median `gap_median_s`, shape `gap_sigma`, clipped to
  [`gap_min_s`, `gap_max_s`] (default 20 s, 1, 2-240 s: shell and test runs), divided
  by `speedup` for simulation;
- fan-out: with probability `fanout_p` a call fans out `fanout_min`..`fanout_max`
  parallel siblings (sub-agents on one context, each with its own short instruction);
  the chain goes on from the first sibling's answer once all are answered.

Every call carries `prompt_cache_key` = the session's id (what the OpenAI Agents SDK
and Codex send: one key per conversation) and, when `pin_ttl_s` > 0, `cache_pin_ttl`
(our extension, worker/engine/pins.py) for the gap that follows.

`agent_sessions(options)` gives the sessions with their start times (Poisson,
`session_rate` a second); a driver asks each for `next_step()` (the texts of the next
call or its siblings), sends them, and reports the answers with `on_answers`. The
simulator (loadtests/simulate/agents.py) and the live replay below replay the same sessions.

The live replay (`run_live`, `python -m loadtests agent --live`):

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
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from openai import OpenAI

from loadtests import kit
from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.workloads import words
from shared.procs import http_json


@dataclass(frozen=True)
class AgentOptions:
    sessions: int = 32
    calls_min: int = 8  # calls per session (k), uniform, fan-outs counting as one
    calls_max: int = 24
    session_rate: float = 0.5  # sessions started a second (Poisson)
    context_min: int = 10_000  # starting context, words (one token a word in the sim)
    context_max: int = 30_000
    user_words: int = 60
    tool_min: int = 500  # tool output appended each call, words (~tokens)
    tool_max: int = 8000
    tool_dist: str = "loguniform"  # or "uniform"
    output_tokens: int = 48  # each answer
    gap_median_s: float = 20.0
    gap_sigma: float = 1.0
    gap_min_s: float = 2.0
    gap_max_s: float = 240.0
    speedup: float = 1.0  # tool gaps divided by this (simulation, short live runs)
    fanout_p: float = 0.25
    fanout_min: int = 2
    fanout_max: int = 8
    pin_ttl_s: float = 0.0  # cache_pin_ttl sent with each call (0: none)
    keys: bool = True  # send prompt_cache_key
    seed: int = 0


@dataclass
class AgentSession:
    """One agent task; see the module docstring for its shape."""

    sid: int
    start_s: float
    options: AgentOptions
    rng: random.Random
    calls: int = 0  # this session's k (drawn by `agent_sessions`)
    context: str = ""
    calls_done: int = 0
    times: list[tuple[float, float]] = field(default_factory=list)  # (sent, last answer)

    @property
    def key(self) -> str:
        return f"agent-session-{self.options.seed}-{self.sid}"

    @property
    def done(self) -> bool:
        return self.calls_done >= self.calls

    def next_step(self) -> list[str]:
        """The texts of the next call (one) or its parallel siblings (2-8)."""
        o, rng = self.options, self.rng
        if not self.context:
            n = rng.randint(o.context_min, o.context_max)
            self.context = f"system: session {self.sid} " + words(rng, n)
            self.context += "\nuser: " + words(rng, o.user_words)
        last = self.calls_done == self.calls - 1
        if not last and self.calls_done > 0 and rng.random() < o.fanout_p:
            n = rng.randint(o.fanout_min, o.fanout_max)
            return [f"{self.context}\nsubtask {i}: " + words(rng, 12) for i in range(n)]
        return [self.context]

    def on_answers(self, texts: list[str], answers: list[str]) -> None:
        """All of the step's calls answered: the chain goes on from the first sibling,
        plus the output of the tool it called."""
        self.calls_done += 1
        tool = words(self.rng, self.tool_words())
        self.context = f"{texts[0]}\nassistant: {answers[0]}\ntool: {tool}"

    def tool_words(self) -> int:
        """One tool output's length, from `tool_dist` over [`tool_min`, `tool_max`]."""
        o, rng = self.options, self.rng
        if o.tool_dist == "uniform":
            return rng.randint(o.tool_min, o.tool_max)
        return round(math.exp(rng.uniform(math.log(o.tool_min), math.log(o.tool_max))))

    def gap_s(self) -> float:
        """The tool's run time before the next call (already divided by `speedup`)."""
        o = self.options
        gap = math.exp(math.log(o.gap_median_s) + o.gap_sigma * self.rng.gauss(0, 1))
        return min(max(gap, o.gap_min_s), o.gap_max_s) / o.speedup

    def extra_body(self) -> dict[str, object]:
        """What an agent framework adds to each call's body."""
        body: dict[str, object] = {}
        if self.options.keys:
            body["prompt_cache_key"] = self.key
        if self.options.pin_ttl_s > 0:
            body["cache_pin_ttl"] = self.options.pin_ttl_s
        return body


def agent_sessions(options: AgentOptions) -> list[AgentSession]:
    """The workload's sessions in start order (Poisson starts, `session_rate` a second)."""
    rng = random.Random(options.seed)
    t, out = 0.0, []
    for sid in range(options.sessions):
        own = random.Random(f"{options.seed}:{sid}")
        calls = own.randint(options.calls_min, options.calls_max)
        out.append(AgentSession(sid, t, options, own, calls))
        t += rng.expovariate(options.session_rate)
    return out


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
    """Every session, each in its own thread; the figures the simulator reports
    (loadtests/simulate/agents.py), and the pack's (`vllm bench serve` names)."""
    clients = [
        OpenAI(base_url=u + "/v1", api_key="agents", max_retries=2, timeout=120) for u in urls
    ]
    _, body = http_json(urls[0] + "/v1/models")
    model = body["data"][0]["id"]
    lock = threading.Lock()
    calls: list[tuple[int, float, int, int]] = []  # (step index, ttft, cached, prompt)
    per_worker: dict[str, int] = {}
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
                    for o in outs:
                        per_worker[o[0]] = per_worker.get(o[0], 0) + 1
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
    duration = time.perf_counter() - t0
    later = [(c, p) for i, _, c, p in calls if i > 0]
    ttft = np.array([t for _, t, _, _ in calls]) * 1e3
    counts = list(per_worker.values())
    return {
        "hit_after_first": float(np.mean([c / p for c, p in later])) if later else 0.0,
        "jct_mean_s": float(np.mean(jct)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "siblings_colocated": sib[1] / sib[0] if sib[0] else 1.0,
        "calls": len(calls),
        # The pack's columns (loadtests/load/pack.py), under vLLM's names.
        "completed": len(calls),
        "failed": 0,  # a failed call raises: the replay stops
        "request_throughput": len(calls) / duration,
        "mean_ttft_ms": float(ttft.mean()),
        "median_ttft_ms": float(np.median(ttft)),
        "p99_ttft_ms": float(np.percentile(ttft, 99)),
        "hit_rate": sum(c for _, _, c, _ in calls) / max(1, sum(p for *_, p in calls)),
        "load_max_over_mean": max(counts) / float(np.mean(counts)) if counts else 0.0,
    }


def live_cell(
    spec: WorkerSpec, workers: int, settings: dict[str, object], options: AgentOptions,
) -> dict[str, float]:  # fmt: skip
    """The pack's agent cell (loadtests/load/pack.py): a fresh fleet of `workers` sim
    workers (`spec`; pins granted up to the workload's longest gap), one router with
    `settings`, the sessions replayed through it."""
    ttl = options.gap_max_s / options.speedup
    spec = replace(spec, extra=(*spec.extra, "--pin-max-ttl-s", str(ttl)))
    fleet = Cluster()
    try:
        for i in range(workers):
            fleet.start_worker(f"w{i}", spec, wait=False)
        return replay([fleet.start_router(settings).url], options)
    finally:
        fleet.close()


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
    fleet = Cluster()
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
        with kit.checkout(args.before_ref) as tree:
            label = f"today ({kit.short(args.before_ref)})"
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
