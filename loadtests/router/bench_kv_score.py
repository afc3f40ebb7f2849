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
(valgrind's callgrind, counting only inside the timed calls: exact where a shared machine's
timings swing), one run a side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.kit import ROOT, checkout, short

# Runs in the side's own tree. With `count` set, that room's routing calls are made
# through `functools.reduce`: the C function callgrind's `--toggle-collect` counts inside
# (nothing else calls it here).
SIDE = r"""
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

CALLGRIND = [
    "valgrind",
    "--tool=callgrind",
    "--collect-atstart=no",
    "--toggle-collect=functools_reduce",
]


def side(tree: Path, args: argparse.Namespace, count: str = "") -> dict:
    """One run of SIDE in `tree`; with `count` ("on" or "tok"), under callgrind, counting
    the instructions of that room's routing calls (`ir`: a request)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    spec = {k: getattr(args, k) for k in
            ("rounds", "requests", "sessions", "words", "workers", "tokenizer", "cache_tokens")}  # fmt: skip
    cmd = [sys.executable, "-c", SIDE, json.dumps(spec | {"count": count})]
    with tempfile.TemporaryDirectory() as tmp:
        outfile = Path(tmp) / "callgrind.out"
        if count:
            cmd = [*CALLGRIND, f"--callgrind-out-file={outfile}", *cmd]
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
        result: dict = json.loads(out.stdout)
        if count:
            total = re.search(r"^totals: (\d+)", outfile.read_text(), re.M)
            assert total is not None, "no callgrind totals"
            result["ir"] = int(total.group(1)) / result["requests"]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=2, help="rounds timed, after a warm-up one")
    p.add_argument("--requests", type=int, default=320, help="per round")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--words", type=int, default=700, help="system prompt words (~2k tokens)")
    p.add_argument("--workers", type=int, default=1, help="sim workers (router-tokens: 1)")
    p.add_argument("--cache-tokens", type=int, default=50_000, help="each worker's pool")
    p.add_argument("--tokenizer", default="sim", help="sim, or a tokenizer folder")
    p.add_argument("--repeats", type=int, default=5, help="per side, alternating")
    p.add_argument("--before-ref", default="", help="also run the router's code of this git ref")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions (callgrind), one run a side")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    with checkout(args.before_ref or "HEAD") as before:
        sides = {"this tree": ROOT}
        if args.before_ref:
            sides = {f"@{short(args.before_ref)}": before, "this tree": ROOT}
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        costs = {}
        if args.instructions:
            for name, tree in sides.items():
                on, tok = side(tree, args, "on"), side(tree, args, "tok")
                runs[name] += [on, tok]
                costs[name] = on["ir"] - tok["ir"]
                print(f"{name:12s} instructions a request: on {on['ir']:,.0f}, "
                      f"tok {tok['ir']:,.0f}, on - tok {costs[name]:,.0f}", flush=True)  # fmt: skip
        for _ in range(0 if args.instructions else args.repeats):
            for name, tree in sides.items():
                runs[name].append(side(tree, args))
        for name, got in runs.items():
            if args.instructions:
                continue
            diffs = sorted(g["on_us"] - g["tok_us"] for g in got)
            ons = sorted(g["on_us"] for g in got)
            toks = sorted(g["tok_us"] for g in got)
            mid = len(got) // 2
            costs[name] = diffs[mid]
            print(f"{name:12s} a request (medians of {len(got)}): on {ons[mid]:.1f} us, "
                  f"tok {toks[mid]:.1f} us, on - tok {diffs[mid]:.1f} us "
                  f"(min {diffs[0]:.1f}, max {diffs[-1]:.1f})")  # fmt: skip
        if len(sides) == 2:
            a, b = costs.values()
            print(f"on - tok, after / before: {b / a:.2f}x")
            digests = {g["digest"] for got in runs.values() for g in got}
            same = len(digests) == 1
            print(f"same decisions and predictions: {'yes' if same else 'NO'}")
            return 0 if same else 1
    return 0
