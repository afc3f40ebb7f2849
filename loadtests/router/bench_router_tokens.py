"""Router CPU per request with prompt ids (tokenizer + KV-event index) on vs off (and
`sync-wire`, SYNC_WIRE below: a replica sync entry, text vs prompt ids; `kv-score`,
KV_SCORE below: the `on` routing step against `tok`'s, in process; `chat-ids`, CHAT_IDS
below: a chat's prompt ids from its body, `tok`'s reading against `off`'s, in process).

    python -m loadtests router-tokens [--requests 320] [--rounds 3] [--before-ref REF] [--aa]
        [--fixed-order] [--idle S] [--shared-system] [--tokenizer DIR] [--cache-tokens N]

One zero-cost sim worker publishing KV events and one real router process per mode,
all running at once: `off` (no tokenizer: the text tree alone), `tok` (`tokenizer`
only: each chat rendered with the template and tokenized as the worker does, pieces
cached, the tree keyed on the ids) and `on` (`tokenizer` + `kv_events`: the ids also
looked up in the index, and the feed applying the worker's event stream). Every request
of the multi-turn conversations (~2k-token prompts) goes to every router at the same
moment (in a random order each time), so a busy neighbour on a shared machine slows all
modes alike; each router's own CPU (utime + stime from /proc, its feed's included) is
divided by the requests.

`--before-ref REF` adds `tok@REF` and `on@REF`: the same modes with the router's code
from that git ref (loadtests/kit.py). Every round prints each mode's ratio to the same
round's `off`; `--aa` adds `off2`, the same code as `off`, started last (an A/A pair: the
spread the bench itself reads); the summary gives the range over rounds and whether every
round is within `--target` (issue 26: 1.5x), and each mode's CPU beyond `off`'s in µs a
request (what the ratio hides: every mode's figure carries the same idle CPU, below).

Each conversation opens with a ~2k-token system prompt of its own (new conversations each
round), so a twentieth of the requests carry a prompt no router or worker has seen: it is
tokenized, keyed and stored whole. `--shared-system` gives every conversation of a round the
same one (the `multi_turn` workload's shape): what a turn costs beyond a new long prompt.

`--idle S` first measures each router's CPU a second while nothing is sent (S seconds:
its fleet reads, listeners and ticks, ~10 ms/s) and also prints each round's ratio with
that taken out (CPU a round minus the idle rate times the round's seconds): the routers'
work for the requests alone. The target is the plain ratio; this one says how much of
the distance to it is the constant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from redis.asyncio import Redis

from loadtests.kit import ROOT, Command, checkout, cpu_seconds, short
from loadtests.load.cluster import Cluster, WorkerSpec
from loadtests.load.workloads import NATO_WORDS as WORDS
from router.holdings.sync import DecisionSync
from router.holdings.sync_batch import FIELD, next_entry
from router.holdings.sync_wire import encode_decision
from router.policy import build_routing
from shared.config import RouterConfig
from shared.tokens.fingerprint import tokenizer_fingerprint
from shared.tokens.prompt_ids import KEY_WIDTH
from shared.tokens.prompt_tokens import PromptTokens
from shared.wire.protocol import ChatCompletionRequest, canonical_chat_text
from shared.wire.registry import Registry


async def drive(urls: list[str], args: argparse.Namespace, seed: int) -> int:
    """The conversations, each request sent to every router at once, in a new random order
    each time (`--fixed-order`: in `urls`' order); the first router's answer continues the
    conversation. Returns the requests each router answered.

    Why the order: in a fixed order `off`, first in line, read 6-14% more CPU a request than
    the same code last in line (`--aa`); a random order takes the send order out of that,
    and `--aa` shows the spread left (loadtests/results/router_cpu.md, "What the bench
    itself reads")."""
    rng = random.Random(seed)
    line = random.Random(seed + 1)  # the order: its own draws, so the chats stay the same
    if args.shared_system:  # one system prompt, each chat's own turns
        system = "Chat. " + " ".join(rng.choice(WORDS) for _ in range(args.words))
        chats = [[{"role": "system", "content": system}] for _ in range(args.sessions)]
    else:
        chats = [[{"role": "system", "content": f"Chat {s}. " +
                   " ".join(rng.choice(WORDS) for _ in range(args.words))}]
                 for s in range(args.sessions)]  # fmt: skip
    sent = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def post(url: str, body: bytes) -> dict:
            async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                data = await r.json()
                assert r.status == 200, (url, data)
                return data  # type: ignore[no-any-return]

        for turn in range(args.requests // args.sessions):

            async def one(chat: list[dict], turn: int = turn) -> None:
                chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
                body = json.dumps({"messages": chat, "max_tokens": 4}).encode()
                order = urls if args.fixed_order else line.sample(urls, len(urls))
                answers = await asyncio.gather(*(post(u, body) for u in order))
                content = answers[order.index(urls[0])]["choices"][0]["message"]["content"]
                chat.append({"role": "assistant", "content": content})

            await asyncio.gather(*(one(c) for c in chats))
            sent += len(chats)
    return sent


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=320, help="per router and round")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument(
        "--shared-system", action="store_true",
        help="one system prompt a round for every conversation (the `multi_turn` workload's "
        "shape), not one of its own each: a round's new long prompt is tokenized, keyed and "
        "stored once, not --sessions times",
    )  # fmt: skip
    p.add_argument("--tokenizer", default="sim")
    p.add_argument(
        "--cache-tokens", type=int, default=50_000,
        help="the worker's KV pool in tokens: the default holds the 16 conversations on the "
        "sim tokenizer, not on a real one's longer ids (~3.5k a system prompt on "
        "make-tiny-model's): there its LRU evicts each conversation before its next turn",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before-ref", default="", help="also run tok/on from this git ref")
    p.add_argument("--target", type=float, default=1.5, help="the ratio to off to meet")
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds of idle CPU measured first (0: none): adds the ratio without it")  # fmt: skip
    p.add_argument(
        "--fixed-order",
        action="store_true",
        help="send each request to the routers in the modes' order (before the twelfth pass)",
    )
    p.add_argument(
        "--aa", action="store_true",
        help="also `off2`, a second off router, started last (with --fixed-order, sent to "
        "last): an A/A pair, the bench's own spread (and position cost)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    extra = ("--kv-events",) + (() if args.tokenizer == "sim" else ("--model", args.tokenizer))
    modes = ["off", "tok", "on"]
    if args.before_ref:
        ref = short(args.before_ref)
        modes += [f"tok@{ref}", f"on@{ref}"]
    if args.aa:
        modes.append("off2")
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    own: dict[str, list[float]] = {m: [] for m in modes}  # minus the idle rate (`--idle`)
    with ExitStack() as stack:
        before = stack.enter_context(checkout(args.before_ref)) if args.before_ref else None
        cluster = stack.enter_context(Cluster())
        # A 3 s heartbeat expiry (1 s x 3): on a loaded shared machine the default 0.6 s
        # lapsed mid-round once in a while (`no_workers`), which is not what is measured.
        spec = WorkerSpec(
            decode_ms=0.0, prefill_us=0.0, cache_tokens=args.cache_tokens, heartbeat_s=1.0,
            extra=extra,
        )  # fmt: skip
        cluster.start_worker("w0", spec)
        routers = {}
        for mode in modes:
            kind, _, at = ("off", "", "") if mode == "off2" else mode.partition("@")
            settings: dict[str, object] = {"access_log": False}
            if kind != "off":
                settings |= {"tokenizer": args.tokenizer, "kv_events": kind == "on"}
            name = f"router-{kind}" + ("-before" if at else "") + ("-2" if mode == "off2" else "")
            routers[mode] = cluster.add_router(name, settings, tree=before if at else None)
        urls = [r.url for r in routers.values()]
        asyncio.run(drive(urls, args, seed=100))  # warm-up: pieces, pools, trees
        idle = idle_rates(routers, args.idle)
        pool = int(cluster.worker_counter("radix_worker_kv_capacity_tokens"))
        for r in range(args.rounds):
            computed = computed_tokens(cluster)
            start = {m: cpu_seconds(c.pid) for m, c in routers.items()}
            t0 = time.perf_counter()
            n = asyncio.run(drive(urls, args, seed=200 + r))
            wall = time.perf_counter() - t0
            computed = computed_tokens(cluster) - computed
            for m, c in routers.items():
                used = cpu_seconds(c.pid) - start[m]
                cpu[m].append(used / n * 1e3)
                own[m].append((used - idle.get(m, 0.0) * wall) / n * 1e3)
            line = ", ".join(f"{m} {v[-1]:.3f} ms ({ratio(v[-1], cpu['off'][-1]):.2f}x)"
                             for m, v in cpu.items())  # fmt: skip
            print(f"round {r} ({n} requests each, {wall:.1f} s): {line}", flush=True)
            # Each turn reaches the worker once per router; all but the first find it cached.
            print(f"  the worker computed {computed / n:.0f} prompt tokens a turn beyond its "
                  f"cache (KV pool {pool:,} tokens)", flush=True)  # fmt: skip
    print(summary(cpu, args), flush=True)
    if idle:
        rates = ", ".join(f"{m} {v * 1e3:.1f}" for m, v in idle.items())
        print(f"\nidle CPU over {args.idle:.0f} s, ms a second: {rates}; without it:")
        print(summary(own, args).split("\n", 2)[2], flush=True)
    return 0


def computed_tokens(cluster: Cluster) -> float:
    """Prompt tokens the worker has computed so far, not read from its cache (its /metrics).
    A turn's new tokens, and a new conversation's system prompt, where its pool holds the
    conversations; a whole prompt a turn where it does not (its LRU evicts each
    conversation before its next turn: the feed then applies every prompt's blocks twice,
    stored and removed, and that is what `on` costs)."""
    prompt = cluster.worker_counter("radix_worker_prompt_tokens_total")
    return prompt - cluster.worker_counter("radix_worker_cached_tokens_total")


def idle_rates(routers: dict[str, Any], seconds: float) -> dict[str, float]:
    """Each router's CPU seconds a second over `seconds` with nothing sent ({}: 0 s)."""
    if seconds <= 0:
        return {}
    start = {m: cpu_seconds(c.pid) for m, c in routers.items()}
    time.sleep(seconds)
    return {m: (cpu_seconds(c.pid) - start[m]) / seconds for m, c in routers.items()}


def ratio(value: float, off: float) -> float:
    """/proc counts CPU in 10 ms ticks: a tiny run can read 0 for `off`."""
    return value / off if off else float("inf")


def summary(cpu: dict[str, list[float]], args: argparse.Namespace) -> str:
    """Per mode: CPU per request (min-max over rounds) and its ratio to the same round's
    `off` (min-max), and whether the ratio is within the target in every round."""
    lines = [f"\nrouter CPU per request over {args.rounds} rounds, {args.requests} requests "
             f"each (tokenizer {args.tokenizer}); ratio to the same round's off:"]  # fmt: skip
    for mode, values in cpu.items():
        ratios = [ratio(v, o) for v, o in zip(values, cpu["off"], strict=True)]
        line = f"  {mode:12s} {min(values):.3f}-{max(values):.3f} ms"
        if mode != "off":
            every = "yes" if max(ratios) <= args.target else "NO"
            more = [(v - o) * 1e3 for v, o in zip(values, cpu["off"], strict=True)]
            line += (f"  ratio {min(ratios):.2f}-{max(ratios):.2f}x "
                     f"(mean {sum(ratios) / len(ratios):.2f}x; <= {args.target}x every round: {every})"
                     f"; beyond off {min(more):.0f}-{max(more):.0f} us")  # fmt: skip
        lines.append(line)
    return "\n".join(lines)


# -- sync-wire ---------------------------------------------------------------------------
def chats(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Every request of every conversation, in arrival order (turn by turn)."""
    rng = random.Random(7)
    convs = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(args.words))}]
             for s in range(args.sessions)]  # fmt: skip
    out = []
    for turn in range(args.turns):
        for chat in convs:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            out.append([dict(m) for m in chat])
            chat.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=12))})
    return out


def make_sync(config: RouterConfig, fingerprint: str | None) -> tuple[DecisionSync, Any]:
    policy = build_routing(config, random.Random(1))
    redis = Redis.from_url("redis://127.0.0.1:1")  # never connected: nothing is sent
    sync = DecisionSync(
        redis, Registry(redis, "bench:"), config, policy.holdings.observe, dict, fingerprint=fingerprint,
    )  # fmt: skip
    return sync, policy


def run_arm(
    keys: list[Any], config: RouterConfig, fp: str | None, per_decision: bool = False
) -> tuple[list[bytes], float, float]:
    """(entries, publish CPU s, apply CPU s) for one arm. Publish: the writer's whole CPU,
    the request path's `publish` and the flush's encoding into entries (no Redis).
    `per_decision`: text as the versions before batches wrote it, an entry a decision."""
    writer, _ = make_sync(config, fp)
    entries: list[bytes] = []
    t0 = time.process_time()
    if per_decision:
        header, cap = writer._header, config.sync_max_chars
        for i, key in enumerate(keys):
            entries.append(encode_decision(header, f"w{i % 4}", key, cap))
    else:
        for i, key in enumerate(keys):
            writer.publish(f"w{i % 4}", key)
            if len(writer._pending) == FLUSH:  # a flush every FLUSH decisions
                entries += flush(writer)
        entries += flush(writer)
    publish = time.process_time() - t0
    reader, policy = make_sync(config, fp)
    field = b"d" if per_decision else FIELD
    stream = [(f"{i + 1}-0".encode(), {field: e}) for i, e in enumerate(entries)]
    t0 = time.process_time()
    reader._apply(stream, include_own=False)
    apply = time.process_time() - t0
    assert reader.applied == len(keys), (reader.applied, reader.skipped)
    assert policy.holdings.worker_stats(), "nothing reached the tree"
    return entries, publish, apply


# Decisions a flush takes in this bench: what a replica at ~5,000 req/s buffers in the
# default 20 ms `sync_flush_interval`.
FLUSH = 100


def flush(writer: DecisionSync) -> list[bytes]:
    """The entries a flush of `writer`'s buffer sends (router/holdings/sync.py), unsent."""
    items, out, done = list(writer._pending), [], 0
    writer._pending.clear()
    while done < len(items):
        value, taken, _ = next_entry(
            items, done, writer._header, writer.fingerprint, writer.config.sync_max_chars
        )
        out += [value] if value is not None else []
        done += taken
    return out


def sync_wire_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--rounds", type=int, default=3)


def sync_wire_main(args: argparse.Namespace) -> int:
    requests = chats(args)
    tokens = PromptTokens.load("sim")
    fp = tokenizer_fingerprint(tokens.tokenizer)
    texts = [canonical_chat_text(ChatCompletionRequest.model_validate({"messages": m}).messages)
             for m in requests]  # fmt: skip
    # What the router publishes: the tree's key (a TokenKey, KEY_WIDTH chars an id).
    ids = [tokens.chat(m).tree_key() for m in requests]
    before = "text, an entry a decision"  # the wire before batches, side by side
    arms = {
        "text": (texts, RouterConfig(sync=True), None),
        "tokens": (ids, RouterConfig(sync=True, tokenizer="sim"), fp),
        before: (texts, RouterConfig(sync=True), None),
    }
    text_bytes = [len(t.encode()) for t in texts]
    raw = {"text": text_bytes, "tokens": [len(i) for i in ids], before: text_bytes}
    units = {
        "text": np.mean([len(t) for t in texts]),
        "tokens": np.mean([len(i) // KEY_WIDTH for i in ids]),
    }
    units[before] = units["text"]
    sizes: dict[str, list[int]] = {}
    cpu: dict[str, dict[str, list[float]]] = {a: {"publish": [], "apply": []} for a in arms}
    for _ in range(args.rounds):
        for arm, (keys, config, arm_fp) in arms.items():  # alternating, side by side
            entries, publish, apply = run_arm(keys, config, arm_fp, arm == before)
            # Stream bytes a decision: what Redis stores and every replica reads.
            sizes[arm] = [round(sum(len(e) for e in entries) / len(keys))]
            cpu[arm]["publish"].append(publish / len(keys) * 1e6)
            cpu[arm]["apply"].append(apply / len(keys) * 1e6)
    n = len(requests)
    print(f"{n} decisions ({args.sessions} chats x {args.turns} turns), {args.rounds} rounds, "
          f"a flush every {FLUSH} decisions")  # fmt: skip
    print(
        "| key | mean key length | raw bytes (mean) | stream bytes / decision "
        "| publish µs/decision best / mean | apply µs/decision best / mean |"
    )
    print("|---|---|---|---|---|---|")
    for arm in arms:
        s, c = sizes[arm], cpu[arm]
        unit = "ids" if arm == "tokens" else "chars"
        print(f"| {arm} | {units[arm]:,.0f} {unit} | {statistics.mean(raw[arm]):,.0f} "
              f"| {s[0]:,} | {min(c['publish']):.1f} / {statistics.mean(c['publish']):.1f} "
              f"| {min(c['apply']):.1f} / {statistics.mean(c['apply']):.1f} |")  # fmt: skip
    t, k, b = cpu["text"], cpu["tokens"], cpu[before]

    def ratio(x: dict[str, list[float]], y: dict[str, list[float]], what: str) -> str:
        return f"{what} {statistics.mean(x[what]) / statistics.mean(y[what]):.2f}x"

    print(f"tokens / text: stream bytes {sizes['tokens'][0] / sizes['text'][0]:.2f}x, "
          f"{ratio(k, t, 'publish')}, {ratio(k, t, 'apply')} (means)")  # fmt: skip
    print(f"text batches / an entry a decision: stream bytes {sizes['text'][0] / sizes[before][0]:.2f}x, "
          f"{ratio(t, b, 'publish')}, {ratio(t, b, 'apply')} (means)")  # fmt: skip
    return 0


SYNC_WIRE = Command(
    """Replica sync entries: text vs ids, batches vs an entry a decision; bytes, CPU a decision.

    python -m loadtests sync-wire [--sessions 16] [--turns 20] [--words 700] [--rounds 3]

Routers share each routing decision through Redis (router/holdings/sync.py): the routed
text where the tree keys on text, the prompt ids (uint32, with the tokenizer's
fingerprint) where it keys on tokens, a flush's decisions in one entry, one zlib stream
(router/holdings/sync_batch.py). The same multi-turn chats as `bench_router_tokens` (a
~700-word system prompt, ~2k tokens, one user line a turn; every decision distinct, so
nothing here is a repeat) are turned into decisions, in process, three ways: text and
tokens in batches (a flush every FLUSH decisions), and text as the versions before
batches wrote it (`encode_decision`, an entry a decision, side by side):

- size: stream bytes a decision (what Redis stores and every replica reads), against
  the raw key (UTF-8 text, or 4 bytes an id);
- publish: the writer's CPU a decision (the request path's `publish` and the flush's
  encoding and compression; before batches all of it ran on the request's path);
- apply: the reader's CPU a decision, through the real `DecisionSync._apply` into the
  real `cache_aware` policy's tree (decode, validate, insert): what a replica pays for
  every other replica's decision. No Redis round trip is timed (one XADD and one reply
  an entry now, where it was one a decision: the Redis side is not in these figures).

The arms run in alternating rounds on one machine; `time.process_time` per round.
""",
    sync_wire_arguments,
    sync_wire_main,
)


# -- kv-score ----------------------------------------------------------------------------
# Runs in the side's own tree. With `count` set, that room's routing calls are made
# through `functools.reduce`: the C function callgrind's `--toggle-collect` counts inside
# (nothing else calls it here).
KV_SCORE_SIDE = r"""
import functools, gc, hashlib, json, random, sys, time
import numpy as np
from loadtests.load.workloads import NATO_WORDS as WORDS
from loadtests.simulate.worker import CostModel, Job, SimWorker
from router.holdings.kv_feed import KvEventFeed, StreamState
from router.holdings.kv_index import BlockIndex
from router.policy import build_routing
from router.policy.base import FleetView, RouteRequest
from shared.config import RouterConfig
from shared.serving.gc_policy import freeze_startup
from shared.tokens.prompt_tokens import PromptTokens, encode_prompt
from shared.tokens.text_tokenizer import TextTokenizer
from worker.backends.sim_model import answer_ids

a = json.loads(sys.argv[1])
tokens = PromptTokens.load(a["tokenizer"])
# The worker's tokenizer writes its answers, as text the next turn renders (the sim
# worker's own, or the model's where it serves one: `--tokenizer DIR`).
engine = TextTokenizer() if a["tokenizer"] == "sim" else tokens.tokenizer
ids_of = [f"w{i}" for i in range(a["workers"])]
cost = CostModel(cache_tokens=a["cache_tokens"], kv_events_block_size=16, max_running=256,
                 prefill_us_per_token=0.0, decode_ms_per_token=0.0, decode_us_per_1k_context=0.0)
workers = [SimWorker(i, cost) for i in range(a["workers"])]
feed = KvEventFeed(registry=None)  # entries applied here, as the reader would
index = feed.indexes["m"] = BlockIndex(16)
for w in ids_of:
    feed.streams[w] = StreamState("m", 1.0, status="ok")
config = RouterConfig(tokenizer="sim")  # (the rooms key on whatever ids they are given)
on = build_routing(config, random.Random(0), feed=feed)
tok = build_routing(config, random.Random(0))
fleet_on = FleetView(ids_of, capacities=[a["cache_tokens"]] * a["workers"])
fleet_tok = FleetView(ids_of, capacities=[a["cache_tokens"]] * a["workers"])
freeze_startup()
# No collection in a timed call: one would be over the simulated engines' objects, which
# no router holds (the router's collector is set apart: shared/serving/gc_policy.py).
gc.disable()
pc = time.perf_counter
t_on = t_tok = 0.0
timed = 0
digest = hashlib.sha256()
rid = 0
now = 0.0

def route(_, call):
    return call()

def counted(call):
    return functools.reduce(route, (call,), None)

def plain(call):
    return call()


for round_ in range(a["rounds"] + 1):  # round 0: the warm-up
    rng = random.Random(100 + round_)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(a["words"]))}]
             for s in range(a["sessions"])]
    via_on = counted if round_ and a["count"] == "on" else plain  # (the warm-up: never)
    via_tok = counted if round_ and a["count"] == "tok" else plain
    for turn in range(a["requests"] // a["sessions"]):
        now += 0.165  # a turn of router-tokens' 16 chats, live
        jobs = []
        for i, chat in enumerate(chats):
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            ids = tokens.chat(chat, True)
            at = now + i * 0.001
            r_on, r_tok = RouteRequest("", tokens=ids), RouteRequest("", tokens=ids)
            t0 = pc()
            d = via_on(lambda: on.select(r_on, fleet_on, at))
            t1 = pc()
            d_tok = via_tok(lambda: tok.select(r_tok, fleet_tok, at))
            t2 = pc()
            if round_:
                t_on += t1 - t0
                t_tok += t2 - t1
                timed += 1
            p = on.holdings.kv.detail
            digest.update(repr((d.worker_id, d.reason, d.matched_chars, d.predicted_tokens,
                                sorted(p.items()))).encode())
            # The worker's ids, encoded apart: reading `ids` id by id would build their
            # flat tuple, which the live router never does (PromptIds).
            flat = encode_prompt(tokens.tokenizer,
                                 tokens.tokenizer.apply_chat_template(chat, True))
            answer = answer_ids(engine, flat, 4)
            rid += 1
            w = ids_of.index(d.worker_id)
            job = Job(rid, at, np.array(flat), np.array(answer), "")
            workers[w].submit(job)
            fleet_on.loads[w] += 1
            fleet_tok.loads[ids_of.index(d_tok.worker_id)] += 1
            jobs.append((job, d, d_tok, chat, answer))
        for wk in workers:  # each worker runs its turn, then its events are read
            t = now
            while wk.engine.has_work:
                end = wk.start_step(t)
                if end is None:
                    break
                wk.finish_step(end)
                t = end
            events = wk.engine.kv_events.drain(1 << 30)
            if events:
                index.apply(ids_of[wk.index], events, now + 0.1)
        for job, d, d_tok, chat, answer in jobs:
            on.holdings.answered(d.worker_id, d.predicted_tokens or 0.0, job.cached, None, now)
            tok.holdings.answered(d_tok.worker_id, d_tok.predicted_tokens or 0.0, job.cached,
                                  None, now)
            chat.append({"role": "assistant", "content": engine.decode(answer)})
        fleet_on.loads[:] = [0] * a["workers"]
        fleet_tok.loads[:] = [0] * a["workers"]
print(json.dumps({"on_us": t_on / timed * 1e6, "tok_us": t_tok / timed * 1e6,
                  "requests": timed, "digest": digest.hexdigest()[:16]}))
"""

KV_SCORE_CALLGRIND = [
    "valgrind",
    "--tool=callgrind",
    "--collect-atstart=no",
    "--toggle-collect=functools_reduce",
]


def side_run(script: str, tree: Path, spec: dict, count: str = "") -> dict:
    """One run of an in-process bench `script` (KV_SCORE_SIDE, CHAT_IDS_SIDE) in `tree`,
    given `spec` as JSON; with `count` (an arm's name), under callgrind, counting the
    instructions of that arm's calls (`ir`: a request)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    cmd = [sys.executable, "-c", script, json.dumps(spec | {"count": count})]
    with tempfile.TemporaryDirectory() as tmp:
        outfile = Path(tmp) / "callgrind.out"
        if count:
            cmd = [*KV_SCORE_CALLGRIND, f"--callgrind-out-file={outfile}", *cmd]
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
        result: dict = json.loads(out.stdout)
        if count:
            total = re.search(r"^totals: (\d+)", outfile.read_text(), re.M)
            assert total is not None, "no callgrind totals"
            result["ir"] = int(total.group(1)) / result["requests"]
    return result


def compare_arms(
    args: argparse.Namespace, script: str, spec: dict, arms: tuple[str, str], same: str
) -> int:
    """`script`'s two arms (`arms`: the dearer, then the one it is measured against) in
    this tree and, with `--before-ref`, in that ref's, sides alternating per repeat; prints
    each side's cost (dearer minus the other, a request: medians of timed runs, or
    callgrind's instructions) and, with two sides, after / before and whether both gave
    the same digest (`same` names what it covers). Exit status 1 where they did not."""
    more, less = arms
    with checkout(args.before_ref or "HEAD") as before:
        sides = {"this tree": ROOT}
        if args.before_ref:
            sides = {f"@{short(args.before_ref)}": before, "this tree": ROOT}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        costs = {}
        if args.instructions:
            for name, tree in sides.items():
                a, b = side_run(script, tree, spec, more), side_run(script, tree, spec, less)
                runs[name] += [a, b]
                costs[name] = a["ir"] - b["ir"]
                print(f"{name:12s} instructions a request: {more} {a['ir']:,.0f}, "
                      f"{less} {b['ir']:,.0f}, {more} - {less} {costs[name]:,.0f}", flush=True)  # fmt: skip
        for _ in range(0 if args.instructions else args.repeats):
            for name, tree in sides.items():
                runs[name].append(side_run(script, tree, spec))
        for name, got in runs.items():
            if args.instructions:
                continue
            diffs = sorted(g[f"{more}_us"] - g[f"{less}_us"] for g in got)
            mores = sorted(g[f"{more}_us"] for g in got)
            lesses = sorted(g[f"{less}_us"] for g in got)
            mid = len(got) // 2
            costs[name] = diffs[mid]
            print(f"{name:12s} a request (medians of {len(got)}): {more} {mores[mid]:.1f} us, "
                  f"{less} {lesses[mid]:.1f} us, {more} - {less} {diffs[mid]:.1f} us "
                  f"(min {diffs[0]:.1f}, max {diffs[-1]:.1f})")  # fmt: skip
        if len(sides) == 2:
            a, b = costs.values()
            print(f"{more} - {less}, after / before: {b / a:.2f}x")
            digests = {g["digest"] for got in runs.values() for g in got}
            print(f"same {same}: {'yes' if len(digests) == 1 else 'NO'}")
            return 0 if len(digests) == 1 else 1
    return 0


def kv_score_arguments(p: argparse.ArgumentParser) -> None:
    in_process_arguments(p)
    p.add_argument("--workers", type=int, default=1, help="sim workers (router-tokens: 1)")
    p.add_argument("--cache-tokens", type=int, default=50_000, help="each worker's pool")


def in_process_arguments(p: argparse.ArgumentParser) -> None:
    """`kv-score`'s and `chat-ids`' common arguments: the conversations, the sides, how."""
    p.add_argument("--rounds", type=int, default=2, help="rounds timed, after a warm-up one")
    p.add_argument("--requests", type=int, default=320, help="per round")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--tokenizer", default="sim", help="sim, or a tokenizer folder")
    p.add_argument("--repeats", type=int, default=5, help="per side, alternating")
    p.add_argument("--before-ref", default="", help="also run the code of this git ref")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions (callgrind) instead of timing")  # fmt: skip


def kv_score_main(args: argparse.Namespace) -> int:
    keys = ("rounds", "requests", "sessions", "words", "workers", "tokenizer", "cache_tokens")
    spec = {k: getattr(args, k) for k in keys}
    return compare_arms(args, KV_SCORE_SIDE, spec, ("on", "tok"), "decisions and predictions")


KV_SCORE = Command(
    """A request's KV scoring in process: the `on` routing step against `tok`'s, before vs after.

    python -m loadtests kv-score [--rounds 2] [--workers 1] [--repeats 5] [--before-ref REF]
                                 [--tokenizer sim|DIR] [--instructions]

`router-tokens`' conversations (16 chats of ~2k-token prompts, turn by turn, a warm-up
round and `--rounds` more) routed in one process by two rooms side by side: `tok` (the
tree on the prompt ids) and `on` (the same tree and a real KV-event feed and index). The
workers are the engine itself (loadtests/simulate/worker.py: the sim's radix cache, its
50,000-token pool evicting, its answers), and the index applies their real KV events
between turns, as the live feed does; each request goes where `on` routes it. Timed: each
request's `Routing.select` alone, the two rooms alternating request by request, so a busy
neighbour slows both alike; the cost is `on - tok` per request.

`--before-ref REF` runs the same in the router's code from that git ref (loadtests/kit.py),
alternating sides per repeat, each in its own process; both sides must route alike (a
digest of every `on` decision and prediction, compared), so a faster side that decides
differently fails the bench. `--instructions` counts instructions instead of timing
(valgrind's callgrind, counting only inside one room's routing calls: exact where a shared
machine's timings swing; ~2 minutes a run, two runs a side: `on`'s calls, `tok`'s). The
garbage collector is off in the timed calls: a collection there would walk the simulated
engines' objects, which no router holds.
""",
    kv_score_arguments,
    kv_score_main,
)


# -- chat-ids ----------------------------------------------------------------------------
# Runs in the side's own tree. With `count` set, that arm's calls are made through
# `functools.reduce`: the C function callgrind's `--toggle-collect` counts inside.
CHAT_IDS_SIDE = r"""
import functools, gc, hashlib, json, random, sys, time
from loadtests.load.workloads import NATO_WORDS as WORDS
from router.http.tokenize import ChatPrompt, request_tokens
from shared.serving.body import parse_json_object
from shared.serving.gc_policy import freeze_startup
from shared.tokens.prompt_tokens import PromptTokens, encode_prompt
from shared.tokens.text_tokenizer import TextTokenizer
from shared.wire.plain_body import chat_text, plain_extra
from worker.backends.sim_model import answer_ids

try:  # the handler's reading of a chat to tokenize (since the thirteenth pass)
    from shared.wire.plain_body import plain_chat
except ImportError:  # before it: the check, and the turns built in `request_tokens`
    plain_chat = None

a = json.loads(sys.argv[1])
tokens = PromptTokens.load(a["tokenizer"])
# The worker's tokenizer writes its answers, as text the next turn renders.
engine = TextTokenizer() if a["tokenizer"] == "sim" else tokens.tokenizer


def off(body):
    extra = plain_extra("chat", body)
    return chat_text(body["messages"]), extra


def tok(body):
    if plain_chat is None:
        extra, turns = plain_extra("chat", body), body["messages"]
    else:
        extra, turns = plain_chat(body)
    prompt = ChatPrompt(turns, body.get("add_generation_prompt") is not False)
    ids = request_tokens(tokens, prompt)
    return ids, ids.tree_key(), extra


def route(_, call):
    return call()


def counted(call, body):
    return functools.reduce(route, (lambda: call(body),), None)


def plain(call, body):
    return call(body)


freeze_startup()
gc.disable()
pc = time.perf_counter
spent = {"off": 0.0, "tok": 0.0}
timed = 0
digest = hashlib.sha256()
for round_ in range(a["rounds"] + 1):  # round 0: the warm-up
    rng = random.Random(100 + round_)
    chats = [[{"role": "system", "content": f"Chat {s}. " +
               " ".join(rng.choice(WORDS) for _ in range(a["words"]))}]
             for s in range(a["sessions"])]
    via = {arm: counted if round_ and a["count"] == arm else plain for arm in spent}
    for turn in range(a["requests"] // a["sessions"]):
        for chat in chats:
            chat.append({"role": "user", "content": f"Turn {turn}: {rng.choice(WORDS)}?"})
            body = parse_json_object(json.dumps({"messages": chat, "max_tokens": 4}).encode())
            t0 = pc()
            via["off"](off, body)
            t1 = pc()
            ids, key, _ = via["tok"](tok, body)
            t2 = pc()
            if round_:
                spent["off"] += t1 - t0
                spent["tok"] += t2 - t1
                timed += 1
            digest.update(key.encode("latin-1"))
            digest.update(repr(ids.block_keys(16)).encode())
            flat = encode_prompt(engine, engine.apply_chat_template(chat, True))
            chat.append({"role": "assistant",
                         "content": engine.decode(answer_ids(engine, flat, 4))})
print(json.dumps({"off_us": spent["off"] / timed * 1e6, "tok_us": spent["tok"] / timed * 1e6,
                  "requests": timed, "digest": digest.hexdigest()[:16]}))
"""


def chat_ids_main(args: argparse.Namespace) -> int:
    spec = {k: getattr(args, k) for k in ("rounds", "requests", "sessions", "words", "tokenizer")}
    return compare_arms(args, CHAT_IDS_SIDE, spec, ("tok", "off"), "ids and keys")


CHAT_IDS = Command(
    """A chat's prompt ids from its body, in process: what `tok` reads beyond `off`.

    python -m loadtests chat-ids [--rounds 2] [--repeats 5] [--tokenizer sim|DIR]
                                 [--before-ref REF] [--instructions]

`router-tokens`' conversations (16 chats of a ~700-word system prompt, a question a turn,
the sim worker's 4-token answers: `worker/backends/sim_model.py`), turn by turn, a
warm-up round and `--rounds` more, each round new chats. Every request's JSON body is
decoded as the router decodes it (not timed), then read two ways, alternating request by
request, so a busy neighbour slows both alike:

- `off`: the handler's reading without a tokenizer (router/http/handlers.py): the hand
  check and the routing text (`plain_extra`, `chat_text`);
- `tok`: its reading with one: the hand check, the chat's prompt ids from the
  tokenizer's caches (`request_tokens`, router/http/tokenize.py) and their tree key.

The cost is `tok - off` a request. `--before-ref REF` runs the same in the code of that
git ref (loadtests/kit.py), sides alternating per repeat, each in its own process; both
must give the same ids and keys (a digest of every request's tree key and block keys,
compared). `--instructions` counts instructions instead of timing (valgrind's callgrind,
inside one arm's calls: exact where a shared machine's timings swing; a run an arm a
side). The collector is off in the timed calls (the router's passes are rare:
shared/serving/gc_policy.py).
""",
    in_process_arguments,
    chat_ids_main,
)
